"""Audio features the CosyVoice2 frontend needs, written in plain torch.

Three front ends feed three different models, each with its own conventions:

- ``log_mel_spectrogram``: the Whisper-style 128-bin log-mel at 16 kHz that the
  speech tokenizer (``speech_tokenizer_v2.onnx``) reads;
- ``fbank``: Kaldi filter-bank features at 16 kHz for the CAM++ speaker encoder
  (``campplus.onnx``), with Kaldi's framing, pre-emphasis, Povey window and mel scale;
- ``mel_spectrogram``: the HiFi-GAN/Matcha-style natural-log mel at 24 kHz that the
  flow model is conditioned on (the prompt mel) and that HiFT inverts.

Mel filter banks are computed here (Slaney-style for Whisper and Matcha, Kaldi-style
for ``fbank``); nothing is loaded from disk and no audio library is imported.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch

__all__ = [
    "slaney_mel_filters",
    "kaldi_mel_banks",
    "log_mel_spectrogram",
    "fbank",
    "campplus_features",
    "mel_spectrogram",
    "WHISPER_SAMPLE_RATE",
    "WHISPER_HOP",
    "MEL_SAMPLE_RATE",
    "MEL_HOP",
]

WHISPER_SAMPLE_RATE = 16000
WHISPER_N_FFT = 400
WHISPER_HOP = 160

MEL_SAMPLE_RATE = 24000
MEL_HOP = 480


# ---------------------------------------------------------------------------
# Mel scales


def _hz_to_mel_slaney(hz: np.ndarray) -> np.ndarray:
    """Slaney's Auditory Toolbox scale: linear below 1 kHz, logarithmic above."""
    hz = np.asarray(hz, dtype=np.float64)
    linear_step = 200.0 / 3.0
    break_hz = 1000.0
    break_mel = break_hz / linear_step
    log_step = math.log(6.4) / 27.0
    mel = hz / linear_step
    above = hz >= break_hz
    mel = np.where(above, break_mel + np.log(np.maximum(hz, 1e-12) / break_hz) / log_step, mel)
    return mel


def _mel_to_hz_slaney(mel: np.ndarray) -> np.ndarray:
    mel = np.asarray(mel, dtype=np.float64)
    linear_step = 200.0 / 3.0
    break_hz = 1000.0
    break_mel = break_hz / linear_step
    log_step = math.log(6.4) / 27.0
    hz = mel * linear_step
    return np.where(mel >= break_mel, break_hz * np.exp(log_step * (mel - break_mel)), hz)


@lru_cache(maxsize=16)
def _slaney_filters_np(sample_rate: int, n_fft: int, n_mels: int, fmin: float, fmax: float | None) -> np.ndarray:
    if fmax is None:
        fmax = sample_rate / 2.0
    n_bins = n_fft // 2 + 1
    bin_hz = np.linspace(0.0, sample_rate / 2.0, n_bins)
    # n_mels + 2 band edges evenly spaced on the mel scale.
    edges_hz = _mel_to_hz_slaney(np.linspace(_hz_to_mel_slaney(fmin), _hz_to_mel_slaney(fmax), n_mels + 2))
    widths = np.diff(edges_hz)
    # distance of every band edge from every FFT bin frequency
    offsets = edges_hz[:, None] - bin_hz[None, :]
    rising = -offsets[:-2] / widths[:-1, None]
    falling = offsets[2:] / widths[1:, None]
    tri = np.maximum(0.0, np.minimum(rising, falling))
    # area normalisation: each triangle integrates to the same energy
    tri *= (2.0 / (edges_hz[2:] - edges_hz[:-2]))[:, None]
    tri = tri.astype(np.float32)
    tri.setflags(write=False)
    return tri


def slaney_mel_filters(sample_rate: int, n_fft: int, n_mels: int, fmin: float = 0.0,
                       fmax: float | None = None) -> torch.Tensor:
    """``[n_mels, n_fft // 2 + 1]`` float32 triangular filters, Slaney scale and area norm."""
    return torch.from_numpy(_slaney_filters_np(int(sample_rate), int(n_fft), int(n_mels), float(fmin),
                                               None if fmax is None else float(fmax)).copy())


def _kaldi_mel(hz):
    return 1127.0 * np.log1p(np.asarray(hz, dtype=np.float64) / 700.0)


@lru_cache(maxsize=8)
def _kaldi_banks_np(num_bins: int, padded_window: int, sample_rate: float, low_freq: float,
                    high_freq: float) -> np.ndarray:
    nyquist = 0.5 * sample_rate
    if high_freq <= 0.0:
        high_freq += nyquist
    if not (0.0 <= low_freq < high_freq <= nyquist):
        raise ValueError(f"bad mel band [{low_freq}, {high_freq}] for sample rate {sample_rate}")
    half = padded_window // 2
    bin_width = sample_rate / padded_window
    mel_lo, mel_hi = _kaldi_mel(low_freq), _kaldi_mel(high_freq)
    step = (mel_hi - mel_lo) / (num_bins + 1)
    index = np.arange(num_bins, dtype=np.float64)[:, None]
    left = mel_lo + index * step
    centre = left + step
    right = left + 2.0 * step
    bin_mel = _kaldi_mel(bin_width * np.arange(half, dtype=np.float64))[None, :]
    up = (bin_mel - left) / (centre - left)
    down = (right - bin_mel) / (right - centre)
    banks = np.maximum(0.0, np.minimum(up, down))
    # the Nyquist bin never belongs to a band
    banks = np.concatenate([banks, np.zeros((num_bins, 1))], axis=1).astype(np.float32)
    banks.setflags(write=False)
    return banks


def kaldi_mel_banks(num_bins: int = 80, padded_window: int = 512, sample_rate: float = 16000.0,
                    low_freq: float = 20.0, high_freq: float = 0.0) -> torch.Tensor:
    """``[num_bins, padded_window // 2 + 1]`` Kaldi triangular banks (1127 ln(1 + f/700) scale)."""
    return torch.from_numpy(_kaldi_banks_np(int(num_bins), int(padded_window), float(sample_rate),
                                            float(low_freq), float(high_freq)).copy())


# ---------------------------------------------------------------------------
# Windows (cached; small)


@lru_cache(maxsize=16)
def _hann(length: int, periodic: bool) -> torch.Tensor:
    return torch.hann_window(length, periodic=periodic, dtype=torch.float32)


def _as_batch(audio, name: str) -> torch.Tensor:
    x = torch.as_tensor(audio)
    if x.dtype != torch.float32:
        x = x.to(torch.float32)
    if x.dim() == 1:
        x = x.unsqueeze(0)
    if x.dim() != 2:
        raise ValueError(f"{name}: expected audio shaped [samples] or [batch, samples], got {tuple(x.shape)}")
    return x


# ---------------------------------------------------------------------------
# Whisper log-mel (speech tokenizer input)


def log_mel_spectrogram(audio_16k, n_mels: int = 128) -> torch.Tensor:
    """Whisper's log-mel of 16 kHz audio: ``[batch, n_mels, samples // 160]`` float32.

    Centred STFT (reflect padding), 400-point periodic Hann window, hop 160, power
    spectrum without its last frame, Slaney mel filters, log10 with a 1e-10 floor,
    8 decades of dynamic range below the maximum (over the whole input), then
    ``(x + 4) / 4``.
    """
    x = _as_batch(audio_16k, "log_mel_spectrogram")
    if x.shape[-1] <= WHISPER_N_FFT // 2:
        raise ValueError(f"log_mel_spectrogram: need more than {WHISPER_N_FFT // 2} samples, got {x.shape[-1]}")
    spec = torch.stft(x, WHISPER_N_FFT, WHISPER_HOP, window=_hann(WHISPER_N_FFT, True), center=True,
                      pad_mode="reflect", return_complex=True)
    power = spec[..., :-1].abs().pow(2)
    filters = slaney_mel_filters(WHISPER_SAMPLE_RATE, WHISPER_N_FFT, n_mels)
    mel = torch.matmul(filters, power)
    logmel = torch.clamp(mel, min=1e-10).log10()
    logmel = torch.maximum(logmel, logmel.max() - 8.0)
    return (logmel + 4.0) / 4.0


# ---------------------------------------------------------------------------
# Kaldi fbank (speaker encoder input)


def fbank(audio_16k, num_mel_bins: int = 80, sample_frequency: float = 16000.0, frame_length_ms: float = 25.0,
          frame_shift_ms: float = 10.0, dither: float = 0.0, preemphasis_coefficient: float = 0.97,
          remove_dc_offset: bool = True, low_freq: float = 20.0, high_freq: float = 0.0,
          window_type: str = "povey") -> torch.Tensor:
    """Kaldi log mel filter-bank energies of one mono signal: ``[frames, num_mel_bins]`` float32.

    Kaldi's defaults as the CosyVoice frontend uses them (snip_edges framing, DC
    removal, pre-emphasis with the first sample repeated, Povey window, FFT size
    rounded up to a power of two, power spectrum, natural log floored at float32
    epsilon). The waveform is used at the scale given (the frontend passes [-1, 1]).
    ``dither`` must be 0: the frontend never dithers, and a deterministic feature is
    what a cached voice needs.
    """
    if dither != 0.0:
        raise ValueError("fbank: dither is not supported (the CosyVoice frontend uses dither=0)")
    x = torch.as_tensor(audio_16k).to(torch.float32)
    if x.dim() == 2:
        x = x[0]
    if x.dim() != 1:
        raise ValueError(f"fbank: expected a mono signal, got shape {tuple(x.shape)}")
    win = int(sample_frequency * frame_length_ms * 0.001)
    shift = int(sample_frequency * frame_shift_ms * 0.001)
    if x.numel() < win:
        return torch.zeros(0, num_mel_bins)
    padded = 1 << (win - 1).bit_length()
    frames = x.unfold(0, win, shift)  # [F, win], snip_edges framing
    if remove_dc_offset:
        frames = frames - frames.mean(dim=1, keepdim=True)
    if preemphasis_coefficient != 0.0:
        previous = torch.cat([frames[:, :1], frames[:, :-1]], dim=1)
        frames = frames - preemphasis_coefficient * previous
    if window_type == "povey":
        window = _hann(win, False).pow(0.85)
    elif window_type == "hanning":
        window = _hann(win, False)
    elif window_type == "hamming":
        window = torch.hamming_window(win, periodic=False, alpha=0.54, beta=0.46)
    elif window_type == "rectangular":
        window = torch.ones(win)
    else:
        raise ValueError(f"fbank: unsupported window_type {window_type!r}")
    frames = frames * window
    power = torch.fft.rfft(frames, n=padded).abs().pow(2)
    banks = kaldi_mel_banks(num_mel_bins, padded, sample_frequency, low_freq, high_freq)
    energies = torch.matmul(power, banks.T)
    return torch.clamp(energies, min=torch.finfo(torch.float32).eps).log()


def campplus_features(audio_16k) -> torch.Tensor:
    """The CAM++ input the official frontend builds: 80-bin fbank minus its mean over time, ``[1, T, 80]``."""
    feat = fbank(audio_16k, num_mel_bins=80, dither=0.0, sample_frequency=16000.0)
    feat = feat - feat.mean(dim=0, keepdim=True)
    return feat.unsqueeze(0)


# ---------------------------------------------------------------------------
# Matcha / HiFi-GAN mel (flow prompt feature, 24 kHz)


def mel_spectrogram(y, n_fft: int = 1920, num_mels: int = 80, sampling_rate: int = 24000, hop_size: int = 480,
                    win_size: int = 1920, fmin: float = 0.0, fmax: float | None = 8000.0,
                    center: bool = False) -> torch.Tensor:
    """Natural-log magnitude mel, ``[batch, num_mels, frames]`` float32.

    The signal is reflect-padded by ``(n_fft - hop) / 2`` on both sides and framed
    without centring, so 24 kHz audio of N samples gives N // 480 frames; magnitudes
    carry a 1e-9 floor inside the square root and the log a 1e-5 floor.
    """
    x = _as_batch(y, "mel_spectrogram")
    pad = int((n_fft - hop_size) / 2)
    x = torch.nn.functional.pad(x.unsqueeze(1), (pad, pad), mode="reflect").squeeze(1)
    spec = torch.stft(x, n_fft, hop_length=hop_size, win_length=win_size, window=_hann(win_size, True),
                      center=center, pad_mode="reflect", normalized=False, onesided=True, return_complex=True)
    spec = torch.view_as_real(spec)
    magnitude = torch.sqrt(spec.pow(2).sum(-1) + 1e-9)
    filters = slaney_mel_filters(sampling_rate, n_fft, num_mels, fmin, fmax)
    mel = torch.matmul(filters, magnitude)
    return torch.log(torch.clamp(mel, min=1e-5))
