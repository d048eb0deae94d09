"""A causal convolution's input in the paged decoder as one fused kernel (serving/fused_context.py).

The Triton kernel is checked on CPU tensors by Triton's interpreter, in a subprocess
(fused_context_interpreted.py): ``TRITON_INTERPRET=1`` must be set before Triton is imported
and turns every kernel of the process into Python, so it is kept out of this one. Each case
there compares the fused path with the plain torch ops (the kernels switched off): the op on
rows with and without stored frames, committing and not, padding rows, the Euler step as an
int and as a tensor; a paged solve; and the Euler step a CUDA graph captures, over padded rows
at a step counter tensor. Here, in the test process, the reference is checked against its
definition, and the dispatch: CPU tensors take the plain torch ops.
"""

from __future__ import annotations

import pytest
import torch

from tts_gateway.engine.cosyvoice2.model import fused_kernels
from tts_gateway.engine.cosyvoice2.model.cfm import CFM
from tts_gateway.engine.cosyvoice2.modeldir.configs import CFMConfig
from tts_gateway.engine.cosyvoice2.serving import fused_context
from tts_gateway.engine.cosyvoice2.serving.fused_context import ContextRows
from tests.triton_interpreter import run_cases

OP_CASES = {
    "conv_input/rows/int step", "conv_input/rows/tensor step", "conv_input/padding/row 0 stored=50",
    "conv_input/padding/row 0 stored=0", "conv_input/130 frames x 80 channels", "conv_input/strided x",
    "bfloat16/conv_input",
}
SOLVE_CASES = {"solve_paged/conv_input fused", "graph step program/conv_input fused", "solve_paged/all fused"}


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return run_cases("tests.engine.cosyvoice2.serving.fused_context_interpreted")


def test_the_interpreter_ran_every_case(interpreted) -> None:
    assert set(interpreted) == OP_CASES | SOLVE_CASES
    for name, case in interpreted.items():
        assert case["launches"].get("conv_input", 0) >= 1, name  # the fused path ran
        assert case["scale"] > 1.0, name  # and had something to compute
        assert case["written"] > 0, name  # and to write to the pool


def test_the_fused_conv_input_is_the_reference_exactly(interpreted) -> None:
    """A copy either way: the same values in any dtype, the outputs and the pool's state alike,
    and a paged solve with the kernel on gives the same mel and state bit for bit."""
    for name, case in interpreted.items():
        if name != "solve_paged/all fused":
            assert case["max_abs"] == 0.0, (name, case)


def test_a_paged_solve_with_every_fused_kernel_on_is_the_plain_one(interpreted) -> None:
    """With the fused norms too (float32, tests/engine/cosyvoice2/model/test_fused_norms.py)."""
    case = interpreted["solve_paged/all fused"]
    assert case["max_abs"] <= 1e-5, case
    assert {"norm_mish_mask", "add_norm"} <= set(case["launches"])


def test_one_launch_per_convolution_and_euler_step(interpreted) -> None:
    convs = len(CFM(CFMConfig.tiny()).estimator.causal_convs)
    for name in SOLVE_CASES:
        assert interpreted[name]["launches"]["conv_input"] == convs * 2, name  # two Euler steps


def random_state(channels: int = 6, frames: int = 5) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    turns = torch.randn(3, 4, 2, channels, 2, generator=generator)  # 3 steps, 3 turn slots and scratch
    bank = torch.randn(3, 2, 2, channels, 2, generator=generator)
    x = torch.randn(4, channels, frames, generator=generator)
    return turns, bank, x


# Two call rows, doubled for CFG: row 0 has stored frames and commits 3 (as if a chunk were
# 3 frames), row 1 has none and commits nothing (the scratch slot, 3, takes its context).
ROWS = ContextRows(
    stored=torch.tensor([10, 0, 10, 0]), commit=torch.tensor([3, 0, 3, 0]), read_slot=torch.tensor([1, 2, 1, 2]),
    write_slot=torch.tensor([1, 3, 1, 3]), bank_slot=torch.tensor([1, 0, 1, 0]), branch=torch.tensor([0, 0, 1, 1]),
)


@pytest.mark.parametrize("step", [2, torch.tensor([2])])
def test_the_reference_puts_the_context_in_front_and_keeps_the_one_after_the_commit(step) -> None:
    """Row r's context is its turn's at (step, read slot, CFG row) when it has stored frames,
    else its voice prefix's in the bank; the pool then holds, at its write slot, the frames
    just before ``commit`` of [context | x]."""
    turns, bank, x = random_state()
    before = turns.clone()
    with torch.inference_mode():
        extended = fused_context.conv_input_reference(x, turns, bank, step, ROWS)
    for r in range(4):
        branch = int(ROWS.branch[r])
        if ROWS.stored[r] > 0:
            context = before[2, int(ROWS.read_slot[r]), branch]
        else:
            context = bank[2, int(ROWS.bank_slot[r]), branch]
        assert torch.equal(extended[r], torch.cat([context, x[r]], dim=1))
        commit = int(ROWS.commit[r])
        assert torch.equal(turns[2, int(ROWS.write_slot[r]), branch], extended[r, :, commit : commit + 2])
    assert torch.equal(turns[2, 1, :, :, :], torch.stack([x[0, :, 1:3], x[2, :, 1:3]]))  # frames 1, 2 of x
    unwritten = torch.ones(turns.shape[:3], dtype=torch.bool)
    unwritten[2, 1], unwritten[2, 3] = False, False
    assert torch.equal(turns[unwritten], before[unwritten])


@pytest.mark.skipif(fused_kernels.INTERPRETED, reason="Triton's interpreter takes CPU tensors")
def test_cpu_tensors_take_the_plain_torch_ops(monkeypatch) -> None:
    """On a CPU the fused kernel never runs, switch on or off."""

    def refuse(*args, **kwargs):
        raise AssertionError("a Triton kernel was launched for CPU tensors")

    monkeypatch.setattr(fused_context, "_conv_input_triton", refuse)
    monkeypatch.setattr(fused_kernels, "enabled", True)
    turns, bank, x = random_state()
    expected_turns = turns.clone()
    with torch.inference_mode():
        got = fused_context.conv_input(x, turns, bank, 1, ROWS)
        expected = fused_context.conv_input_reference(x, expected_turns, bank, 1, ROWS)
    assert torch.equal(got, expected) and torch.equal(turns, expected_turns)


def test_the_switch_turns_the_fused_path_off(monkeypatch) -> None:
    """The flow's fused-kernel switch (flow_fused_kernels) decides: off, no tensor takes the kernel."""
    monkeypatch.setattr(fused_kernels, "enabled", False)
    monkeypatch.setattr(fused_kernels, "INTERPRETED", True)  # as if CPU tensors could run kernels
    monkeypatch.setattr(fused_context, "_conv_input_triton", lambda *args: pytest.fail("the kernel ran"))
    turns, bank, x = random_state()
    with torch.inference_mode():
        fused_context.conv_input(x, turns, bank, 1, ROWS)
