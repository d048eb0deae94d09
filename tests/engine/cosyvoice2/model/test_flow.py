"""CosyVoice2 flow decoder (CFM + estimator) and the whole flow vs the official implementation.

Equivalence tests build the official module at tiny size, give every parameter a
non-trivial random value, load its state dict strictly into ours (and ours into it), and
compare float32 outputs on the same inputs and the same noise (flow_pairs.py). The serving
layer's ways of running the flow have theirs in serving/ (test_incremental.py,
test_prefix_bank.py).
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from tts_gateway.engine.cosyvoice2.model.estimator import (
    Estimator,
    SelfAttention,
    TransformerBlock,
    attention_bias,
    chunk_attention_mask,
)
from tts_gateway.engine.cosyvoice2.model.flow import Flow
from tts_gateway.engine.cosyvoice2.modeldir.configs import EstimatorConfig, FlowConfig
from tests.engine.cosyvoice2.flow_pairs import (
    STEPS,
    TOLERANCE,
    decoder_inputs,
    max_err,
    official_estimator,
    official_flow,
    official_steps,
    randomize_,
    utterance,
)
from tests.reference import official


# ----------------------------------------------------------------------------- decoder


def test_equivalence_flow_estimator(cfm_pair) -> None:
    reference, ours = cfm_pair
    generator = torch.Generator().manual_seed(2)
    frames = 130  # 2 full 50-frame chunks and a partial one
    x, mu, cond = (torch.randn(2, 80, frames, generator=generator) for _ in range(3))
    spks, t = torch.randn(2, 80, generator=generator), torch.rand(2, generator=generator)
    mask = torch.ones(2, 1, frames)
    mask[1, :, 90:] = 0  # a padded row
    for streaming in (False, True):
        with torch.inference_mode():
            expected = reference.estimator(x, mask, mu, t, spks, cond, streaming=streaming)
            got = ours.estimator(x, mask, mu, t, spks, cond, streaming=streaming)
        assert expected.abs().max() > 1.0  # not a degenerate comparison
        assert max_err(got, expected) <= TOLERANCE, streaming


def test_equivalence_flow_estimator_reverse_load() -> None:
    ours = randomize_(Estimator(EstimatorConfig.tiny()), seed=3)
    reference = official_estimator(EstimatorConfig.tiny()).eval()
    reference.load_state_dict(ours.state_dict(), strict=True)
    generator = torch.Generator().manual_seed(4)
    x, mu, cond = (torch.randn(1, 80, 60, generator=generator) for _ in range(3))
    spks, t, mask = torch.randn(1, 80, generator=generator), torch.rand(1, generator=generator), torch.ones(1, 1, 60)
    with torch.inference_mode():
        got = ours(x, mask, mu, t, spks, cond, streaming=True)
        expected = reference(x, mask, mu, t, spks, cond, streaming=True)
    assert max_err(got, expected) <= TOLERANCE


@pytest.mark.parametrize("steps", STEPS)
def test_equivalence_flow_cfm(cfm_pair, steps) -> None:
    reference, ours = cfm_pair
    # The default noise is the official fixed noise (seed 0), drawn without touching the global RNG.
    assert torch.equal(ours.noise, reference.rand_noise)
    mu, mask, spks, cond = decoder_inputs(frames=110, prompt=36, seed=5)
    for streaming in (False, True):
        with torch.inference_mode():
            expected, _ = reference(mu, mask, steps, spks=spks, cond=cond, streaming=streaming)
            got = ours(mu, mask, spks, cond, streaming=streaming, n_timesteps=steps)
        assert expected.abs().max() > 1.0
        assert max_err(got, expected) <= TOLERANCE, streaming
    # Explicit noise: the official module's noise buffer, replaced by another tensor.
    other = torch.randn(1, 80, 150, generator=torch.Generator().manual_seed(6))
    reference.rand_noise, saved = other, reference.rand_noise
    try:
        with torch.inference_mode():
            expected, _ = reference(mu, mask, steps, spks=spks, cond=cond, streaming=True)
    finally:
        reference.rand_noise = saved
    with torch.inference_mode():
        got = ours(mu, mask, spks, cond, streaming=True, noise=other, n_timesteps=steps)
    assert max_err(got, expected) <= TOLERANCE


def test_flow_cfm_batched_rows_equal_single(cfm_pair) -> None:
    """Rows of different lengths in one batch (one estimator call per step) equal running each alone."""
    _, ours = cfm_pair
    lengths, prompts = [110, 57, 81], [36, 20, 0]
    rows = [decoder_inputs(n, p, seed=10 + i) for i, (n, p) in enumerate(zip(lengths, prompts))]
    longest = max(lengths)

    def padded(i: int) -> Tensor:
        return torch.stack([nn.functional.pad(row[i][0], (0, longest - row[i].shape[-1])) for row in rows])

    mu, mask, cond = padded(0), padded(1), padded(3)
    spks = torch.cat([row[2] for row in rows])
    for streaming in (False, True):
        with torch.inference_mode():
            batched = ours(mu, mask, spks, cond, streaming=streaming)
            for i, (row, n) in enumerate(zip(rows, lengths)):
                alone = ours(row[0], row[1], row[2], row[3], streaming=streaming)
                assert max_err(batched[i : i + 1, :, :n], alone) <= 1e-5, (streaming, i)


# ----------------------------------------------------------------------------- masks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_bias_gives_the_boolean_masks_attention_exactly(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(3)
    query, key, value = (torch.randn(3, 2, 60, 16, generator=generator).to(dtype) for _ in range(3))
    allowed = chunk_attention_mask(torch.arange(60)[None] < torch.tensor([[60], [41], [9]]), torch.arange(60)[None], 25)
    bias = attention_bias(allowed, dtype)
    assert bias.dtype == dtype and set(bias.unique().tolist()) == {0.0, float("-inf")}
    expected = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=allowed)
    got = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=bias)
    assert torch.equal(got, expected)


def test_the_estimator_runs_stacked_projections_that_follow_its_loaded_weights() -> None:
    """A forward projects each attention layer's queries, keys and values in one product and
    every ResNet block's time term in one product for all (fewer kernels a solver step): the
    separate official modules never run, their stacked copies give what they give, and a load
    of other weights restacks them (and refolds the layers folded for attention over inputs). A causal convolution without a view pads inside the
    convolution, with the outputs of left padding alone."""
    estimator = randomize_(Estimator(EstimatorConfig.tiny()), seed=11)
    calls = []
    for layer in estimator.attention_layers:
        for linear in (layer.to_q, layer.to_k, layer.to_v):
            linear.register_forward_hook(lambda *_: calls.append("qkv"))
    for resnet in estimator.resnets:
        resnet.mlp.register_forward_hook(lambda *_: calls.append("time"))
    generator = torch.Generator().manual_seed(12)
    x, mu, cond = (torch.randn(2, 80, 60, generator=generator) for _ in range(3))
    spks, t, mask = torch.randn(2, 80, generator=generator), torch.rand(2, generator=generator), torch.ones(2, 1, 60)
    with torch.inference_mode():
        estimator(x, mask, mu, t, spks, cond, streaming=True)
    assert not calls

    def check_stacked(estimator: Estimator) -> None:
        layer = estimator.attention_layers[-1]
        h = torch.randn(2, 7, layer.dim, generator=generator)
        stacked = nn.functional.linear(h, layer.qkv_weight).chunk(3, dim=-1)
        for part, linear in zip(stacked, (layer.to_q, layer.to_k, layer.to_v)):
            assert max_err(part, linear(h)) <= 1e-6
        time_emb = torch.randn(2, estimator.time_weight.shape[1], generator=generator)
        terms = estimator.time_terms(time_emb)
        assert len(terms) == len(estimator.resnets) == 2 + EstimatorConfig.tiny().num_mid_blocks
        for term, resnet in zip(terms, estimator.resnets):
            assert max_err(term, resnet.mlp(time_emb)) <= 1e-6

    with torch.no_grad():
        check_stacked(estimator)
        estimator.fold_input_attention()
        other = randomize_(Estimator(EstimatorConfig.tiny()), seed=13)
        estimator.load_state_dict(other.state_dict())
        check_stacked(estimator)
        folded = [(layer.qk_weight.clone(), layer.vo_weight.clone()) for layer in estimator.attention_layers]
        other.fold_input_attention()  # a load refolds the folded layers from the new weights too
        for (qk, vo), layer in zip(folded, other.attention_layers):
            assert max_err(qk, layer.qk_weight) <= 1e-6 and max_err(vo, layer.vo_weight) <= 1e-6
        assert "qkv_weight" not in "".join(estimator.state_dict()) and "time_weight" not in "".join(estimator.state_dict())
        conv = estimator.causal_convs[0]
        h = torch.randn(2, conv.in_channels, 9, generator=generator)
        assert max_err(conv(h), nn.functional.conv1d(nn.functional.pad(h, (conv.context, 0)), conv.weight, conv.bias)) <= 1e-6


class InputsOnly:
    """A view that keeps a layer's inputs: here, attention over the call's own frames only."""

    keeps_inputs = True

    def __init__(self, mask: Tensor, dim: int) -> None:
        self.mask = mask
        batch, _, frames, _ = mask.shape
        self.inputs = mask.new_full((batch, frames, dim), float("nan"))  # written before each attention

    def input_store(self, slot: int) -> tuple[Tensor, Tensor]:
        return self.inputs.view(-1, self.inputs.shape[-1]), torch.arange(self.inputs.shape[0] * self.inputs.shape[1])

    def attend_inputs(self, slot: int, query: Tensor, scale: float) -> Tensor:
        keys = self.inputs[:, None]  # one head of the inputs, shared by every query head
        out = nn.functional.scaled_dot_product_attention(query.transpose(1, 2), keys, keys, self.mask, scale=scale)
        return out.transpose(1, 2)


def test_attention_over_a_layers_inputs_is_attention_over_its_keys_and_values() -> None:
    """Keys and values are linear in the layer's input, so a view that keeps the inputs gets
    the same attention (chunk mask included) from a quarter of the state."""
    layer = randomize_(SelfAttention(dim=32, heads=4, head_dim=16), seed=5)
    x = torch.randn(2, 120, 32, generator=torch.Generator().manual_seed(6))
    allowed = chunk_attention_mask(torch.ones(2, 120, dtype=torch.bool), torch.arange(120)[None], 50)
    mask = attention_bias(allowed, x.dtype)
    expected = layer(x, mask, None)
    got = layer(x, None, InputsOnly(mask, 32))
    assert expected.abs().max() > 0.1
    assert max_err(got, expected) <= 1e-5


def test_a_transformer_block_writes_its_attention_inputs_once_from_the_norm(monkeypatch) -> None:
    """Through a view that keeps inputs, a transformer block's first norm writes the layer's
    inputs into the view's store (one kernel with the fused norms, serving/turn_pool.py's
    pages), and the layer does not write them again: the same block output as a layer given
    its inputs to write itself."""
    block = randomize_(TransformerBlock(32, 4, 16, "gelu"), seed=9)
    x, pending = (torch.randn(2, 120, 32, generator=torch.Generator().manual_seed(s)) for s in (10, 11))
    allowed = chunk_attention_mask(torch.ones(2, 120, dtype=torch.bool), torch.arange(120)[None], 50)
    view = InputsOnly(attention_bias(allowed, x.dtype), 32)
    asked = []
    store = view.input_store
    monkeypatch.setattr(view, "input_store", lambda slot: asked.append(slot) or store(slot))
    got = block(x, pending, None, view)
    assert asked == [block.attn1.cache_slot]
    stream = x + pending
    attended = stream + block.attn1(block.norm1(stream), None, view)  # the layer writes its inputs itself
    assert asked == [block.attn1.cache_slot] * 2
    assert max_err(got[0], attended) <= 1e-5 and max_err(got[1], block.ff(block.norm3(attended))) <= 1e-5


def test_folded_attention_over_inputs_is_the_per_head_carry_in_two_products(monkeypatch) -> None:
    """``fold_input_attention``: the same attention through a view that keeps inputs, with the
    folded products in place of the query projection, the per-head carries and to_out."""
    layer = randomize_(SelfAttention(dim=32, heads=4, head_dim=16), seed=7)
    x = torch.randn(2, 120, 32, generator=torch.Generator().manual_seed(8))
    allowed = chunk_attention_mask(torch.ones(2, 120, dtype=torch.bool), torch.arange(120)[None], 50)
    view = InputsOnly(attention_bias(allowed, x.dtype), 32)
    carried = layer(x, None, view)
    layer.fold_input_attention()
    assert layer.qk_weight.shape == (4 * 32, 32) and layer.vo_weight.shape == (32, 4 * 32)
    assert layer.qk_weight.dtype == torch.float32 and "qk_weight" not in layer.state_dict()
    calls = []
    for linear in (layer.to_q, layer.to_k, layer.to_v, layer.to_out[0]):
        linear.register_forward_hook(lambda *_: calls.append(1))
    with monkeypatch.context() as patch:
        patch.setattr(torch, "einsum", lambda *_: pytest.fail("the per-head carry ran"))
        folded = layer(x, None, view)
    assert not calls
    assert carried.abs().max() > 0.1
    assert max_err(folded, carried) <= 1e-5
    held = layer.qk_weight
    with torch.inference_mode():
        layer.to_q.weight.mul_(2)
    layer.fold_input_attention()  # again after the weights changed: into the same buffers
    layer.fuse_projections()  # and the plain path's stacked projections
    assert layer.qk_weight is held
    assert max_err(layer(x, None, view), layer(x, attention_bias(allowed, x.dtype), None)) <= 1e-5


def test_folded_attention_in_bf16_errs_no_more_than_the_plain_attention() -> None:
    """The GPU serves bf16: the folded products, taken in float32 and stored in bf16, leave the
    layer's output as close to the float32 one as bf16's plain attention is (rounding of the
    same order, not an error of the folding)."""
    layer = randomize_(SelfAttention(dim=256, heads=8, head_dim=64), seed=7)
    x = torch.randn(2, 120, 256, generator=torch.Generator().manual_seed(8))
    allowed = chunk_attention_mask(torch.ones(2, 120, dtype=torch.bool), torch.arange(120)[None], 50)
    expected = layer(x, attention_bias(allowed, x.dtype), None)
    layer.to(torch.bfloat16)
    x, bias = x.bfloat16(), attention_bias(allowed, torch.bfloat16)
    plain_err = max_err(layer(x, bias, None).float(), expected)
    layer.fold_input_attention()
    assert layer.qk_weight.dtype == torch.bfloat16
    folded_err = max_err(layer(x, None, InputsOnly(bias, 256)).float(), expected)
    assert 0 < plain_err < 0.05 * float(expected.abs().max())
    assert folded_err <= 2 * plain_err


def test_flow_chunk_mask_equals_official_without_host_sync() -> None:
    mask_utils = official("cosyvoice.utils.mask")
    lengths = torch.tensor([7, 0, 3, 5])  # an empty row exercises the "no visible key" rule
    size = 7
    pad_mask = ~mask_utils.make_pad_mask(lengths, size)[:, None, :]  # [B, 1, T], True = real
    positions = torch.arange(size)[None]
    for chunk in (0, 2, 3, 50):
        expected = mask_utils.add_optional_chunk_mask(
            torch.zeros(4, size, 1), pad_mask.clone(), False, False, 0, chunk, -1
        )
        expected = expected.expand(-1, size, -1)  # the non-chunked form is [B, 1, T], repeated by the caller
        got = chunk_attention_mask(pad_mask[:, 0], positions, chunk)
        assert got.shape == (4, 1, size, size)
        assert torch.equal(got[:, 0], expected), chunk

    # No data-dependent host read: the mask builds on the meta device (shapes only),
    # where the official helper's .item() check cannot run.
    meta_mask = pad_mask.to("meta")
    got = chunk_attention_mask(meta_mask[:, 0], positions.to("meta"), 50)
    assert got.shape == (4, 1, size, size) and got.dtype == torch.bool
    with pytest.raises((RuntimeError, NotImplementedError)):
        mask_utils.add_optional_chunk_mask(torch.zeros(4, size, 1, device="meta"), meta_mask, False, False, 0, 50, -1)


def test_flow_estimator_runs_without_host_sync() -> None:
    """The whole estimator pass (masks included) runs on the meta device: nothing reads tensor data on the host."""
    with torch.device("meta"):
        estimator = Estimator(EstimatorConfig.tiny()).eval()
        x, mu, cond = (torch.zeros(2, 80, 75) for _ in range(3))
        out = estimator(x, torch.ones(2, 1, 75), mu, torch.zeros(2), torch.zeros(2, 80), cond, streaming=True)
    assert out.shape == (2, 80, 75)


# ----------------------------------------------------------------------------- chunk-causality


def test_chunk_causality_flow_decoder(cfm_pair) -> None:
    """Appending frames leaves earlier complete 50-frame chunks unchanged (streaming mode), so they can be cached.

    Measured (tiny model, float32): estimator output and final mel of frames in complete
    chunks differ by <= ~1e-6 (float rounding); frames of the shorter run's partial chunk
    and, without the chunk mask, all frames differ by O(0.1..1).
    """
    _, ours = cfm_pair
    mu, mask, spks, cond = decoder_inputs(frames=150, prompt=36, seed=20)
    generator = torch.Generator().manual_seed(21)
    x, t = torch.randn(1, 80, 150, generator=generator), torch.rand(1, generator=generator)

    def run(frames: int, streaming: bool) -> tuple[Tensor, Tensor]:
        args = (mu[:, :, :frames], mask[:, :, :frames], spks, cond[:, :, :frames])
        with torch.inference_mode():
            velocity = ours.estimator(x[:, :, :frames], args[1], args[0], t, spks, args[3], streaming=streaming)
            return velocity, ours(*args, streaming=streaming)

    full_velocity, full_mel = run(150, streaming=True)
    for short, stable in ((100, 100), (120, 100)):  # 2 whole chunks; 2 whole chunks + 20 frames
        velocity, mel = run(short, streaming=True)
        assert max_err(velocity[:, :, :stable], full_velocity[:, :, :stable]) <= 1e-5
        assert max_err(mel[:, :, :stable], full_mel[:, :, :stable]) <= 1e-5
        if short > stable:  # the partial chunk saw fewer frames of its own chunk
            assert max_err(mel[:, :, stable:], full_mel[:, :, stable:short]) > 1e-2
    # Full attention: every frame sees the future.
    _, full_mel = run(150, streaming=False)
    _, mel = run(100, streaming=False)
    assert (mel[:, :, :50] - full_mel[:, :, :50]).abs().max() > 1e-2


# ----------------------------------------------------------------------------- the whole flow


@pytest.mark.parametrize("steps", STEPS)
def test_equivalence_flow(flow_pair, steps) -> None:
    reference, ours = flow_pair
    speech = utterance(prompt=13, tokens=40, seed=40)
    for streaming in (False, True):
        for finalize in (False, True):
            with torch.inference_mode(), official_steps(reference, steps):
                expected, _ = reference.inference(*speech.args(), streaming, finalize)
                got = ours.inference(*speech.args(), streaming=streaming, finalize=finalize, n_timesteps=steps)
            assert expected.shape == (1, 80, 2 * (40 - (0 if finalize else 3)))
            assert expected.abs().max() > 1.0
            assert max_err(got, expected) <= TOLERANCE, (streaming, finalize)


def test_equivalence_flow_reverse_load() -> None:
    """Our random state dict loads strictly into the official flow, which then gives our output."""
    ours = randomize_(Flow(FlowConfig.tiny()), seed=8)
    reference = official_flow(FlowConfig.tiny()).eval()
    reference.load_state_dict(ours.state_dict(), strict=True)
    speech = utterance(prompt=10, tokens=30, seed=41)
    with torch.inference_mode():
        expected, _ = reference.inference(*speech.args(), True, True)
        got = ours.inference(*speech.args(), streaming=True, finalize=True)
    assert max_err(got, expected) <= TOLERANCE


def test_equivalence_flow_batched(flow_pair) -> None:
    """Rows with different prompt and token lengths in one batch: each equals the official run of that row alone."""
    reference, ours = flow_pair
    rows = [utterance(13, 40, seed=50), utterance(7, 22, seed=51), utterance(20, 31, seed=52)]

    def stack(tensors: list[Tensor]) -> Tensor:
        width = max(t.shape[1] for t in tensors)
        return torch.cat([nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, width - t.shape[1])) for t in tensors])

    batch = (
        stack([r.token for r in rows]), torch.tensor([r.token.shape[1] for r in rows]),
        stack([r.prompt_token for r in rows]), torch.tensor([r.prompt_token.shape[1] for r in rows]),
        stack([r.prompt_feat for r in rows]), torch.tensor([r.prompt_feat.shape[1] for r in rows]),
        torch.cat([r.embedding for r in rows]),
    )
    for streaming, finalize in ((True, False), (False, True)):
        with torch.inference_mode():
            mel, mel_len = ours.inference_batch(*batch, streaming=streaming, finalize=finalize)
        for i, row in enumerate(rows):
            with torch.inference_mode():
                expected, _ = reference.inference(*row.args(), streaming, finalize)
            assert int(mel_len[i]) == expected.shape[2]
            assert max_err(mel[i : i + 1, :, : expected.shape[2]], expected) <= TOLERANCE, (streaming, finalize, i)
            assert not mel[i, :, expected.shape[2] :].any()


def test_chunk_causality_flow(flow_pair) -> None:
    """The official flow, streaming: appending tokens leaves the mel of complete chunks unchanged.

    Prompt 25 tokens (50 frames), then 50 or 62 new tokens encoded (finalize=False, 3 more
    as look-ahead) vs 87: new frames 0..99 end on a chunk boundary (absolute frame 150).
    Measured: complete chunks differ by ~1.4e-6 (float rounding); the partial chunk of the
    62-token run (new frames 100..123) by ~6e-2; without chunk masks (streaming=False)
    every frame differs, ~0.1..0.2 (mel values up to ~5).
    """
    reference, _ = flow_pair
    speech = utterance(prompt=25, tokens=90, seed=80)

    def run(tokens: int, streaming: bool) -> Tensor:
        with torch.inference_mode():
            return reference.inference(*speech.args(tokens), streaming, False)[0]

    longest = run(90, streaming=True)
    assert max_err(run(53, streaming=True), longest[:, :, :100]) <= 1e-5
    partial = run(65, streaming=True)
    assert max_err(partial[:, :, :100], longest[:, :, :100]) <= 1e-5
    assert (partial[:, :, 100:] - longest[:, :, 100:124]).abs().max() > 1e-2
    assert (run(53, streaming=False) - run(90, streaming=False)[:, :, :100]).abs().max() > 1e-2


def test_flow_full_size_matches_official_keys_and_shapes() -> None:
    """CosyVoice2-0.5B sizes (cosyvoice2.yaml), built on the meta device: identical state dict keys and shapes."""
    config = FlowConfig.full()
    with torch.device("meta"):
        reference = official_flow(config)
        ours = Flow(config)
    expected = {name: tuple(t.shape) for name, t in reference.state_dict().items()}
    got = {name: tuple(t.shape) for name, t in ours.state_dict().items()}
    assert got == expected
    assert sum(p.numel() for p in ours.parameters()) == 112_549_360  # 112.5 M
    ours.load_state_dict(reference.state_dict(), strict=True, assign=True)
    reference.load_state_dict(ours.state_dict(), strict=True, assign=True)
