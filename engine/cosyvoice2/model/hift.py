"""HiFT, the CosyVoice2 vocoder: 80-bin mel at 50 Hz -> 24 kHz waveform (480 samples a frame).

HiFTNet is a neural source filter in front of an iSTFT head:

1. an F0 predictor (a conv stack on the mel) gives the pitch of every frame;
2. a harmonic source turns that pitch into an excitation signal at the sample rate:
   sines at f0 and its overtones where voiced, noise where not, merged by a linear
   layer;
3. a HiFi-GAN style generator upsamples the mel 120x (8 * 5 * 3), adds the STFT of the
   excitation at every scale, and predicts a 16-point STFT (log-magnitude, phase)
   every 4 samples; the inverse STFT of that is the waveform.

The modules load the released ``hift.pt`` strictly: parameter names and shapes are
those of the official ``HiFTGenerator`` (weight-normed convs stored as
``<conv>.parametrizations.weight.original0/1``; torch also maps the older
``<conv>.weight_g/weight_v`` spelling onto these while loading, as it does for the
official module). After loading, weight norm can be folded into plain weights.

Randomness: the excitation draws a random initial phase per harmonic and Gaussian
noise. The draws have the official shapes and order, so seeding the global RNG (or a
``torch.Generator``) identically reproduces the official output exactly. For batches
of independent sessions pass one generator per row: each row then draws exactly what
it would draw alone, so a row's audio does not depend on what it is batched with.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

from tts_gateway.engine.cosyvoice2.modeldir.configs import F0PredictorConfig, HiFTConfig

# One generator for the whole batch (or None: the global RNG), or one per batch row.
RandomSource = torch.Generator | Sequence[torch.Generator] | None


def _fill_random(
    template: Tensor, distribution: Literal["uniform", "normal"], randomness: RandomSource
) -> Tensor:
    """A tensor shaped (and strided) like ``template``, filled from U(0, 1) or N(0, 1).

    This is what torch.rand / torch.randn_like do (allocate, then fill in place), with a
    generator option. The memory layout matters: torch fills a non-contiguous tensor in
    memory order with a different algorithm than a contiguous one, so the official
    values are only reproduced with the official layout. With one generator per batch
    row, each row is filled on its own, exactly as in a call with that row alone.
    """

    def fill(out: Tensor, generator: torch.Generator | None) -> Tensor:
        return out.uniform_(generator=generator) if distribution == "uniform" else out.normal_(generator=generator)

    if randomness is None or isinstance(randomness, torch.Generator):
        return fill(torch.empty_like(template), randomness)
    if len(randomness) != template.shape[0]:
        raise ValueError(f"{len(randomness)} generators for a batch of {template.shape[0]}")
    return torch.cat([fill(torch.empty_like(template[row : row + 1]), g) for row, g in enumerate(randomness)])


def overlap_add_istft(spectrum: Tensor, n_fft: int, hop: int, window: Tensor) -> Tensor:
    """``torch.istft(spectrum, n_fft, hop, n_fft, window)`` (centred) without its host-side check.

    torch.istft verifies that the window's overlap-add never vanishes with a ``.item()``,
    a host sync that a CUDA graph cannot capture. The computation is the same: inverse
    real FFT per frame, windowed, overlap-added, divided by the overlap-added squared
    window, with the n_fft / 2 centring samples cut from both ends. (For HiFT's periodic
    Hann window with n_fft = 4 x hop the divisor is never 0.)
    spectrum: complex ``[B, n_fft // 2 + 1, frames]`` -> ``[B, hop * (frames - 1)]``.
    """
    batch, _, frames = spectrum.shape
    pieces = torch.fft.irfft(spectrum, n=n_fft, dim=1) * window[None, :, None]
    length = n_fft + hop * (frames - 1)

    def overlap_add(x: Tensor) -> Tensor:
        return F.fold(x, output_size=(1, length), kernel_size=(1, n_fft), stride=(1, hop)).reshape(x.shape[0], length)

    envelope = overlap_add((window * window)[None, :, None].expand(1, n_fft, frames))
    half = n_fft // 2
    return overlap_add(pieces)[:, half : length - half] / envelope[:, half : length - half]


class Snake(nn.Module):
    """x + sin^2(alpha x) / alpha with a learned alpha per channel: a periodic bias for audio."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: Tensor) -> Tensor:
        alpha = self.alpha[None, :, None]
        return x + (1.0 / (alpha + 1e-9)) * torch.sin(x * alpha).pow(2)


class SnakeResBlock(nn.Module):
    """Residual stack: per dilation, snake -> dilated conv -> snake -> conv, added back."""

    def __init__(self, channels: int, kernel_size: int, dilations: Sequence[int]) -> None:
        super().__init__()
        self.convs1 = nn.ModuleList(
            weight_norm(nn.Conv1d(channels, channels, kernel_size, dilation=d, padding=d * (kernel_size - 1) // 2))
            for d in dilations
        )
        self.convs2 = nn.ModuleList(
            weight_norm(nn.Conv1d(channels, channels, kernel_size, padding=(kernel_size - 1) // 2))
            for _ in dilations
        )
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: Tensor) -> Tensor:
        for conv1, conv2, act1, act2 in zip(self.convs1, self.convs2, self.activations1, self.activations2):
            x = conv2(act2(conv1(act1(x)))) + x
        return x


class F0Predictor(nn.Module):
    """Pitch in Hz per mel frame: five conv+ELU layers, then a linear head (|.| keeps it >= 0)."""

    def __init__(self, config: F0PredictorConfig) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(5):
            in_channels = config.in_channels if i == 0 else config.cond_channels
            layers += [weight_norm(nn.Conv1d(in_channels, config.cond_channels, 3, padding=1)), nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(config.cond_channels, config.num_class)

    def forward(self, mel: Tensor) -> Tensor:
        """[B, n_mels, T] -> [B, T] (for num_class 1)."""
        hidden = self.condnet(mel).transpose(1, 2)
        return torch.abs(self.classifier(hidden).squeeze(-1))


class HarmonicSource(nn.Module):
    """Excitation signal from sample-rate f0 (hn-NSF source, the 24 kHz CosyVoice2 variant).

    The phase is integrated at the frame rate and interpolated back to the sample rate
    (linear resampling down, cumulative sum, linear resampling up), which keeps it
    smooth across frame borders. The same resampling calls as the official code are
    used on purpose: the phase grows to ~1e4 rad within seconds, where float32 rounding
    is ~1e-3 rad, so any reordering of that arithmetic would show in the waveform.
    """

    def __init__(
        self,
        sampling_rate: int,
        upsample_scale: int,
        nb_harmonics: int,
        sine_amp: float,
        noise_std: float,
        voiced_threshold: float,
    ) -> None:
        super().__init__()
        self.sampling_rate = sampling_rate
        self.upsample_scale = upsample_scale
        self.nb_harmonics = nb_harmonics
        self.sine_amp = sine_amp
        self.noise_std = noise_std
        self.voiced_threshold = voiced_threshold
        self.l_linear = nn.Linear(nb_harmonics + 1, 1)  # merges f0 and its overtones

    def forward(self, f0: Tensor, randomness: RandomSource = None) -> Tensor:
        """f0 [B, L, 1] in Hz at the sample rate -> excitation [B, L, 1]."""
        batch, device = f0.shape[0], f0.device
        overtones = torch.arange(1, self.nb_harmonics + 2, dtype=f0.dtype, device=device)
        cycles_per_sample = (f0 * overtones / self.sampling_rate) % 1  # [B, L, H+1]

        # Random start phase for the overtones (never for f0 itself). It lands on the
        # first sample only, which the downsampling below does not read: it has no
        # effect, but is drawn anyway to keep the RNG stream identical.
        start_phase = _fill_random(torch.empty(batch, self.nb_harmonics + 1, device=device), "uniform", randomness)
        start_phase[:, 0] = 0
        cycles_per_sample[:, 0, :] = cycles_per_sample[:, 0, :] + start_phase

        per_frame = F.interpolate(
            cycles_per_sample.transpose(1, 2), scale_factor=1 / self.upsample_scale, mode="linear"
        ).transpose(1, 2)
        phase = torch.cumsum(per_frame, dim=1) * 2 * math.pi
        phase = F.interpolate(
            phase.transpose(1, 2) * self.upsample_scale, scale_factor=self.upsample_scale, mode="linear"
        ).transpose(1, 2)
        sines = torch.sin(phase) * self.sine_amp

        voiced = (f0 > self.voiced_threshold).to(f0.dtype)
        # Unvoiced samples get noise with std sine_amp / 3 instead of a sine.
        noise_amp = voiced * self.noise_std + (1 - voiced) * self.sine_amp / 3
        noise = noise_amp * _fill_random(sines, "normal", randomness)
        excitation = torch.tanh(self.l_linear(sines * voiced + noise))

        # The official module also draws a noise signal that the vocoder never uses;
        # drawn here too so that consecutive calls stay in step with it.
        _fill_random(voiced, "normal", randomness)
        return excitation


class HiFT(nn.Module):
    """CosyVoice2 HiFT vocoder with the official ``HiFTGenerator`` state-dict layout."""

    def __init__(self, config: HiFTConfig) -> None:
        super().__init__()
        if config.sampling_rate == 22050:
            # The official code switches to a different sine generator (CosyVoice 1) there.
            raise ValueError("the 22.05 kHz (CosyVoice 1) source generator is not implemented")
        self.config = config
        self.samples_per_frame = config.samples_per_frame
        n_fft, base = config.n_fft, config.base_channels
        rates = config.upsample_rates

        self.m_source = HarmonicSource(
            sampling_rate=config.sampling_rate,
            upsample_scale=self.samples_per_frame,
            nb_harmonics=config.nb_harmonics,
            sine_amp=config.nsf_alpha,
            noise_std=config.nsf_sigma,
            voiced_threshold=config.nsf_voiced_threshold,
        )
        self.conv_pre = weight_norm(nn.Conv1d(config.in_channels, base, 7, padding=3))
        self.ups = nn.ModuleList(
            weight_norm(nn.ConvTranspose1d(base >> i, base >> (i + 1), k, u, padding=(k - u) // 2))
            for i, (u, k) in enumerate(zip(rates, config.upsample_kernel_sizes))
        )

        # The source enters every stage as its STFT (one frame per hop, n_fft/2+1 real
        # and imaginary bins), strided down by the upsampling still to come after that stage.
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        source_stages = zip(config.source_resblock_kernel_sizes, config.source_resblock_dilation_sizes)
        for i, (kernel_size, dilations) in enumerate(source_stages):
            channels, stride = base >> (i + 1), math.prod(rates[i + 1 :])
            if stride == 1:
                self.source_downs.append(nn.Conv1d(n_fft + 2, channels, 1))
            else:
                self.source_downs.append(nn.Conv1d(n_fft + 2, channels, 2 * stride, stride, padding=stride // 2))
            self.source_resblocks.append(SnakeResBlock(channels, kernel_size, dilations))

        self.resblocks = nn.ModuleList(
            SnakeResBlock(base >> (i + 1), k, d)
            for i in range(len(rates))
            for k, d in zip(config.resblock_kernel_sizes, config.resblock_dilation_sizes)
        )
        self.conv_post = weight_norm(nn.Conv1d(base >> len(rates), n_fft + 2, 7, padding=3))
        # Periodic Hann, computed in float64 and rounded like the official scipy window.
        window = torch.hann_window(n_fft, periodic=True, dtype=torch.float64).to(torch.float32)
        self.register_buffer("stft_window", window, persistent=False)
        self.f0_predictor = F0Predictor(config.f0_predictor)

    # -- weights ---------------------------------------------------------------------

    def load_hift_state_dict(self, state_dict: Mapping[str, Tensor], fold: bool = True) -> None:
        """Load ``hift.pt`` as the official loader does, then (by default) fold weight norm.

        The official loader drops every ``"generator."`` in the key names (a checkpoint of
        the GAN wrapper stores the vocoder under ``generator.``) and loads strictly.
        """
        if self.weight_norm_folded:
            raise RuntimeError("weight norm is folded: load into a freshly built HiFT")
        self.load_state_dict({k.replace("generator.", ""): v for k, v in state_dict.items()}, strict=True)
        if fold:
            self.fold_weight_norm()

    def fold_weight_norm(self) -> None:
        """Replace every g * v / |v| by its value: same output, no per-call renormalisation.

        Afterwards ``state_dict()`` holds plain ``<conv>.weight`` entries.
        """
        parametrized = [m for m in self.modules() if parametrize.is_parametrized(m, "weight")]
        for module in parametrized:
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)

    @property
    def weight_norm_folded(self) -> bool:
        return not parametrize.is_parametrized(self.conv_pre, "weight")

    # -- inference -------------------------------------------------------------------

    @torch.inference_mode()
    def forward(
        self,
        mel: Tensor,
        cache_source: Tensor | None = None,
        generator: RandomSource = None,
    ) -> tuple[Tensor, Tensor]:
        """mel [B, 80, T] -> (waveform [B, T * 480], excitation [B, 1, T * 480]).

        ``cache_source`` [B, 1, S]: the last S samples of the excitation returned for the
        previous chunk, when this chunk's mel starts with that chunk's last S / 480 frames.
        They replace the first S samples of the new excitation, so the sines continue
        across the chunk border instead of restarting.
        ``generator``: None (global RNG), one generator, or one generator per batch row.
        """
        f0 = self.f0_predictor(mel)
        f0 = F.interpolate(f0[:, None], scale_factor=float(self.samples_per_frame), mode="nearest").transpose(1, 2)
        source = self.m_source(f0, generator).transpose(1, 2)
        if cache_source is not None and cache_source.shape[2] > 0:
            source[:, :, : cache_source.shape[2]] = cache_source
        return self.decode(mel, source), source

    def decode(self, mel: Tensor, source: Tensor) -> Tensor:
        """mel [B, 80, T] and excitation [B, 1, T * 480] -> waveform [B, T * 480]."""
        n_fft, hop = self.config.n_fft, self.config.hop_len
        spectrum = torch.stft(source.squeeze(1), n_fft, hop, n_fft, window=self.stft_window, return_complex=True)
        spectrum = torch.view_as_real(spectrum)
        source_spec = torch.cat([spectrum[..., 0], spectrum[..., 1]], dim=1)  # [B, n_fft + 2, frames]

        blocks_per_stage = len(self.config.resblock_kernel_sizes)
        x = self.conv_pre(mel)
        for i, upsample in enumerate(self.ups):
            x = upsample(F.leaky_relu(x, self.config.lrelu_slope))
            if i == len(self.ups) - 1:
                x = F.pad(x, (1, 0), mode="reflect")  # one more frame: the STFT is centred
            x = x + self.source_resblocks[i](self.source_downs[i](source_spec))
            stage = self.resblocks[i * blocks_per_stage : (i + 1) * blocks_per_stage]
            mixed = stage[0](x)
            for block in stage[1:]:
                mixed = mixed + block(x)
            x = mixed / blocks_per_stage

        x = self.conv_post(F.leaky_relu(x))  # the default slope (0.01) here, as in the official code
        bins = n_fft // 2 + 1
        magnitude = torch.clip(torch.exp(x[:, :bins]), max=1e2)
        phase = torch.sin(x[:, bins:])  # squashed to [-1, 1] rad by the trained model's head
        spectrum = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        waveform = overlap_add_istft(spectrum, n_fft, hop, self.stft_window)
        return torch.clamp(waveform, -self.config.audio_limit, self.config.audio_limit)
