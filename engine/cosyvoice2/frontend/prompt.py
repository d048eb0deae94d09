"""Zero-shot voice preparation for CosyVoice2: prompt audio + its transcript -> model inputs.

A zero-shot voice is conditioned on four things computed once from the prompt:

- ``prompt_text_ids``: the transcript tokenized with the model's Qwen tokenizer;
- ``speech_tokens``: 25 Hz speech tokens of the prompt (``speech_tokenizer_v2.onnx`` on
  the 16 kHz Whisper log-mel);
- ``speech_feat``: the 24 kHz 80-bin mel of the prompt, 50 frames a second, time-major;
- ``embedding``: the CAM++ speaker embedding (``campplus.onnx`` on mean-normalised
  16 kHz Kaldi fbank).

As in the official frontend, mel frames and tokens are then trimmed to exactly two
frames per token (``n = min(frames // 2, tokens)``; ``2n`` frames, ``n`` tokens).

The prompt audio is checked first (:class:`PromptAudioError` and subclasses, all
``ValueError``): a readable WAV (PCM 8/16/24/32-bit or float), at least 16 kHz, mono
or downmixed, 1 to 30 seconds, not silent and not heavily clipped. Resampling uses
soxr, from the original rate straight to 16 kHz and to 24 kHz.
"""

from __future__ import annotations

import math
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tts_gateway.engine.cosyvoice2.frontend import features
from tts_gateway.engine.cosyvoice2.modeldir.layout import CAMPPLUS_FILE, SPEECH_TOKENIZER_FILE, TOKENIZER_DIR

__all__ = [
    "TOKENIZER_SPECIALS",
    "TextTokenizer",
    "PromptAudioError",
    "PromptFormatError",
    "PromptLengthError",
    "PromptSilentError",
    "PromptClippedError",
    "PromptTextError",
    "PromptLimits",
    "read_wav",
    "check_prompt_audio",
    "PreparedVoice",
    "CosyVoice2Frontend",
]

# The special tokens the official frontend registers on the Qwen tokenizer (they are
# untrained in the released LLM, except as markers such as <|endofprompt|>).
TOKENIZER_SPECIALS: dict[str, Any] = {
    "eos_token": "<|endoftext|>",
    "pad_token": "<|endoftext|>",
    "additional_special_tokens": [
        "<|im_start|>", "<|im_end|>", "<|endofprompt|>", "[breath]", "<strong>", "</strong>", "[noise]",
        "[laughter]", "[cough]", "[clucking]", "[accent]", "[quick_breath]", "<laughter>", "</laughter>",
        "[hissing]", "[sigh]", "[vocalized-noise]", "[lipsmack]", "[mn]",
    ],
}

TOKENIZER_RATE = 16000  # speech tokenizer and speaker encoder input rate
MAX_TOKENIZER_SECONDS = 30.0  # the released speech tokenizer refuses longer input


# ---------------------------------------------------------------------------
# Text


class TextTokenizer:
    """The model's text tokenizer, as the official frontend sets it up.

    ``transformers.AutoTokenizer`` on ``CosyVoice-BlankEN`` (offline only), plus the
    CosyVoice special tokens; :meth:`encode` gives the ids the official
    ``QwenTokenizer.encode`` gives (no BOS/EOS are added by Qwen's tokenizer).
    """

    def __init__(self, path: str | Path, skip_special_tokens: bool = True) -> None:
        from transformers import AutoTokenizer

        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"{path}: tokenizer directory not found")
        self.path = path
        self.skip_special_tokens = skip_special_tokens
        self._tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        self._tok.add_special_tokens(
            {k: (list(v) if isinstance(v, list) else v) for k, v in TOKENIZER_SPECIALS.items()}
        )
        # The Rust tokenizer under the transformers wrapper (the special tokens are in it
        # too): the same ids as calling the wrapper, as the official frontend does, without
        # its per-call Python work. encode() runs on the event loop for every piece of agent
        # text: at 256 sessions the wrapper was 17% of the loop's time.
        self._backend = self._tok.backend_tokenizer
        self._lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        # The fast tokenizer is not safe to call from several threads at once.
        with self._lock:
            return self._backend.encode(text).ids

    def encode_with_ends(self, text: str) -> tuple[list[int], list[int]]:
        """The ids of ``text`` and, for each, where in ``text`` its characters end (word timings
        map text tokens back to words through these)."""
        with self._lock:
            encoding = self._backend.encode(text)
        return encoding.ids, [end for _, end in encoding.offsets]

    def decode(self, ids: Sequence[int]) -> str:
        with self._lock:
            return self._tok.batch_decode([list(ids)], skip_special_tokens=self.skip_special_tokens)[0]

    def token_id(self, token: str) -> int:
        with self._lock:
            return int(self._tok.convert_tokens_to_ids(token))

    def __len__(self) -> int:
        return len(self._tok)


# ---------------------------------------------------------------------------
# Prompt audio


class PromptAudioError(ValueError):
    """The prompt audio (or text) cannot make a voice; the message is meant for the user."""


class PromptFormatError(PromptAudioError):
    pass


class PromptLengthError(PromptAudioError):
    pass


class PromptSilentError(PromptAudioError):
    pass


class PromptClippedError(PromptAudioError):
    pass


class PromptTextError(PromptAudioError):
    pass


@dataclass(frozen=True)
class PromptLimits:
    min_seconds: float = 1.0
    max_seconds: float = MAX_TOKENIZER_SECONDS
    min_sample_rate: int = TOKENIZER_RATE
    min_rms_dbfs: float = -50.0  # quieter than this is treated as silence
    max_clipped_fraction: float = 0.005  # share of samples in flat runs at full scale
    max_text_chars: int = 1000


_PCM = 1
_FLOAT = 3
_EXTENSIBLE = 0xFFFE


def read_wav(data: bytes) -> tuple[np.ndarray, int]:
    """Decode a RIFF/WAVE file: ``(samples [frames, channels] float32 in [-1, 1], sample_rate)``.

    PCM 8 (unsigned), 16, 24 and 32-bit, IEEE float 32/64, and WAVE_FORMAT_EXTENSIBLE
    wrappers of those. Raises :class:`PromptFormatError` for anything else.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise PromptFormatError("prompt audio must be the bytes of a WAV file")
    data = bytes(data)
    if len(data) < 12 or data[:4] not in (b"RIFF", b"RF64") or data[8:12] != b"WAVE":
        raise PromptFormatError("prompt audio is not a WAV file (expected a RIFF/WAVE header)")
    pos = 12
    fmt = None
    payload = None
    while pos + 8 <= len(data):
        chunk_id = data[pos:pos + 4]
        size = struct.unpack_from("<I", data, pos + 4)[0]
        body = data[pos + 8:pos + 8 + size]
        if chunk_id == b"fmt ":
            if len(body) < 16:
                raise PromptFormatError("WAV file has a truncated format chunk")
            tag, channels, rate, _, block_align, bits = struct.unpack_from("<HHIIHH", body, 0)
            if tag == _EXTENSIBLE and len(body) >= 26:
                tag = struct.unpack_from("<H", body, 24)[0]
            fmt = (tag, channels, rate, block_align, bits)
        elif chunk_id == b"data":
            # a streamed WAV may carry a 0 or 0xFFFFFFFF size: take what is there
            payload = data[pos + 8:] if size in (0, 0xFFFFFFFF) or pos + 8 + size > len(data) else body
            break
        pos += 8 + size + (size & 1)
    if fmt is None or payload is None:
        raise PromptFormatError("WAV file has no format or no data chunk")
    tag, channels, rate, block_align, bits = fmt
    if channels < 1 or rate < 1:
        raise PromptFormatError(f"WAV file declares {channels} channels at {rate} Hz")
    width = bits // 8
    if width < 1 or bits % 8 or block_align != width * channels:
        raise PromptFormatError(f"unsupported WAV layout ({bits}-bit, {channels} channels)")
    usable = len(payload) - len(payload) % block_align
    raw = payload[:usable]
    if tag == _PCM and bits == 8:
        x = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif tag == _PCM and bits == 16:
        x = np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0
    elif tag == _PCM and bits == 24:
        b = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
        v = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        v = np.where(v >= 1 << 23, v - (1 << 24), v)
        x = v.astype(np.float32) / float(1 << 23)
    elif tag == _PCM and bits == 32:
        x = (np.frombuffer(raw, "<i4").astype(np.float64) / 2147483648.0).astype(np.float32)
    elif tag == _FLOAT and bits == 32:
        x = np.frombuffer(raw, "<f4").astype(np.float32)
    elif tag == _FLOAT and bits == 64:
        x = np.frombuffer(raw, "<f8").astype(np.float32)
    else:
        raise PromptFormatError(f"unsupported WAV encoding (format tag {tag}, {bits}-bit); use PCM or float")
    return x.reshape(-1, channels), int(rate)


def _to_mono(audio: np.ndarray) -> np.ndarray:
    a = np.asarray(audio)
    if a.dtype.kind not in "fiu":
        raise PromptFormatError("prompt audio must be numeric samples")
    if a.dtype.kind in "iu":
        info = np.iinfo(a.dtype)
        a = (a.astype(np.float64) - (info.min + info.max + 1) / 2) / ((info.max - info.min + 1) / 2)
    a = a.astype(np.float32, copy=False)
    if a.ndim == 2:
        # [frames, channels] (as read_wav gives); a [channels, frames] array is transposed
        if a.shape[0] < a.shape[1] and a.shape[0] <= 8:
            a = a.T
        a = a.mean(axis=1)
    elif a.ndim != 1:
        raise PromptFormatError(f"prompt audio must be 1-D or [frames, channels], got shape {a.shape}")
    return np.ascontiguousarray(a, dtype=np.float32)


def _clipped_fraction(x: np.ndarray, level: float = 0.99, run: int = 3) -> float:
    """Share of samples inside flat runs (>= ``run`` equal samples) at or above ``level`` of full scale."""
    if x.size < run:
        return 0.0
    hot = np.abs(x) >= level
    if not hot.any():
        return 0.0
    flat = np.zeros_like(hot)
    flat[1:] = (x[1:] == x[:-1]) & hot[1:] & hot[:-1]
    # samples that belong to runs: mark both ends of every flat step, then count runs >= run
    in_run = np.zeros_like(hot)
    in_run[1:] |= flat[1:]
    in_run[:-1] |= flat[1:]
    # length of each run of True in in_run
    edges = np.diff(np.concatenate(([0], in_run.view(np.int8), [0])))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    lengths = ends - starts
    return float(lengths[lengths >= run].sum()) / x.size


def check_prompt_audio(audio: np.ndarray, sample_rate: int, limits: PromptLimits = PromptLimits()) -> np.ndarray:
    """Validate prompt audio and return it as mono float32; raises a :class:`PromptAudioError`."""
    if not isinstance(sample_rate, (int, np.integer)) or sample_rate <= 0:
        raise PromptFormatError(f"invalid sample rate {sample_rate!r}")
    if sample_rate < limits.min_sample_rate:
        raise PromptFormatError(
            f"prompt audio is sampled at {sample_rate} Hz; at least {limits.min_sample_rate} Hz is needed"
        )
    x = _to_mono(audio)
    if not np.isfinite(x).all():
        raise PromptFormatError("prompt audio contains NaN or infinite samples")
    seconds = x.size / float(sample_rate)
    if seconds < limits.min_seconds:
        raise PromptLengthError(
            f"prompt audio is {seconds:.2f} s long; at least {limits.min_seconds:g} s of speech is needed"
        )
    if seconds > limits.max_seconds:
        raise PromptLengthError(
            f"prompt audio is {seconds:.1f} s long; at most {limits.max_seconds:g} s is supported"
        )
    if np.abs(x).max() > 1.0 + 1e-3:
        raise PromptFormatError("prompt audio samples exceed full scale ([-1, 1])")
    rms = float(np.sqrt(np.mean(np.square(x, dtype=np.float64))))
    dbfs = 20.0 * math.log10(max(rms, 1e-12))
    if dbfs < limits.min_rms_dbfs:
        raise PromptSilentError(
            f"prompt audio is silent or far too quiet ({dbfs:.0f} dBFS RMS; needs at least "
            f"{limits.min_rms_dbfs:.0f} dBFS)"
        )
    clipped = _clipped_fraction(x)
    if clipped > limits.max_clipped_fraction:
        raise PromptClippedError(
            f"prompt audio is heavily clipped ({100 * clipped:.1f}% of samples are flat at full scale); "
            "record it at a lower level"
        )
    return x


def _resample(x: np.ndarray, rate_in: int, rate_out: int) -> np.ndarray:
    if rate_in == rate_out:
        return x.astype(np.float32, copy=True)
    import soxr

    return soxr.resample(x, rate_in, rate_out, quality="HQ").astype(np.float32, copy=False)


# ---------------------------------------------------------------------------
# Prepared voice


@dataclass
class PreparedVoice:
    """The zero-shot conditioning of one voice, in the official frontend's shapes and dtypes."""

    prompt_text: str
    prompt_text_ids: torch.Tensor  # [1, N] int32
    speech_tokens: torch.Tensor  # [1, T] int32, 25 Hz
    speech_feat: torch.Tensor  # [1, 2T, 80] float32, 50 Hz, time-major
    embedding: torch.Tensor  # [1, 192] float32
    meta: dict[str, Any] = field(default_factory=dict)

    TENSORS = ("prompt_text_ids", "speech_tokens", "speech_feat", "embedding")

    def model_input(self) -> dict[str, torch.Tensor]:
        """The official ``frontend_zero_shot`` dict, without the text to synthesise."""
        n_text = torch.tensor([self.prompt_text_ids.shape[1]], dtype=torch.int32)
        n_tok = torch.tensor([self.speech_tokens.shape[1]], dtype=torch.int32)
        n_feat = torch.tensor([self.speech_feat.shape[1]], dtype=torch.int32)
        return {
            "prompt_text": self.prompt_text_ids, "prompt_text_len": n_text,
            "llm_prompt_speech_token": self.speech_tokens, "llm_prompt_speech_token_len": n_tok,
            "flow_prompt_speech_token": self.speech_tokens, "flow_prompt_speech_token_len": n_tok.clone(),
            "prompt_speech_feat": self.speech_feat, "prompt_speech_feat_len": n_feat,
            "llm_embedding": self.embedding, "flow_embedding": self.embedding,
        }

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.TENSORS}

    def check(self) -> None:
        """Shape/dtype invariants (used after loading from disk)."""
        t, f = self.speech_tokens, self.speech_feat
        ok = (
            self.prompt_text_ids.dtype == torch.int32 and self.prompt_text_ids.dim() == 2
            and t.dtype == torch.int32 and t.dim() == 2 and t.shape[0] == 1
            and f.dtype == torch.float32 and f.dim() == 3 and f.shape[1] == 2 * t.shape[1]
            and self.embedding.dtype == torch.float32 and self.embedding.dim() == 2
        )
        if not ok:
            raise ValueError("prepared voice tensors have unexpected shapes or dtypes")


class CosyVoice2Frontend:
    """Builds :class:`PreparedVoice` objects from prompt audio, with a model directory's tokenizer and ONNX models.

    ONNX sessions are created on first use (voice registration), not at construction.
    """

    def __init__(self, model_dir: str | Path, configs=None, limits: PromptLimits = PromptLimits(),
                 intra_op_threads: int = 1, providers: Sequence[str] | None = None) -> None:
        self.model_dir = Path(model_dir)
        if configs is None:
            from tts_gateway.engine.cosyvoice2.modeldir.reading import load_model_configs

            configs = load_model_configs(self.model_dir)
        self.configs = configs
        fe = configs.frontend
        self.mel_kwargs = dict(n_fft=fe.n_fft, num_mels=fe.num_mels, sampling_rate=fe.sampling_rate,
                               hop_size=fe.hop_size, win_size=fe.win_size, fmin=fe.fmin, fmax=fe.fmax,
                               center=fe.center)
        self.mel_rate = fe.sampling_rate
        self.token_mel_ratio = configs.token_mel_ratio
        self.limits = limits
        self.intra_op_threads = intra_op_threads
        self.providers = list(providers) if providers else None
        self.tokenizer = TextTokenizer(self.model_dir / TOKENIZER_DIR, skip_special_tokens=fe.skip_special_tokens)
        self._sessions: dict[str, Any] = {}
        self._lock = threading.Lock()

    # -- ONNX ---------------------------------------------------------------

    def _session(self, filename: str):
        with self._lock:
            session = self._sessions.get(filename)
            if session is None:
                import onnxruntime

                path = self.model_dir / filename
                if not path.is_file():
                    raise FileNotFoundError(f"{path}: not found in the model directory")
                options = onnxruntime.SessionOptions()
                options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
                options.intra_op_num_threads = self.intra_op_threads
                options.inter_op_num_threads = 1
                providers = self.providers
                if providers is None:
                    available = onnxruntime.get_available_providers()
                    providers = ["CPUExecutionProvider"]
                    if filename == SPEECH_TOKENIZER_FILE and "CUDAExecutionProvider" in available:
                        providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
                session = onnxruntime.InferenceSession(str(path), sess_options=options, providers=providers)
                self._sessions[filename] = session
            return session

    # -- the four parts ------------------------------------------------------

    def text_ids(self, text: str) -> torch.Tensor:
        return torch.tensor([self.tokenizer.encode(text)], dtype=torch.int32)

    def speech_tokens(self, audio_16k: np.ndarray) -> torch.Tensor:
        """``[1, T]`` int32 speech tokens of 16 kHz mono audio (at most 30 s)."""
        x = np.asarray(audio_16k, dtype=np.float32).reshape(-1)
        if x.size / TOKENIZER_RATE > MAX_TOKENIZER_SECONDS:
            raise PromptLengthError(f"speech tokenizer input longer than {MAX_TOKENIZER_SECONDS:g} s")
        feat = features.log_mel_spectrogram(torch.from_numpy(x).unsqueeze(0), n_mels=128)
        session = self._session(SPEECH_TOKENIZER_FILE)
        inputs = session.get_inputs()
        out = session.run(None, {
            inputs[0].name: feat.numpy(),
            inputs[1].name: np.array([feat.shape[2]], dtype=np.int32),
        })[0]
        return torch.tensor([np.asarray(out).reshape(-1).tolist()], dtype=torch.int32)

    def speaker_embedding(self, audio_16k: np.ndarray) -> torch.Tensor:
        """``[1, 192]`` float32 CAM++ embedding of 16 kHz mono audio."""
        x = torch.from_numpy(np.asarray(audio_16k, dtype=np.float32).reshape(-1))
        feat = features.campplus_features(x)
        session = self._session(CAMPPLUS_FILE)
        out = session.run(None, {session.get_inputs()[0].name: feat.numpy()})[0]
        return torch.tensor([np.asarray(out, dtype=np.float32).reshape(-1).tolist()], dtype=torch.float32)

    def prompt_mel(self, audio: np.ndarray) -> torch.Tensor:
        """``[1, frames, 80]`` float32 mel (time-major) of mono audio at the model rate (24 kHz)."""
        x = torch.from_numpy(np.asarray(audio, dtype=np.float32).reshape(1, -1))
        mel = features.mel_spectrogram(x, **self.mel_kwargs)  # [1, 80, frames]
        return mel.squeeze(0).transpose(0, 1).unsqueeze(0).contiguous()

    # -- whole voice ---------------------------------------------------------

    def prepare(self, audio: np.ndarray, sample_rate: int, prompt_text: str) -> PreparedVoice:
        """Validate the prompt and compute its conditioning (CPU, ~a second for a 10 s prompt)."""
        if not isinstance(prompt_text, str) or not prompt_text.strip():
            raise PromptTextError("the prompt's transcript is empty; give the exact words spoken in the audio")
        text = prompt_text.strip()
        if len(text) > self.limits.max_text_chars:
            raise PromptTextError(f"the prompt's transcript is longer than {self.limits.max_text_chars} characters")
        mono = check_prompt_audio(audio, int(sample_rate), self.limits)
        audio_16k = _resample(mono, int(sample_rate), TOKENIZER_RATE)
        audio_mel = _resample(mono, int(sample_rate), self.mel_rate)
        text_ids = self.text_ids(text)
        if text_ids.shape[1] == 0:
            raise PromptTextError("the prompt's transcript has no tokens")
        feat = self.prompt_mel(audio_mel)
        tokens = self.speech_tokens(audio_16k)
        n = min(int(feat.shape[1] / self.token_mel_ratio), tokens.shape[1])
        if n < 1:
            raise PromptLengthError("prompt audio is too short to give any speech token")
        feat = feat[:, : self.token_mel_ratio * n].contiguous()
        tokens = tokens[:, :n].contiguous()
        embedding = self.speaker_embedding(audio_16k)
        voice = PreparedVoice(
            prompt_text=text,
            prompt_text_ids=text_ids,
            speech_tokens=tokens,
            speech_feat=feat,
            embedding=embedding,
            meta={"seconds": round(mono.size / float(sample_rate), 3), "source_rate": int(sample_rate)},
        )
        voice.check()
        return voice

    def prepare_wav(self, wav_bytes: bytes, prompt_text: str) -> PreparedVoice:
        audio, rate = read_wav(wav_bytes)
        return self.prepare(audio, rate, prompt_text)
