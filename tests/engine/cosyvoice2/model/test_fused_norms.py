"""The flow decoder's fused norm kernels (model/fused_norms.py).

The Triton kernels are checked on CPU tensors by Triton's interpreter, in a subprocess
(fused_norms_interpreted.py): ``TRITON_INTERPRET=1`` must be set before Triton is imported
and turns every kernel of the process into Python, so it is kept out of this one. Each case
there compares the fused path with the plain torch ops (the kernels switched off): the ops
alone, the estimator's blocks, the whole estimator, and a voice prefix with a solve after it
through a cached-frames view. Here, in the test process, the references are checked against
the textbook formulas, and the dispatch: CPU tensors take the plain torch ops.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tts_gateway.engine.cosyvoice2.model import fused_kernels, fused_norms
from tests.triton_interpreter import run_cases

# float32: each output is computed once either way, from the same inputs; only the order of
# float32 operations differs.
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return run_cases("tests.engine.cosyvoice2.model.fused_norms_interpreted")


def test_the_interpreter_ran_every_case(interpreted) -> None:
    ops = [name for name in interpreted if name.startswith(("norm_mish_mask/", "add_norm/"))]
    # three shapes x (addends x layouts, strided, add_norm with, without its add and with a store), wide range
    assert len(ops) == 3 * (3 * 2 + 4) + 1
    assert {"CausalBlock", "ResnetBlock", "TransformerBlock x2", "Estimator/streaming=False",
            "Estimator/streaming=True", "voice prefix and solve after it"} <= set(interpreted)
    for name, case in interpreted.items():
        assert sum(case["launches"].values()) >= 1, name  # the fused path ran
        assert case["scale"] > 1.0, name  # and had something to compute


def test_fused_ops_match_their_references_in_float32(interpreted) -> None:
    for name, case in interpreted.items():
        if name.startswith("bfloat16/"):
            continue
        if name == "norm_mish_mask/wide_range":  # values to ~125: float32 rounding at that size
            assert case["max_abs"] <= TOLERANCE * case["scale"], case
        else:
            assert case["max_abs"] <= TOLERANCE, (name, case)


def test_fused_ops_round_once_in_bfloat16(interpreted) -> None:
    """In bfloat16 the plain ops round after each op and the fused op once: at most a couple
    of bfloat16 steps (2^-7 relative) apart."""
    for name in ("bfloat16/norm_mish_mask", "bfloat16/add_norm"):
        case = interpreted[name]
        assert 0 < case["max_abs"] <= 2 * 2**-7 * case["scale"], (name, case)


def test_the_fused_modules_launch_one_kernel_per_norm(interpreted) -> None:
    """Every causal block's norm is one norm_mish_mask; every norm of a transformer block one
    add_norm (a stage's first norm1 without the add)."""
    assert interpreted["CausalBlock"]["launches"] == {"norm_mish_mask": 1}
    assert interpreted["ResnetBlock"]["launches"] == {"norm_mish_mask": 2}
    assert interpreted["TransformerBlock x2"]["launches"] == {"add_norm": 4}
    # The tiny estimator: 4 ResNet blocks' 2 causal blocks and the final one; 4 stages of 1 block.
    assert interpreted["Estimator/streaming=True"]["launches"] == {"norm_mish_mask": 9, "add_norm": 8}


def layer_norm(channels: int) -> nn.LayerNorm:
    norm = nn.LayerNorm(channels, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.5, 0.5)
    return norm


def test_norm_mish_mask_reference_is_the_textbook_formula() -> None:
    """LayerNorm over channels (biased variance, eps inside the root, affine), then
    mish(y) = y tanh(softplus(y)), times the frame mask, plus the addend."""
    torch.manual_seed(0)
    h, mask, addend = 3 * torch.randn(2, 16, 9), (torch.rand(2, 1, 9) > 0.3).float(), torch.randn(2, 16, 1)
    norm = layer_norm(16)
    mean = h.mean(dim=1, keepdim=True)
    var = ((h - mean) ** 2).mean(dim=1, keepdim=True)
    y = (h - mean) / torch.sqrt(var + norm.eps) * norm.weight[:, None] + norm.bias[:, None]
    expected = y * torch.tanh(nn.functional.softplus(y)) * mask + addend
    with torch.no_grad():
        got = fused_norms.norm_mish_mask_reference(h, norm, mask, addend)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_add_norm_reference_is_the_residual_and_its_norm() -> None:
    torch.manual_seed(0)
    x, delta, norm = torch.randn(2, 5, 16), torch.randn(2, 5, 16), layer_norm(16)
    with torch.no_grad():
        total, normed = fused_norms.add_norm_reference(x, delta, norm)
    assert torch.equal(total, x + delta)
    assert torch.equal(normed, norm(x + delta))


def test_add_norm_reference_writes_the_normed_rows_to_its_store() -> None:
    """Without delta the norm alone (x itself as the sum); a store gets the normed rows at its
    index, the other rows of its target untouched."""
    torch.manual_seed(0)
    x, norm = torch.randn(2, 3, 16), layer_norm(16)
    target, index = torch.zeros(9, 16), torch.tensor([8, 0, 4, 2, 6, 1])
    with torch.no_grad():
        total, normed = fused_norms.add_norm_reference(x, None, norm, (target, index))
    assert total is x and torch.equal(normed, norm(x))
    assert torch.equal(target[index], normed.reshape(6, 16))
    assert not target[[3, 5, 7]].any()


@pytest.mark.skipif(fused_kernels.triton is None, reason="the kernel's launcher needs Triton")
def test_the_fused_add_norm_refuses_a_store_it_would_write_out_of() -> None:
    """The kernel's store is checked on the host, before a launch could read past the index or
    write rows of another width or dtype: what index_copy_ refuses on the plain path."""
    x, delta, norm = torch.randn(2, 3, 16), torch.randn(2, 3, 16), layer_norm(16)
    stores = {
        "index too short": (torch.zeros(9, 16), torch.arange(5)),
        "rows of another width": (torch.zeros(9, 8), torch.arange(6)),
        "another dtype": (torch.zeros(9, 16, dtype=torch.float64), torch.arange(6)),
        "a float index": (torch.zeros(9, 16), torch.arange(6.0)),
    }
    for name, store in stores.items():
        with pytest.raises(ValueError, match="add_norm's store"):
            fused_norms._add_norm_triton(x, delta, norm.weight, norm.bias, norm.eps, store)
            pytest.fail(name)


@pytest.mark.skipif(fused_kernels.INTERPRETED, reason="Triton's interpreter takes CPU tensors")
def test_cpu_tensors_take_the_plain_torch_ops(monkeypatch) -> None:
    """On a CPU the fused kernels never run, switch on or off."""

    def refuse(*args, **kwargs):
        raise AssertionError("a Triton kernel was launched for CPU tensors")

    monkeypatch.setattr(fused_norms, "_norm_mish_mask_triton", refuse)
    monkeypatch.setattr(fused_norms, "_add_norm_triton", refuse)
    monkeypatch.setattr(fused_kernels, "enabled", True)
    norm = layer_norm(8)
    with torch.no_grad():
        fused_norms.norm_mish_mask(torch.randn(1, 8, 4), norm, torch.ones(1, 1, 4))
        fused_norms.add_norm(torch.randn(1, 4, 8), torch.randn(1, 4, 8), norm)
    assert not fused_kernels.applies(torch.zeros(1))


def test_the_switch_turns_the_fused_path_off(monkeypatch) -> None:
    """With the switch off no tensor takes the fused path, whatever its device."""
    monkeypatch.setattr(fused_kernels, "enabled", False)
    monkeypatch.setattr(fused_kernels, "INTERPRETED", True)  # as if CPU tensors could run kernels
    assert not fused_kernels.applies(torch.zeros(1))
    monkeypatch.setattr(fused_kernels, "enabled", True)
    assert fused_kernels.applies(torch.zeros(1)) == fused_kernels.available()
