"""The fused norm kernels (model/fused_norms.py) run by Triton's interpreter on CPU tensors,
against their torch references and against the estimator's plain torch path.

Run by tests/engine/cosyvoice2/model/test_fused_norms.py in a subprocess with
``TRITON_INTERPRET=1``: the variable must be set before Triton is imported, and the
interpreter then replaces every kernel of the process, so it stays out of the test process.
Prints one JSON object: case name -> largest |fused - plain|, the largest |plain| (a check
that the case is not trivially zero) and how many times each kernel ran.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from tts_gateway.engine.cosyvoice2.model import fused_norms
from tts_gateway.engine.cosyvoice2.model.cfm import CFM
from tts_gateway.engine.cosyvoice2.model.estimator import CausalBlock, Estimator, ResnetBlock, TransformerBlock
from tts_gateway.engine.cosyvoice2.modeldir.configs import CFMConfig
from tts_gateway.engine.cosyvoice2.serving.prefix_bank import PrefixBank, decoder_prefix, solve_after_prefix
from tests.reference import randomize
from tests.triton_interpreter import counted, fused_and_plain, print_cases

fused_norms._norm_mish_mask_triton = counted("norm_mish_mask", fused_norms._norm_mish_mask_triton)
fused_norms._add_norm_triton = counted("add_norm", fused_norms._add_norm_triton)


def compare(fused: Callable[[], object], plain: Callable[[], object]) -> dict:
    """Runs ``fused`` with the kernels on and ``plain`` with them off; outputs are tensors or
    tuples of tensors."""
    got, expected, ran = fused_and_plain(fused, plain)
    got = got if isinstance(got, tuple) else (got,)
    expected = expected if isinstance(expected, tuple) else (expected,)
    return {
        "max_abs": max(float((g.float() - e.float()).abs().max()) for g, e in zip(got, expected, strict=True)),
        "scale": max(float(e.float().abs().max()) for e in expected),
        "launches": ran,
    }


def frame_mask(batch: int, frames: int) -> Tensor:
    """Row 0 whole, row 1 with its last third padding, any further rows all padding."""
    mask = torch.zeros(batch, 1, frames)
    mask[0] = 1
    if batch > 1:
        mask[1, :, : frames - frames // 3] = 1
    return mask


def layer_norm(channels: int, generator: torch.Generator, gain: float = 1.0) -> nn.LayerNorm:
    norm = nn.LayerNorm(channels, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(gain * (1 + 0.3 * torch.randn(channels, generator=generator)))
        norm.bias.copy_(0.3 * torch.randn(channels, generator=generator))
    return norm


def op_cases(cases: dict) -> None:
    generator = torch.Generator().manual_seed(0)
    for batch, channels, frames in ((3, 256, 77), (2, 48, 33), (1, 256, 32)):
        norm = layer_norm(channels, generator)
        mask = frame_mask(batch, frames)
        h = 2 * torch.randn(batch, channels, frames, generator=generator) + 0.5
        addends = {
            "none": None,
            "embedding": torch.randn(batch, channels, 1, generator=generator),
            "skip": torch.randn(batch, channels, frames, generator=generator),
        }
        for addend_name, addend in addends.items():
            for frames_major in (False, True):
                name = f"norm_mish_mask/{batch}x{channels}x{frames}/addend={addend_name}/frames_major={frames_major}"
                cases[name] = compare(lambda: fused_norms.norm_mish_mask(h, norm, mask, addend, frames_major),
                                      lambda: fused_norms.norm_mish_mask_reference(h, norm, mask, addend))
        # A conv output read from frames-major memory (strided along frames).
        h_strided = h.transpose(1, 2).contiguous().transpose(1, 2)
        cases[f"norm_mish_mask/{batch}x{channels}x{frames}/strided_input"] = compare(
            lambda: fused_norms.norm_mish_mask(h_strided, norm, mask),
            lambda: fused_norms.norm_mish_mask_reference(h, norm, mask))
        x = torch.randn(batch, frames, channels, generator=generator)
        delta = torch.randn(batch, frames, channels, generator=generator)
        cases[f"add_norm/{batch}x{frames}x{channels}"] = compare(
            lambda: fused_norms.add_norm(x, delta, norm), lambda: fused_norms.add_norm_reference(x, delta, norm))
        # The norm alone (a transformer stage's first block), and the normed rows also written
        # into a store, scattered by an index over a larger target (a layer's pages).
        cases[f"add_norm/{batch}x{frames}x{channels}/norm_only"] = compare(
            lambda: fused_norms.add_norm(x, None, norm), lambda: fused_norms.add_norm_reference(x, None, norm))
        index = torch.randperm(batch * frames + 7, generator=generator)[: batch * frames]

        def stored(add_norm: Callable) -> Callable[[], tuple[Tensor, ...]]:
            def run() -> tuple[Tensor, ...]:
                target = torch.full((batch * frames + 7, channels), 3.0)  # rows not in the index keep 3
                return (*add_norm(x, delta, norm, (target, index)), target)
            return run

        cases[f"add_norm/{batch}x{frames}x{channels}/store"] = compare(
            stored(fused_norms.add_norm), stored(fused_norms.add_norm_reference))
    # bfloat16, as on the GPU: the fused op rounds once where the plain ops round after each.
    h16, mask16 = h.bfloat16(), mask.bfloat16()
    norm16, embedding16 = layer_norm(channels, generator).bfloat16(), addends["embedding"].bfloat16()
    cases["bfloat16/norm_mish_mask"] = compare(
        lambda: fused_norms.norm_mish_mask(h16, norm16, mask16, embedding16),
        lambda: fused_norms.norm_mish_mask_reference(h16, norm16, mask16, embedding16))
    x16, delta16 = x.bfloat16(), delta.bfloat16()
    cases["bfloat16/add_norm"] = compare(lambda: fused_norms.add_norm(x16, delta16, norm16),
                                         lambda: fused_norms.add_norm_reference(x16, delta16, norm16))
    # Mish over its whole range: a norm gain that takes the normed values past torch's softplus
    # threshold (20) on both sides.
    norm = layer_norm(64, generator, gain=30.0)
    h = torch.randn(2, 64, 50, generator=generator)
    mask = frame_mask(2, 50)
    cases["norm_mish_mask/wide_range"] = compare(
        lambda: fused_norms.norm_mish_mask(h, norm, mask), lambda: fused_norms.norm_mish_mask_reference(h, norm, mask))


def module_cases(cases: dict) -> None:
    generator = torch.Generator().manual_seed(1)
    torch.manual_seed(1)
    batch, frames = 3, 77
    mask = frame_mask(batch, frames)

    block = randomize(CausalBlock(80, 256), seed=2, spread=0.3)
    x = torch.randn(batch, 80, frames, generator=generator)
    cases["CausalBlock"] = compare(lambda: block(x, mask, None), lambda: block(x, mask, None))

    resnet = randomize(ResnetBlock(80, 256, 1024), seed=3, spread=0.3)
    time_term = resnet.mlp(torch.randn(batch, 1024, generator=generator))
    cases["ResnetBlock"] = compare(lambda: resnet(x, mask, time_term, None), lambda: resnet(x, mask, time_term, None))

    blocks = [randomize(TransformerBlock(256, 8, 64, "gelu"), seed=4 + i, spread=0.3) for i in range(2)]
    h = torch.randn(batch, frames, 256, generator=generator)

    def transformer_stage() -> Tensor:
        stream, pending = h, None
        for b in blocks:
            stream, pending = b(stream, pending, None, None)
        return stream + pending

    cases["TransformerBlock x2"] = compare(transformer_stage, transformer_stage)

    cfm = randomize(CFM(CFMConfig.tiny()), seed=6, spread=0.3)
    estimator: Estimator = cfm.estimator
    x, mu, cond = (torch.randn(batch, 80, frames, generator=generator) for _ in range(3))
    spks, t = torch.randn(batch, 80, generator=generator), torch.rand(batch, generator=generator)
    for streaming in (False, True):
        cases[f"Estimator/streaming={streaming}"] = compare(
            lambda: estimator(x, mask, mu, t, spks, cond, streaming),
            lambda: estimator(x, mask, mu, t, spks, cond, streaming))

    # Through a cached-frames view: a voice prefix (its attention inputs kept, as the paged
    # pool's bank does), then a solve of the frames after it.
    prefix_frames, steps = 50, 2
    voice_mu, voice_cond = (torch.randn(1, 80, prefix_frames, generator=generator) for _ in range(2))
    voice_spks = torch.randn(1, 80, generator=generator)

    def solve_after_voice() -> tuple[Tensor, ...]:
        prefix = decoder_prefix(cfm, voice_mu, voice_spks, voice_cond, prefix_frames, steps, keep_inputs=True)
        bank = PrefixBank(cfm, 1, prefix_frames, voice_mu, steps, keep_inputs=True)
        bank.put(0, prefix)
        slots = torch.zeros(2, dtype=torch.long)
        mel = solve_after_prefix(cfm, bank, slots, mu[:2, :, :60], mask[:2, :, :60], spks[:2], cond[:2, :, :60])
        return mel, *prefix.inputs

    cases["voice prefix and solve after it"] = compare(solve_after_voice, solve_after_voice)


if __name__ == "__main__":
    print_cases(op_cases, module_cases)
