"""Shape bucketing of the flow solve for CUDA graphs (engine/cosyvoice2/serving/flow_graphs.py), on CPU.

These tests prove that padding a solve to its bucket is exact (the padded eager solve
equals the unpadded one), that the program a graph captures (one Euler step at a device
step counter, replayed once per step) computes the eager solve bit for bit, and that the
captured region has no host reads. They do not run CUDA graphs: that a graph replay equals
the eager solve is checked on a GPU by bench/flow_graphs.py, whose CPU path (no graphs) is
smoke-tested in tests/bench/test_benches.py, and by the gateway at start-up.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from tts_gateway.engine.cosyvoice2.model.cfm import CFM, N_TIMESTEPS
from tts_gateway.engine.cosyvoice2.serving.prefix_bank import PrefixBank, decoder_prefix, solve_after_prefix
from tts_gateway.engine.cosyvoice2.modeldir.configs import CFMConfig
from tts_gateway.engine.cosyvoice2.serving.buckets import FlowBuckets, GraphKey, pad_inputs, pad_rows
from tts_gateway.engine.cosyvoice2.serving.flow_graphs import FlowGraphs, _CapturedSolve, solve_after_padded, solve_padded, step_program
from tts_gateway.engine.cosyvoice2.serving.turn_pool import (
    TABLE_PAGES, TurnRows, TurnState, TurnStatePool, pad_turn_rows, solve_paged, turn_rows,
)
from tests.engine.cosyvoice2.flow_pairs import STEPS
from tests.reference import randomize

LENGTHS = [110, 57, 81]  # 3 rows -> batch bucket 4; 110 frames -> frame bucket 150
PROMPTS = [36, 20, 0]


@pytest.fixture(scope="module")
def cfm() -> CFM:
    return randomize(CFM(CFMConfig.tiny()), seed=1, spread=0.1)


def batch_inputs(lengths: list[int], prompts: list[int], seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """mu, mask, spks, cond of rows with different lengths, zero-padded to the longest (as Flow builds them)."""
    generator = torch.Generator().manual_seed(seed)
    longest = max(lengths)
    mask = (torch.arange(longest) < torch.tensor(lengths)[:, None])[:, None, :].float()
    mu = torch.randn(len(lengths), 80, longest, generator=generator) * mask
    cond = torch.zeros(len(lengths), 80, longest)
    for row, prompt in enumerate(prompts):
        cond[row, :, :prompt] = torch.randn(80, prompt, generator=generator)
    spks = torch.randn(len(lengths), 80, generator=generator)
    return mu, mask, spks, cond


def max_err(a: Tensor, b: Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def test_flow_buckets() -> None:
    buckets = FlowBuckets.up_to(max_batch=24, max_frames=420, frame_step=50)
    assert buckets.batches == (1, 2, 4, 8, 16, 24)
    assert FlowBuckets.up_to(max_batch=16, max_frames=50).batches == (1, 2, 4, 8, 16)
    assert buckets.max_frame_bucket == 450
    assert buckets.frame_buckets() == [50, 100, 150, 200, 250, 300, 350, 400, 450]
    assert buckets.key(3, 110, True) == GraphKey(4, 150, True)
    assert buckets.key(1, 50, False) == GraphKey(1, 50, False)
    assert buckets.key(17, 1, True) == GraphKey(24, 50, True)
    assert buckets.covers(buckets.key(24, 450, True))
    assert not buckets.covers(buckets.key(25, 100, True))  # more rows than the largest bucket
    assert not buckets.covers(buckets.key(8, 451, True))  # longer than the largest frame bucket
    with pytest.raises(ValueError):
        FlowBuckets((1, 4, 2), 50, 100)


def test_wide_frame_buckets_are_coarser() -> None:
    """Every frame_step up to 12 steps; beyond, the step doubles as the width does, so a
    wide call pads by at most ~1/6 of its frames."""
    buckets = FlowBuckets.up_to(max_batch=64, max_frames=3000, frame_step=100)
    assert buckets.frame_buckets() == [*range(100, 1300, 100), 1400, 1600, 1800, 2000, 2200, 2400, 2800, 3200]
    assert buckets.max_frame_bucket == 3200
    assert buckets.key(1, 1201, True).frames == 1400 and buckets.key(1, 2401, True).frames == 2800
    assert buckets.covers(buckets.key(1, 3200, True)) and not buckets.covers(buckets.key(1, 3201, True))
    for frames in range(1, 3201):
        bucket = buckets.frame_bucket(frames)
        assert frames <= bucket and (bucket - frames) <= max(100, bucket / 6), frames


def test_graph_keys_within_a_row_frame_budget() -> None:
    buckets = FlowBuckets.up_to(max_batch=64, max_frames=3000, frame_step=100)
    keys = buckets.keys(buckets.batches, buckets.frame_buckets(), [True], max_row_frames=13000)
    assert all(key.batch == 1 or key.batch * key.frames <= 13000 for key in keys)
    assert {key.batch for key in keys if key.frames == 100} == {1, 2, 4, 8, 16, 32, 64}
    assert {key.batch for key in keys if key.frames == 3200} == {1, 2, 4}
    assert len(keys) == 88
    assert len(buckets.keys(buckets.batches, buckets.frame_buckets(), [True])) == 7 * 20
    with pytest.raises(ValueError):
        buckets.keys([128], [100], [True])  # more rows than the largest batch bucket


def test_pad_inputs_repeats_a_real_row_and_masks_padding_frames() -> None:
    mu, mask, spks, cond = batch_inputs(LENGTHS, PROMPTS, seed=2)
    padded = pad_inputs(mu, mask, spks, cond, batch=5, frames=150)
    assert [tuple(t.shape) for t in padded] == [(5, 80, 150), (5, 1, 150), (5, 80), (5, 80, 150)]
    for original, extended in zip((mu, mask, spks, cond), padded):
        if original.dim() == 3:
            assert torch.equal(extended[:3, :, :110], original)
            assert not extended[:3, :, 110:].any()  # padding frames: zeros, mask 0
            assert torch.equal(extended[3:, :, :110], original[:1].expand(2, -1, -1))
        else:
            assert torch.equal(extended[:3], original)
            assert torch.equal(extended[3:], original[:1].expand(2, -1))
    with pytest.raises(ValueError):
        pad_inputs(mu, mask, spks, cond, batch=2, frames=150)


@pytest.mark.parametrize("streaming", [True, False])
def test_padded_solve_equals_unpadded(cfm, streaming) -> None:
    """The solve padded to its bucket (4 rows x 150 frames) equals the unpadded batched solve
    and each row solved alone (float32, max abs diff <= 1e-5; mel values up to ~5)."""
    mu, mask, spks, cond = batch_inputs(LENGTHS, PROMPTS, seed=3)
    buckets = FlowBuckets.up_to(max_batch=8, max_frames=300)
    with torch.inference_mode():
        padded = solve_padded(cfm, buckets, mu, mask, spks, cond, streaming)
        unpadded = cfm(mu, mask, spks, cond, streaming)
        assert unpadded.abs().max() > 1.0  # not a degenerate comparison
        assert max_err(padded, unpadded) <= 1e-5
        for row, length in enumerate(LENGTHS):
            alone = cfm(mu[row : row + 1, :, :length], mask[row : row + 1, :, :length], spks[row : row + 1],
                        cond[row : row + 1, :, :length], streaming)
            assert max_err(padded[row : row + 1, :, :length], alone) <= 1e-5, row


@pytest.mark.parametrize("streaming", [True, False])
def test_real_frames_do_not_see_padding_frames(cfm, streaming) -> None:
    """Padding frames (mask 0) may hold anything: the real frames' mel does not change.

    Stronger than zero padding: causal convolutions, key-masked attention and per-frame
    layers keep every real frame independent of the frames after a row's end.
    """
    mu, mask, spks, cond = batch_inputs([57], [20], seed=4)
    generator = torch.Generator().manual_seed(5)
    frames = 150
    junk_mu, junk_cond = (10 * torch.randn(1, 80, frames, generator=generator) for _ in range(2))
    junk_mu[:, :, :57], junk_cond[:, :, :57] = mu, cond
    padded_mask = torch.nn.functional.pad(mask, (0, frames - 57))
    with torch.inference_mode():
        clean = cfm(mu, mask, spks, cond, streaming)
        with_junk = cfm(junk_mu, padded_mask, spks, junk_cond, streaming)
    assert max_err(with_junk[:, :, :57], clean) <= 1e-5


def test_cfm_solve_runs_without_host_sync() -> None:
    """The region a graph captures (CFM.forward with the default noise: time grid, 10 Euler
    steps, CFG, masks) runs on the meta device, so it reads no tensor data on the host
    (no .item(), .tolist(), nonzero or data-dependent shapes)."""
    cfm = CFM(CFMConfig.tiny()).to("meta").eval()
    mu, cond = torch.zeros(4, 80, 150, device="meta"), torch.zeros(4, 80, 150, device="meta")
    for streaming in (True, False):
        mel = cfm(mu, torch.ones(4, 1, 150, device="meta"), torch.zeros(4, 80, device="meta"), cond, streaming,
                  noise=cfm.noise)
        assert mel.shape == (4, 80, 150) and mel.dtype == torch.float32


def solve_by_steps(
    cfm: CFM, key: GraphKey, inputs: tuple[Tensor, ...], bank: PrefixBank | None = None,
    pool: TurnStatePool | None = None, steps: int = N_TIMESTEPS,
) -> Tensor:
    """A solve as the graphs of ``key`` run it, eagerly: ``start``, then the Euler step
    ``steps`` times, all on static tensors; returns x (the mel, in the model's dtype)."""
    mu = inputs[0]
    x = mu.new_zeros(key.batch, 80, key.frames)
    step = torch.zeros(1, dtype=torch.long, device=mu.device)
    times = cfm.step_times(steps, mu.device, mu.dtype)
    start, euler_step = step_program(cfm, key, inputs, x, step, times, bank, pool)
    start()
    for _ in range(steps):
        euler_step()
    return x


def prefix_bank(cfm: CFM, like: Tensor, steps: int = N_TIMESTEPS) -> PrefixBank:
    """A bank of 3 slots, 150 frames, for ``steps`` Euler steps: the first voice of ``like``'s rows
    (100 frames) in slot 2 and the second (50 frames) in slot 0; slot 1 empty."""
    mu, _, spks, cond = batch_inputs([200, 200], [200, 200], seed=6)
    mu, spks, cond = mu.to(like), spks.to(like), cond.to(like)
    bank = PrefixBank(cfm, 3, 150, mu, steps, keep_inputs=True)
    bank.put(2, decoder_prefix(cfm, mu[:1], spks[:1], cond[:1], 100, steps, keep_inputs=True))
    bank.put(0, decoder_prefix(cfm, mu[1:], spks[1:], cond[1:], 50, steps, keep_inputs=True))
    return bank


@pytest.mark.parametrize("steps", STEPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("streaming", [True, False, "after_prefix"])
def test_step_program_is_the_eager_solve(cfm, streaming, dtype, steps) -> None:
    """The Euler step a graph captures, run once per step from ``start`` with the step read
    from a device counter, gives the padded eager solve bit for bit (streaming, full
    attention, and after voice prefixes; float32 and bfloat16; the official and another
    number of steps)."""
    model = CFM(CFMConfig.tiny())
    model.load_state_dict(cfm.state_dict())
    model = model.to(dtype)
    mu, mask, spks, cond = (t.to(dtype) for t in batch_inputs(LENGTHS, PROMPTS, seed=8))
    buckets = FlowBuckets.up_to(max_batch=8, max_frames=300)
    after_prefix = streaming == "after_prefix"
    key = buckets.key(len(LENGTHS), mu.shape[2], streaming is not False, after_prefix)
    with torch.inference_mode():
        if after_prefix:
            bank = prefix_bank(model, mu, steps)
            slots = torch.tensor([2, 0, 2])
            eager = solve_after_padded(model, buckets, bank, slots, mu, mask, spks, cond)
            inputs = pad_inputs(mu, mask, spks, cond, key.batch, key.frames) + (pad_rows(slots, key.batch),)
        else:
            bank = None
            eager = solve_padded(model, buckets, mu, mask, spks, cond, streaming, steps)
            inputs = pad_inputs(mu, mask, spks, cond, key.batch, key.frames)
        stepped = solve_by_steps(model, key, inputs, bank, steps=steps)
    assert eager.abs().max() > 1.0
    assert torch.equal(stepped[: len(LENGTHS), :, : mu.shape[2]].float(), eager)


def stored_turns(pool: TurnStatePool, bank: PrefixBank, mu: Tensor) -> tuple[TurnRows, list[TurnState]]:
    """The rows of a paged call of ``mu``'s rows (LENGTHS new frames) over ``bank`` (prefix_bank):
    voices in slots 2, 0, 2 (prefixes of 100 and 50 frames, the first ending inside a page),
    turns holding 100, 50 and no committed frames, committing 100, 0 and 50 more. Made the
    same way in any pool of the same size."""
    slots, stored, commit = [2, 0, 2], [100, 50, 0], [100, 0, 50]
    turns: list[TurnState | None] = []
    for slot, frames in zip(slots, stored):
        turn = None
        if frames:  # its pages from the one the prefix ends in, through its committed frames
            prefix = int(bank.start[slot])
            turn = pool.grow(None, -(-(prefix + frames) // pool.page_frames) - prefix // pool.page_frames)
            turn.frames = frames
        turns.append(turn)
    ends = [int(bank.start[slot]) + frames + n for slot, frames, n in zip(slots, stored, LENGTHS)]
    rows, turns, served = turn_rows(bank, pool, slots, turns, ends, commit)
    assert all(served)
    return rows, turns


def same_random_state(pools: list[TurnStatePool]) -> None:
    generator = torch.Generator().manual_seed(3)
    for pool in pools:
        for stored, first in zip(pool.inputs + pool.conv_context, pools[0].inputs + pools[0].conv_context):
            stored.copy_(torch.randn(stored.shape, generator=generator) if pool is pools[0] else first)


def real_pages(pool: TurnStatePool, stored: Tensor) -> Tensor:
    """A pool tensor without its scratch pages (one per Euler step and CFG row)."""
    logical = stored.view(pool.steps * 2, pool.pages + 1, *stored.shape[1:])
    return logical[:, : pool.scratch]


@pytest.mark.parametrize("steps", STEPS)
def test_padded_solve_after_stored_frames_is_the_eager_one(cfm, steps) -> None:
    """A call after stored frames as its graph runs it (padded: rows copying row 0's prefix but
    reading and writing only the scratch page and slot), run eagerly from ``start`` step by
    step, gives the unpadded eager solve's mel and leaves the same pages and conv contexts,
    and no call writes a voice prefix's pages (the official and another number of Euler steps)."""
    mu, mask, spks, cond = batch_inputs(LENGTHS, PROMPTS, seed=9)
    bank = prefix_bank(cfm, mu, steps)
    pools = [TurnStatePool(cfm, 64, mu, steps) for _ in range(2)]
    same_random_state(pools)
    buckets = FlowBuckets.up_to(max_batch=8, max_frames=300)
    key = buckets.key(len(LENGTHS), mu.shape[2], True, paged=True)
    with torch.inference_mode():
        rows, _ = stored_turns(pools[0], bank, mu)
        prefixes = [pools[0].prefix_pages(bank, slot) for slot in (0, 2)]
        before = real_pages(pools[0], pools[0].inputs[0]).clone()
        eager = solve_paged(cfm, bank, pools[0], rows, mu, mask, spks, cond)
        inputs = pad_inputs(mu, mask, spks, cond, key.batch, key.frames)
        padded_rows = pad_turn_rows(stored_turns(pools[1], bank, mu)[0], pools[1], key.batch)
        stepped = solve_by_steps(cfm, key, inputs + padded_rows.as_tuple(), bank, pools[1], steps)
    assert eager.abs().max() > 1.0
    assert (stepped[: len(LENGTHS), :, : mu.shape[2]] - eager).abs().max() <= 1e-5
    for ours, theirs in zip(pools[0].inputs, pools[1].inputs):
        assert (real_pages(pools[0], ours) - real_pages(pools[1], theirs)).abs().max() <= 1e-5
    for ours, theirs in zip(pools[0].conv_context, pools[1].conv_context):
        assert (ours[:, :-1] - theirs[:, :-1]).abs().max() <= 1e-5  # the scratch slot aside
    after = real_pages(pools[0], pools[0].inputs[0])
    for pages in prefixes:
        assert torch.equal(after[:, pages], before[:, pages])
    assert not torch.equal(after, before)


def test_step_program_runs_without_host_sync() -> None:
    """The Euler step a graph captures (the step counter read on the device, the bank's state
    at that step) runs on the meta device: it reads no tensor data on the host."""
    cfm = CFM(CFMConfig.tiny()).to("meta").eval()
    mu = torch.zeros(4, 80, 150, device="meta")
    bank = PrefixBank(cfm, 2, 100, mu)
    # The paged kernel is a GPU library's: a stand-in of its shape here.
    pool = TurnStatePool(cfm, 4, mu, attend=lambda query, keys, values, plan, scale: torch.empty_like(query))
    slots = torch.zeros(4, dtype=torch.long, device="meta")
    rows = TurnRows(slots, torch.zeros(4, TABLE_PAGES, dtype=torch.long, device="meta"), slots, slots, slots)
    inputs = (mu, torch.ones(4, 1, 150, device="meta"), torch.zeros(4, 80, device="meta"), mu)
    for key, extra, program_bank in (
        (GraphKey(4, 150, True), (), None),
        (GraphKey(4, 150, False), (), None),
        (GraphKey(4, 150, True, after_prefix=True), (slots,), bank),
        (GraphKey(4, 150, True, after_prefix=True, paged=True), rows.as_tuple(), bank),
    ):
        x = solve_by_steps(cfm, key, inputs + extra, program_bank, pool)
        assert x.shape == (4, 80, 150)


def test_padded_solve_after_voice_prefixes_equals_unpadded(cfm) -> None:
    """A solve that starts after voice prefixes, padded to its bucket (rows as copies of row 0,
    slot included), equals the unpadded one and each row alone; rows of two voices whose
    prefixes (100 and 50 frames) sit in a wider bank (150 frames, one slot empty)."""
    mu, _, spks, cond = batch_inputs([200, 200], [200, 200], seed=6)  # the voices of prefix_bank
    with torch.inference_mode():
        bank = prefix_bank(cfm, mu)
    rows = [(2, 57), (0, 81), (2, 30)]  # (slot, frames after its prefix)
    voice_of_slot, start_of_slot = {2: 0, 0: 1}, {2: 100, 0: 50}
    new_mu, mask, _, new_cond = batch_inputs([n for _, n in rows], [0, 0, 0], seed=7)
    for row, (slot, n) in enumerate(rows):  # the voices' own conditioning after the prefix
        start = start_of_slot[slot]
        new_mu[row, :, :n] = mu[voice_of_slot[slot], :, start : start + n]
        new_cond[row, :, :n] = cond[voice_of_slot[slot], :, start : start + n]
    row_spks = spks[[voice_of_slot[slot] for slot, _ in rows]]
    slots = torch.tensor([slot for slot, _ in rows])
    buckets = FlowBuckets.up_to(max_batch=8, max_frames=300)
    with torch.inference_mode():
        padded = solve_after_padded(cfm, buckets, bank, slots, new_mu, mask, row_spks, new_cond)
        unpadded = solve_after_prefix(cfm, bank, slots, new_mu, mask, row_spks, new_cond)
        assert unpadded.abs().max() > 1.0
        assert max_err(padded, unpadded) <= 1e-5
        for row, (slot, n) in enumerate(rows):
            alone = solve_after_prefix(cfm, bank, slots[row : row + 1], new_mu[row : row + 1, :, :n],
                                       mask[row : row + 1, :, :n], row_spks[row : row + 1], new_cond[row : row + 1, :, :n])
            assert max_err(padded[row : row + 1, :, :n], alone) <= 1e-5, row
            # ... and the same frames of the whole streaming solve of the voice
            v, start = voice_of_slot[slot], start_of_slot[slot]
            whole = cfm(mu[v : v + 1, :, : start + n], torch.ones(1, 1, start + n), spks[v : v + 1],
                        cond[v : v + 1, :, : start + n], True)
            assert max_err(padded[row : row + 1, :, :n], whole[:, :, start:]) <= 1e-4, row


def test_solve_after_voice_prefixes_runs_without_host_sync() -> None:
    """The region a graph after voice prefixes captures runs on the meta device (see above)."""
    cfm = CFM(CFMConfig.tiny()).to("meta").eval()
    mu = torch.zeros(3, 80, 150, device="meta")
    bank = PrefixBank(cfm, 2, 100, mu)
    slots = torch.zeros(3, dtype=torch.long, device="meta")
    mel = solve_after_prefix(cfm, bank, slots, mu, torch.ones(3, 1, 150, device="meta"),
                             torch.zeros(3, 80, device="meta"), mu)
    assert mel.shape == (3, 80, 150) and mel.dtype == torch.float32


class _EulerStepAsGraph:
    """Stands in for a captured graph on CPU: a replay runs the captured Euler step eagerly."""

    def __init__(self, euler_step) -> None:
        self.replay = euler_step


@pytest.mark.parametrize("steps", STEPS)
def test_run_paged_replays_with_its_rows_padded_to_the_graph(cfm, steps) -> None:
    """``FlowGraphs.run_paged`` fills a graph's static inputs (the padded call and its turn's
    rows in the order the graph reads them), replays it once per Euler step and returns the
    real rows' mel and the row-frames the graph computed: with the graph run eagerly, it equals
    the eager call (the official and another number of steps), and the start-up check
    ``replay_error`` runs."""
    mu, mask, spks, cond = batch_inputs(LENGTHS, PROMPTS, seed=9)
    bank = prefix_bank(cfm, mu, steps)
    pools = [TurnStatePool(cfm, 128, mu, steps) for _ in range(2)]
    same_random_state(pools)
    buckets = FlowBuckets.up_to(max_batch=8, max_frames=300)
    key = buckets.key(len(LENGTHS), mu.shape[2], True, paged=True)
    graphs = object.__new__(FlowGraphs)  # its CUDA parts aside
    graphs.cfm, graphs.buckets, graphs.bank, graphs.pool = cfm, buckets, bank, pools[1]
    graphs.device, graphs.dtype, graphs.capture_missing = mu.device, mu.dtype, False
    with torch.inference_mode():
        rows, _ = stored_turns(pools[1], bank, mu)
        static = pad_inputs(mu, mask, spks, cond, key.batch, key.frames)
        static += pad_turn_rows(rows, pools[1], key.batch).as_tuple()
        static = tuple(torch.zeros_like(t) for t in static)
        x = mu.new_zeros(key.batch, 80, key.frames)
        step = torch.zeros(1, dtype=torch.long)
        times = cfm.step_times(steps, mu.device, mu.dtype)
        start, euler_step = step_program(cfm, key, static, x, step, times, bank, pools[1])
        graphs.graphs = {key: _CapturedSolve(_EulerStepAsGraph(euler_step), static, x, start, steps)}
        replayed, row_frames = graphs.run_paged(rows, mu, mask, spks, cond)
        eager = solve_paged(cfm, bank, pools[0], stored_turns(pools[0], bank, mu)[0], mu, mask, spks, cond)
    assert row_frames == key.row_frames
    assert eager.abs().max() > 1.0
    assert (replayed - eager).abs().max() <= 1e-5
    # The start-up check of such a graph (new turns, committing nothing, given back) runs too.
    in_use, totals = pools[1].pages_in_use, pools[1].totals()
    assert graphs.replay_error(key) <= 1e-5
    assert pools[1].pages_in_use == in_use and pools[1].totals() == totals


def test_graphs_are_laid_out_for_the_steps_of_the_state_they_read(cfm) -> None:
    """Graphs replay their Euler step once per step and read the bank's and the pool's state at
    each: state laid out for another step count is refused before anything is captured."""
    like = next(cfm.parameters())
    buckets = FlowBuckets.up_to(max_batch=1, max_frames=50)
    with pytest.raises(ValueError, match="graphs of 10 Euler steps over a prefix bank of 4"):
        FlowGraphs(cfm, buckets, bank=PrefixBank(cfm, 1, 50, like, steps=4))
    with pytest.raises(ValueError, match="graphs of 4 Euler steps over a turn-state pool of 10"):
        FlowGraphs(cfm, buckets, pool=TurnStatePool(cfm, 1, like), steps=4)
