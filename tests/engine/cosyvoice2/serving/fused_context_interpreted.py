"""The fused conv-input kernel (serving/fused_context.py) run by Triton's interpreter on CPU
tensors, against its torch reference and against a paged solve's plain torch path.

Run by tests/engine/cosyvoice2/serving/test_fused_context.py in a subprocess with
``TRITON_INTERPRET=1``: the variable must be set before Triton is imported, and the
interpreter then replaces every kernel of the process, so it stays out of the test process.
Prints one JSON object: case name -> largest |fused - plain| over the outputs and the pool's
state (its scratch slot and pages aside where several rows write them in no set order), the
largest |plain| output (a check that the case is not trivially zero), how many pool values
the call changed, and how many times each kernel ran.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from tts_gateway.engine.cosyvoice2.model import estimator as estimator_module
from tts_gateway.engine.cosyvoice2.model import fused_norms
from tts_gateway.engine.cosyvoice2.model.cfm import CFM
from tts_gateway.engine.cosyvoice2.modeldir.configs import CFMConfig
from tts_gateway.engine.cosyvoice2.serving import fused_context
from tts_gateway.engine.cosyvoice2.serving.buckets import FlowBuckets, pad_inputs
from tts_gateway.engine.cosyvoice2.serving.flow_graphs import step_program
from tts_gateway.engine.cosyvoice2.serving.fused_context import ContextRows
from tts_gateway.engine.cosyvoice2.serving.prefix_bank import PrefixBank, decoder_prefix
from tts_gateway.engine.cosyvoice2.serving.turn_pool import TurnStatePool, pad_turn_rows, solve_paged, turn_rows
from tests.reference import randomize
from tests.triton_interpreter import counted, fused_and_plain, print_cases

fused_context._conv_input_triton = counted("conv_input", fused_context._conv_input_triton)
fused_norms._norm_mish_mask_triton = counted("norm_mish_mask", fused_norms._norm_mish_mask_triton)
fused_norms._add_norm_triton = counted("add_norm", fused_norms._add_norm_triton)


def max_abs(got: list[Tensor], expected: list[Tensor]) -> float:
    return max(float((g.float() - e.float()).abs().max()) for g, e in zip(got, expected, strict=True))


# ----------------------------------------------------------------------------- the op

STEPS, TURN_SLOTS, BANK_SLOTS, CONTEXT = 3, 4, 2, 2
SCRATCH = TURN_SLOTS  # the pool's scratch slot


def context_rows(stored: list[int], commit: list[int], turn_slot: list[int], bank_slot: list[int]) -> ContextRows:
    """The 2B estimator rows of B call rows, as turn_pool.PagedView builds them."""
    stored_, commit_, read_slot, bank_slot_ = (
        torch.tensor(v).repeat(2) for v in (stored, commit, turn_slot, bank_slot)
    )
    write_slot = torch.where(commit_ > 0, read_slot, SCRATCH)
    branch = torch.arange(2).repeat_interleave(len(stored))
    return ContextRows(stored_, commit_, read_slot, write_slot, bank_slot_, branch)


def op_case(
    generator: torch.Generator, rows: ContextRows, channels: int, frames: int, step: int | Tensor,
    scratch_shared: bool, dtype: torch.dtype = torch.float32, strided: bool = False,
) -> dict:
    """One conv_input over a random pool and bank. ``scratch_shared``: rows that write the
    scratch slot write different values there (compared without it)."""
    turns = torch.randn(STEPS, TURN_SLOTS + 1, 2, channels, CONTEXT, generator=generator).to(dtype)
    bank = torch.randn(STEPS, BANK_SLOTS, 2, channels, CONTEXT, generator=generator).to(dtype)
    x = torch.randn(len(rows.stored), channels, frames, generator=generator).to(dtype)
    if strided:  # frames-major memory
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    pools = [turns.clone(), turns.clone()]

    def call(pool: Tensor) -> Callable[[], list[Tensor]]:
        return lambda: [fused_context.conv_input(x, pool, bank, step, rows)]

    got, expected, ran = fused_and_plain(call(pools[0]), call(pools[1]))
    kept = slice(0, SCRATCH) if scratch_shared else slice(None)
    got.append(pools[0][:, kept])
    expected.append(pools[1][:, kept])
    return {
        "max_abs": max_abs(got, expected),
        "scale": float(expected[0].float().abs().max()),
        "written": int((pools[1] != turns).sum()),
        "launches": ran,
    }


def op_cases(cases: dict) -> None:
    generator = torch.Generator().manual_seed(0)
    # Row 0: stored frames, commits a chunk; row 1: a new turn (the voice prefix's context),
    # commits; rows 2 and 3: stored frames / none, commit nothing (both write the scratch slot).
    rows = context_rows([50, 0, 100, 0], [50, 50, 0, 0], [0, 1, 2, 3], [1, 0, 1, 0])
    for name, step in (("int step", 2), ("tensor step", torch.tensor([1]))):
        cases[f"conv_input/rows/{name}"] = op_case(generator, rows, 40, 70, step, scratch_shared=True)
    # Padding rows as pad_turn_rows makes them: row 0's prefix slot and stored frames, the
    # scratch slot, no commit. They read and write the scratch slot alone (row 0 with stored
    # frames) or write the voice prefix's context there (without): the same values either way.
    for stored in (50, 0):
        padded = context_rows([stored, 0, stored, stored], [50, 50, 0, 0], [0, 1, SCRATCH, SCRATCH], [1, 0, 1, 1])
        cases[f"conv_input/padding/row 0 stored={stored}"] = op_case(
            generator, padded, 40, 70, torch.tensor([2]), scratch_shared=False)
    # More than one program along frames and channels, neither a multiple of its block.
    cases["conv_input/130 frames x 80 channels"] = op_case(generator, rows, 80, 130, 0, scratch_shared=True)
    cases["conv_input/strided x"] = op_case(generator, rows, 40, 70, torch.tensor([0]), True, strided=True)
    # bfloat16, as on the GPU: a copy, exact in any dtype.
    cases["bfloat16/conv_input"] = op_case(
        generator, rows, 40, 70, torch.tensor([1]), scratch_shared=True, dtype=torch.bfloat16)


# ----------------------------------------------------------------------------- paged solves

LENGTHS = [60, 57, 40]  # new frames of the call's rows
SLOTS, STORED, COMMIT = [1, 0, 1], [50, 0, 100], [50, 50, 0]
SOLVE_STEPS = 2


@contextlib.contextmanager
def plain_norms() -> Iterator[None]:
    """The estimator's norms as their torch ops whatever the switch: the conv-input kernel alone."""
    fused = estimator_module.norm_mish_mask, estimator_module.add_norm
    def norm_mish_mask(h: Tensor, norm, mask: Tensor, addend: Tensor | None = None, frames_major: bool = False):
        return fused_norms.norm_mish_mask_reference(h, norm, mask, addend)

    estimator_module.norm_mish_mask = norm_mish_mask
    estimator_module.add_norm = fused_norms.add_norm_reference
    try:
        yield
    finally:
        estimator_module.norm_mish_mask, estimator_module.add_norm = fused


def call_inputs(generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """mu, mask, spks, cond of LENGTHS rows, zero past each row's frames."""
    longest = max(LENGTHS)
    mask = (torch.arange(longest) < torch.tensor(LENGTHS)[:, None])[:, None, :].float()
    mu, cond = (torch.randn(len(LENGTHS), 80, longest, generator=generator) * mask for _ in range(2))
    return mu, mask, torch.randn(len(LENGTHS), 80, generator=generator), cond


def voices_bank(cfm: CFM, generator: torch.Generator) -> PrefixBank:
    """Voice prefixes of 50 frames (slot 0) and 100 frames (slot 1)."""
    mu, cond = (torch.randn(1, 80, 100, generator=generator) for _ in range(2))
    spks = torch.randn(1, 80, generator=generator)
    bank = PrefixBank(cfm, 2, 100, mu, SOLVE_STEPS, keep_inputs=True)
    for slot, frames in ((0, 50), (1, 100)):
        bank.put(slot, decoder_prefix(cfm, mu, spks, cond, frames, SOLVE_STEPS, keep_inputs=True))
    return bank


def stored_pool(cfm: CFM, bank: PrefixBank, like: Tensor):
    """A pool of random state whose turns hold STORED frames after their prefixes (SLOTS), and
    the rows of a call of LENGTHS new frames committing COMMIT; made the same way every time."""
    pool = TurnStatePool(cfm, 48, like, SOLVE_STEPS)
    generator = torch.Generator().manual_seed(3)
    for stored in pool.inputs + pool.conv_context:
        stored.copy_(torch.randn(stored.shape, generator=generator))
    turns = []
    for slot, frames in zip(SLOTS, STORED):
        turn = None
        if frames:
            prefix = bank.start_frames[slot]
            turn = pool.grow(None, pool.pages_between(prefix, prefix + frames))
            turn.frames = frames
        turns.append(turn)
    ends = [bank.start_frames[slot] + frames + n for slot, frames, n in zip(SLOTS, STORED, LENGTHS)]
    rows, _, served = turn_rows(bank, pool, SLOTS, turns, ends, COMMIT)
    assert all(served)
    return pool, rows


def pool_state(pool: TurnStatePool) -> list[Tensor]:
    """The pool's state outside its scratch pages and slot."""
    pages = [p.view(pool.steps * 2, pool.pages + 1, *p.shape[1:])[:, : pool.scratch] for p in pool.inputs]
    return pages + [c[:, : pool.slot_scratch] for c in pool.conv_context]


def solve_case(cfm: CFM, bank: PrefixBank, inputs: tuple[Tensor, ...], graph_program: bool) -> dict:
    """A paged call, fused and plain, each over a pool of the same state: ``solve_paged``, or
    (``graph_program``) the Euler step a CUDA graph captures, over rows padded to the graph's
    bucket, at a step counter tensor."""
    mu, mask, spks, cond = inputs
    starts = []

    def call() -> list[Tensor]:
        pool, rows = stored_pool(cfm, bank, mu)
        starts.append([t.clone() for t in pool_state(pool)])
        if not graph_program:
            mel = solve_paged(cfm, bank, pool, rows, mu, mask, spks, cond)
        else:
            key = FlowBuckets.up_to(max_batch=4, max_frames=100).key(len(LENGTHS), mu.shape[2], True, paged=True)
            static = pad_inputs(mu, mask, spks, cond, key.batch, key.frames)
            static += pad_turn_rows(rows, pool, key.batch).as_tuple()
            x = mu.new_zeros(key.batch, 80, key.frames)
            step = torch.zeros(1, dtype=torch.long)
            times = cfm.step_times(SOLVE_STEPS, mu.device, mu.dtype)
            start, euler_step = step_program(cfm, key, static, x, step, times, bank, pool)
            start()
            for _ in range(SOLVE_STEPS):
                euler_step()
            mel = x[: len(LENGTHS), :, : mu.shape[2]]
        return [mel, *pool_state(pool)]

    got, expected, ran = fused_and_plain(call, call)
    return {
        "max_abs": max_abs(got, expected),
        "scale": float(expected[0].abs().max()),
        "written": sum(int((after != before).sum()) for after, before in zip(expected[1:], starts[1], strict=True)),
        "launches": ran,
    }


def solve_cases(cases: dict) -> None:
    generator = torch.Generator().manual_seed(1)
    cfm = randomize(CFM(CFMConfig.tiny()), seed=1, spread=0.1)
    with torch.inference_mode():
        bank = voices_bank(cfm, generator)
    inputs = call_inputs(generator)
    with plain_norms():
        cases["solve_paged/conv_input fused"] = solve_case(cfm, bank, inputs, graph_program=False)
        cases["graph step program/conv_input fused"] = solve_case(cfm, bank, inputs, graph_program=True)
    cases["solve_paged/all fused"] = solve_case(cfm, bank, inputs, graph_program=False)


if __name__ == "__main__":
    print_cases(op_cases, solve_cases)
