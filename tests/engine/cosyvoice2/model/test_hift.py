"""HiFT vocoder (engine/cosyvoice2/model/hift.py) against the official HiFTGenerator.

Both sides get the same random weights (loaded strictly, in both directions), the same
mel and the same RNG seed; the official module draws its excitation noise from the
global RNG, ours draws the same shapes in the same order. Measured max abs error against
the official module: exactly 0 (same torch kernels in the same order); the assertions
allow 1e-4. Batched rows vs the same rows alone (ours only): ~5e-5, float32 rounding,
explained in that test.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect

import pytest
import torch
from torch import Tensor, nn

from tts_gateway.engine.cosyvoice2.model.hift import HiFT
from tts_gateway.engine.cosyvoice2.modeldir.configs import F0PredictorConfig, HiFTConfig
from tests.reference import official
from tests.paths import ROOT

TOLERANCE = 1e-4
TINY = HiFTConfig.tiny()
FRAMES = 12  # mel frames per test chunk: 12 * 480 samples


def build_official(config: HiFTConfig) -> nn.Module:
    generator = official("cosyvoice.hifigan.generator")
    f0_predictor = official("cosyvoice.hifigan.f0_predictor")
    kwargs = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "f0_predictor"}
    predictor = f0_predictor.ConvRNNF0Predictor(**dataclasses.asdict(config.f0_predictor))
    return generator.HiFTGenerator(**kwargs, f0_predictor=predictor).eval()


def build_ours(config: HiFTConfig) -> HiFT:
    return HiFT(config).eval()


def randomize(model: nn.Module, seed: int, mel: Tensor) -> nn.Module:
    """Every parameter random, scaled so that the signal stays in range.

    Weight norm: random direction v, row norms g in [0.3, 1]. The f0 head (random
    direction) is then scaled and offset so that, on ``mel``, the predicted pitch runs
    from 5 Hz (unvoiced: below the 10 Hz threshold) to 250 Hz, exercising both the sine
    and the noise branch of the source.
    """
    rng = torch.Generator().manual_seed(seed)

    def normal(shape: torch.Size, std: float) -> Tensor:
        return std * torch.randn(shape, generator=rng)

    def uniform(shape: torch.Size, low: float, high: float) -> Tensor:
        return low + (high - low) * torch.rand(shape, generator=rng)

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("original0"):
                p.copy_(uniform(p.shape, 0.3, 1.0))
            elif name.endswith("original1"):
                p.copy_(normal(p.shape, 1.0))
            elif name.endswith("alpha"):
                p.copy_(uniform(p.shape, 0.5, 1.5))
            elif name.endswith("bias"):
                p.copy_(normal(p.shape, 0.1))
            else:  # plain convs and linears: unit-variance outputs
                p.copy_(normal(p.shape, p[0].numel() ** -0.5))

        head = model.f0_predictor.classifier
        raw = model.f0_predictor.condnet(mel).transpose(1, 2) @ head.weight[0]
        scale = 245.0 / (raw.max() - raw.min())
        head.weight.mul_(scale)
        head.bias.fill_(5.0 - scale * raw.min())
    return model


def random_mel(batch: int, frames: int = FRAMES, seed: int = 3) -> Tensor:
    return torch.randn(batch, TINY.in_channels, frames, generator=torch.Generator().manual_seed(seed))


def run_official(model: nn.Module, mel: Tensor, seed: int, cache_source: Tensor | None = None):
    torch.manual_seed(seed)
    if cache_source is None:
        return model.inference(mel)
    return model.inference(mel, cache_source=cache_source)


def run_ours(model: HiFT, mel: Tensor, seed: int, cache_source: Tensor | None = None):
    torch.manual_seed(seed)
    return model(mel, cache_source)


def max_err(a: Tensor, b: Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


def assert_sane(model: nn.Module, mel: Tensor, wav: Tensor) -> None:
    """The test inputs exercise both voicing branches and give an unclipped, non-silent waveform."""
    with torch.no_grad():
        f0 = model.f0_predictor(mel)
    assert (f0 > TINY.nsf_voiced_threshold).any() and (f0 < TINY.nsf_voiced_threshold).any(), f0
    assert wav.shape == (mel.shape[0], mel.shape[2] * TINY.samples_per_frame)
    assert 0.01 < wav.std().item() < 0.5
    assert (wav.abs() >= TINY.audio_limit).float().mean().item() < 0.01


def assert_equivalent(ref: nn.Module, ours: HiFT, mel: Tensor, seed: int, cache: Tensor | None = None) -> float:
    """Same outputs, and the global RNG left in the same state (same draws)."""
    ref_wav, ref_source = run_official(ref, mel, seed, cache)
    ref_rng = torch.get_rng_state()
    wav, source = run_ours(ours, mel, seed, cache)
    assert torch.equal(torch.get_rng_state(), ref_rng)
    err = max(max_err(wav, ref_wav), max_err(source, ref_source))
    assert err <= TOLERANCE, err
    return err


def test_equivalence_hift() -> None:
    """B=1; official -> ours (weight norm live, then folded, then with a torch.Generator); ours -> official.

    Measured max abs error: 0.0 in every case.
    """
    mel = random_mel(1)
    ref = randomize(build_official(TINY), seed=0, mel=mel)
    ours = build_ours(TINY)
    ours.load_state_dict(ref.state_dict(), strict=True)
    ref_wav, _ = run_official(ref, mel, seed=7)
    assert_sane(ref, mel, ref_wav)

    assert_equivalent(ref, ours, mel, seed=7)
    ours.fold_weight_norm()
    assert ours.weight_norm_folded
    assert_equivalent(ref, ours, mel, seed=7)

    # A private generator seeded like the global RNG draws the same values.
    wav, _ = ours(mel, generator=torch.Generator().manual_seed(7))
    assert max_err(wav, ref_wav) <= TOLERANCE
    # The comparison is sensitive to the draws: another seed gives another waveform.
    other_wav, _ = run_ours(ours, mel, seed=8)
    assert max_err(other_wav, ref_wav) > 1e-3

    # Reverse direction: our random weights load strictly into the official module.
    ours = randomize(build_ours(TINY), seed=1, mel=mel)
    ref = build_official(TINY)
    ref.load_state_dict(ours.state_dict(), strict=True)
    ref_wav, _ = run_official(ref, mel, seed=11)
    assert_sane(ref, mel, ref_wav)
    assert_equivalent(ref, ours, mel, seed=11)


def test_equivalence_hift_cache_source() -> None:
    """Streaming: the previous chunk's source tail replaces the start of the new source. Measured error: 0.0."""
    ref = randomize(build_official(TINY), seed=0, mel=random_mel(1))
    ours = build_ours(TINY)
    ours.load_hift_state_dict(ref.state_dict())
    _, first_source = run_official(ref, random_mel(1, seed=4), seed=5)
    cache = first_source[:, :, -4 * TINY.samples_per_frame :].clone()

    mel = random_mel(1, seed=6)
    assert_equivalent(ref, ours, mel, seed=9, cache=cache)
    wav, source = run_ours(ours, mel, seed=9, cache_source=cache)
    assert torch.equal(source[:, :, : cache.shape[2]], cache)
    uncached_wav, _ = run_ours(ours, mel, seed=9)
    assert max_err(wav, uncached_wav) > 1e-3  # the cache reaches the waveform


def test_equivalence_hift_batch() -> None:
    """B=2 with the global RNG: batch-shaped draws, as the official module makes them. Measured error: 0.0."""
    ref = randomize(build_official(TINY), seed=0, mel=random_mel(1))
    ours = build_ours(TINY)
    ours.load_hift_state_dict(ref.state_dict())
    mel = random_mel(2)
    cache = torch.randn(2, 1, 3 * TINY.samples_per_frame, generator=torch.Generator().manual_seed(2)) * 0.1
    assert_equivalent(ref, ours, mel, seed=13)
    assert_equivalent(ref, ours, mel, seed=13, cache=cache)


def test_hift_batched_rows_match_single_rows() -> None:
    """With one generator per row, a batched row equals that row vocoded alone.

    The random draws are then identical: each row's noise is filled on its own, as in a
    solo call. A single RNG cannot give this: torch fills a [B, ...] tensor in one pass,
    and its vectorised normal sampler's output depends on the total size, so row 1 of a
    batched draw differs from a solo draw (checked below).

    The remaining difference is float32 rounding, not randomness: CPU convolutions
    accumulate in a batch-size-dependent order (~1e-7 relative; decode() of the same
    source differs by ~1.5e-7), and the f0 rounding (~6e-5 Hz at 250 Hz) is integrated
    into the phase. Measured max abs error on 12 frames: ~2e-5 (waveform), ~5e-5
    (source); asserted <= 1e-4. It grows with chunk length as phase drift does.
    """
    ours = build_ours(TINY)
    ours.load_hift_state_dict(randomize(build_official(TINY), seed=0, mel=random_mel(1)).state_dict())
    mel = random_mel(3)
    cache = torch.randn(3, 1, 2 * TINY.samples_per_frame, generator=torch.Generator().manual_seed(2)) * 0.1

    def generators(*seeds: int) -> list[torch.Generator]:
        return [torch.Generator().manual_seed(s) for s in seeds]

    wav, source = ours(mel, cache, generator=generators(20, 21, 22))
    for row in range(3):
        solo_wav, solo_source = ours(mel[row : row + 1], cache[row : row + 1], generator=generators(20 + row))
        assert max_err(wav[row : row + 1], solo_wav) <= TOLERANCE
        assert max_err(source[row : row + 1], solo_source) <= TOLERANCE

    # The shared-RNG batch does differ from solo rows (why per-row generators exist).
    shared_wav, _ = ours(mel, cache, generator=torch.Generator().manual_seed(20))
    solo_wav, _ = ours(mel[1:2], cache[1:2], generator=torch.Generator().manual_seed(20))
    assert max_err(shared_wav[1:2], solo_wav) > 1e-4

    with pytest.raises(ValueError):
        ours(mel, generator=generators(1, 2))


def test_load_hift_state_dict_generator_prefix_and_weight_norm_layouts() -> None:
    """hift.pt as the GAN wrapper saves it ("generator." prefix), in both weight-norm spellings.

    Current torch saves weight norm as parametrizations.weight.original0/1; older torch as
    weight_g/weight_v. Torch's weight_norm maps the old names while loading, for the
    official module and for ours alike; both still load strictly.
    """
    ref = randomize(build_official(TINY), seed=0, mel=random_mel(1))
    mel = random_mel(1)
    ref_wav, _ = run_official(ref, mel, seed=3)
    state = ref.state_dict()
    old_names = {
        k.replace("parametrizations.weight.original0", "weight_g").replace(
            "parametrizations.weight.original1", "weight_v"
        ): v
        for k, v in state.items()
    }
    assert any(k.endswith("weight_g") for k in old_names)

    ref_from_old = build_official(TINY)
    ref_from_old.load_state_dict(old_names, strict=True)
    assert max_err(run_official(ref_from_old, mel, seed=3)[0], ref_wav) <= TOLERANCE

    for layout in (state, old_names):
        checkpoint = {f"generator.{k}": v for k, v in layout.items()}
        ours = build_ours(TINY)
        ours.load_hift_state_dict(checkpoint)
        assert ours.weight_norm_folded
        assert max_err(run_ours(ours, mel, seed=3)[0], ref_wav) <= TOLERANCE
        with pytest.raises(RuntimeError):
            ours.load_hift_state_dict(checkpoint)  # folded: the layout changed

    incomplete = {f"generator.{k}": v for k, v in state.items() if k != "conv_post.bias"}
    with pytest.raises(RuntimeError, match="conv_post.bias"):
        build_ours(TINY).load_hift_state_dict(incomplete)


def test_hift_full_config_matches_official() -> None:
    """cosyvoice2.yaml dimensions: identical keys and shapes, 20.8 M parameters (built on the meta device)."""
    config = HiFTConfig.full()
    with torch.device("meta"):
        ref = build_official(config)
        ours = build_ours(config)
    ref_layout = [(k, tuple(v.shape)) for k, v in ref.state_dict().items()]
    assert [(k, tuple(v.shape)) for k, v in ours.state_dict().items()] == ref_layout
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in ref.parameters()) == 20_821_295
    assert config.samples_per_frame == 480


def test_hift_config_fields_are_the_official_arguments() -> None:
    for config_class in (HiFTConfig, F0PredictorConfig):
        module_name, class_name = config_class.OFFICIAL_TARGET.rsplit(".", 1)
        arguments = list(inspect.signature(getattr(official(module_name), class_name).__init__).parameters)[1:]
        assert [f.name for f in dataclasses.fields(config_class)] == arguments


def test_hift_runtime_imports_no_reference_stack() -> None:
    source = ROOT / "engine" / "cosyvoice2" / "model" / "hift.py"
    imported: set[str] = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    forbidden = {"cosyvoice", "matcha", "diffusers", "hyperpyyaml", "librosa", "torchaudio", "modelscope", "scipy"}
    assert not imported & forbidden


def test_overlap_add_istft_is_torch_istft() -> None:
    """The vocoder's capture-safe inverse STFT computes what torch.istft does."""
    from tts_gateway.engine.cosyvoice2.model.hift import overlap_add_istft

    generator = torch.Generator().manual_seed(5)
    window = torch.hann_window(16, periodic=True, dtype=torch.float64).to(torch.float32)
    for frames in (2, 37, 233):
        spectrum = torch.complex(torch.randn(3, 9, frames, generator=generator),
                                 torch.randn(3, 9, frames, generator=generator))
        ours = overlap_add_istft(spectrum, 16, 4, window)
        reference = torch.istft(spectrum, 16, 4, 16, window=window)
        assert ours.shape == reference.shape
        assert float((ours - reference).abs().max()) <= 1e-5
