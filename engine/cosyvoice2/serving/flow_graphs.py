"""CUDA graphs of the flow decoder's ODE solve, for fixed shape buckets.

At small batch the flow estimator is launch-bound: one call issues a few thousand small
kernels, so it costs ~35-40 ms eager on an H200 whatever the batch, and a chunk makes one
per Euler step, 10 with the official step count (measured at full size, bf16: one estimator
call ~4.9 ms under graph replay for 1 stream x 356 frames, 12 ms for 8 streams, 36 ms for
32, 134 ms for 128). A graph here holds one Euler step of ``CFM.solve`` (one estimator call
on the doubled CFG batch and the update of x), and a solve replays it once per step
(``FlowGraphs.steps``, the ``flow_steps`` setting; ``step_program``). The step reads its t
and dt, and after voice prefixes the bank's state, at a step counter on the device that the
graph itself advances. So a launch per step runs a solve, and capturing a shape costs one
step, whatever the step count: with ~180 shapes served, capture is a few seconds of
start-up, not minutes.

Shapes are bucketed (buckets.py): a graph is keyed by (batch bucket, frame bucket,
streaming flag). A call is padded up to its bucket, exactly:

- frames are padded on the right with zeros and mask 0. The estimator never lets a
  real frame see a padding frame: every convolution is causal (left padding), the
  attention masks keys by the mask (chunk-causal or full), and everything else is per
  frame; padding frames' velocity is masked to 0. The starting noise of the real
  frames is the same prefix of the fixed noise tensor either way. So the real frames'
  mel equals the unpadded solve's within float rounding;
- the batch is padded with copies of row 0, not zero rows: a row with no real frame
  takes the "sees every key" attention rule, harmless, but a copy of real data keeps
  every row an ordinary one. Rows are independent; the copies are cut off.

``solve_padded`` is that padded solve run eagerly: the CPU tests (tests/engine/cosyvoice2/serving/test_flow_graphs.py)
prove it equals the unpadded solve, and that ``step_program`` run eagerly equals the
padded solve bit for bit. The graphs run that very computation, captured; that a replay
equals the eager solve is checked only on a GPU, by bench/flow_graphs.py (graph vs eager
error, same dtype) and by the engine at start-up, not by the test suite.

Memory: all graphs share one private memory pool. Their inputs, the ODE state x and the
step counter live in one set of static buffers sized for the largest bucket, outside the
pool and shared by all graphs too. Sharing is safe because solves of one ``FlowGraphs``
never overlap (they run on one worker thread, on one stream; the first-chunk lane has its
own ``FlowGraphs``, see calls.Lane) and nothing stays live in the pool between
replays: the mel is copied out of the shared state buffer right after a solve's last
replay, before any other solve can overwrite it. ``FlowGraphs.reserved_bytes`` is the growth
of ``torch.cuda.memory_reserved`` since construction (pool + static buffers), for the
engine to check against its memory budget.

Graphs after voice prefixes (``GraphKey.after_prefix``) capture the steps of
``prefix_bank.solve_after_prefix`` over one ``PrefixBank``: the rows' bank slots are one more static
input (padded rows copy row 0's slot too), and the bank's tensors are read in place, so
voices may come and go between replays (``PrefixBank.put`` writes in place). ``solve_after_padded`` is its padded
eager twin for the CPU tests.

A graph bakes in the addresses of the weights, of ``CFM.noise`` and of the bank: capture
after the model has its final device and dtype, and do not move them afterwards.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from tts_gateway.engine.cosyvoice2.model.cfm import CFM, N_TIMESTEPS
from tts_gateway.engine.cosyvoice2.serving.buckets import (
    CAPTURE_LOCK, FlowBuckets, GraphKey, bucket_order, capture_after_warm_up, holding_capture_lock, pad_inputs,
    pad_rows,
)
from tts_gateway.engine.cosyvoice2.serving.prefix_bank import PrefixBank, PrefixView, noise_after, solve_after_prefix
from tts_gateway.engine.cosyvoice2.serving.turn_pool import (
    TABLE_PAGES, PagedView, TurnRows, TurnStatePool, pad_turn_rows, paged_noise, solve_paged, turn_rows,
)

log = logging.getLogger(__name__)

# Eager runs of a shape before its capture: they do the libraries' lazy per-shape and
# per-stream set-up (cuBLAS workspaces, kernel selection) outside the graph.
WARMUP_RUNS = 1


def solve_padded(
    cfm: CFM, buckets: FlowBuckets, mu: Tensor, mask: Tensor, spks: Tensor, cond: Tensor, streaming: bool,
    steps: int = N_TIMESTEPS,
) -> Tensor:
    """``cfm(mu, mask, spks, cond, streaming)`` (default noise, ``steps`` Euler steps) computed on
    the inputs padded to their bucket, eagerly; returns the unpadded rows and frames."""
    rows, _, length = mu.shape
    key = buckets.key(rows, length, streaming)
    if not buckets.covers(key):
        raise ValueError(f"{rows} rows x {length} frames is outside the buckets {buckets}")
    padded = pad_inputs(mu, mask, spks, cond, key.batch, key.frames)
    # An explicit noise tensor keeps CFM.forward off its graphs: this is the eager solve.
    return cfm(*padded, streaming, noise=cfm.noise, n_timesteps=steps)[:rows, :, :length]


def solve_after_padded(
    cfm: CFM, buckets: FlowBuckets, bank: PrefixBank, slots: Tensor, mu: Tensor, mask: Tensor, spks: Tensor,
    cond: Tensor,
) -> Tensor:
    """``solve_after_prefix(cfm, bank, slots, ...)`` computed on the inputs padded to their
    bucket (the slots padded as rows: copies of row 0); returns the unpadded rows and frames."""
    rows, _, length = mu.shape
    key = buckets.key(rows, length, True, after_prefix=True)
    if not buckets.covers(key):
        raise ValueError(f"{rows} rows x {length} frames is outside the buckets {buckets}")
    padded = pad_inputs(mu, mask, spks, cond, key.batch, key.frames)
    return solve_after_prefix(cfm, bank, pad_rows(slots, key.batch), *padded)[:rows, :, :length]


def step_program(
    cfm: CFM, key: GraphKey, inputs: tuple[Tensor, ...], x: Tensor, step: Tensor, times: Tensor,
    bank: PrefixBank | None, pool: TurnStatePool | None = None,
) -> tuple[Callable[[], None], Callable[[], None]]:
    """What a solve by graphs of ``key`` runs, over static tensors: ``start`` (eager, before the
    replays: x becomes the solve's starting noise, the step counter 0) and ``euler_step`` (the
    graph: one Euler step at the counter, x updated in place, the counter advanced).

    ``inputs``: mu, mask, spks, cond (and the bank slots after voice prefixes; after stored
    chunks, the ``TurnRows`` over ``pool``) at the key's shape; ``x`` ``[batch, 80, frames]`` in the model's dtype; ``step``: a one-element long
    tensor; ``times``: ``CFM.step_times``. Starting noise and steps are those of ``CFM.forward``
    and ``prefix_bank.solve_after_prefix``, so ``len(times)`` steps after ``start`` leave their mel in x.
    """
    mu, mask, spks, cond = inputs[:4]
    slots = inputs[4] if key.after_prefix else None
    rows = TurnRows(*inputs[4:]) if key.paged else None

    def start() -> None:
        if rows is not None:
            x.copy_(paged_noise(cfm, bank, rows, key.frames))
        elif slots is not None:
            x.copy_(noise_after(cfm, bank, slots, key.frames))
        else:
            x.copy_(cfm.noise[:, :, : key.frames].expand(key.batch, -1, -1))
        step.zero_()

    def euler_step() -> None:
        if rows is not None:
            view = PagedView(bank, pool, rows, mask).at_step(step)
        else:
            view = None if slots is None else PrefixView(bank, slots).at_step(step)
        x.copy_(cfm.euler_step(x, step, times, cfm.cfg_rows(mask, mu, spks, cond), key.streaming, view))
        step.add_(1)

    return start, euler_step


class _CapturedSolve:
    """One graph of an Euler step and the views of the shared static buffers it reads and writes.

    A solve replays it ``steps`` times: the step reads t and dt (and, after voice prefixes,
    the bank's state) at the step counter it then advances, and updates x in place.
    """

    def __init__(
        self, graph: torch.cuda.CUDAGraph, inputs: tuple[Tensor, ...], x: Tensor, start: Callable[[], None],
        steps: int,
    ) -> None:
        self.graph = graph
        self.steps = steps
        self.inputs = inputs  # mu, mask, spks, cond (, slots after a prefix) at the padded shape
        self.x = x  # the ODE state [batch, 80, frames] in the model's dtype: noise in, mel out
        self.start = start  # sets x to the starting noise and the step counter to 0

    def replay(self, padded_inputs: tuple[Tensor, ...]) -> None:
        for static, value in zip(self.inputs, padded_inputs):
            static.copy_(value)
        self.start()
        for _ in range(self.steps):
            self.graph.replay()


class FlowGraphs:
    """CUDA graphs of ``CFM`` solves (default noise, ``steps`` Euler steps) for the shapes of ``buckets``.

    Construct on the model's final device and dtype and ``capture`` ahead of serving. The
    token2wav runner then asks :meth:`run` (or :meth:`run_after_prefix`) first for every flow
    call: a graph is replayed whenever one exists for the call's bucket, and otherwise the
    runner runs the call eagerly; each missing bucket is logged once. With ``capture_missing`` a missing
    bucket inside ``buckets`` is captured on first use instead (a pause of one warm-up
    solve plus one capture, on the serving path).

    Not thread-safe: capture and run from one thread at a time (one token2wav worker thread).
    """

    def __init__(
        self, cfm: CFM, buckets: FlowBuckets, *, capture_missing: bool = False, bank: PrefixBank | None = None,
        pool: TurnStatePool | None = None, priority: int = 0, steps: int = N_TIMESTEPS,
    ) -> None:
        for name, state in (("prefix bank", bank), ("turn-state pool", pool)):
            if state is not None and state.steps != steps:
                raise ValueError(f"graphs of {steps} Euler steps over a {name} of {state.steps}")
        weight = next(cfm.parameters())
        if weight.device.type != "cuda":
            raise ValueError(f"CUDA graphs need the flow on a CUDA device, it is on {weight.device}")
        self.cfm = cfm
        self.steps = steps
        self.buckets = buckets
        self.bank = bank  # what graphs after voice prefixes read (fixed: they bake in its addresses)
        self.pool = pool  # ... and graphs after stored chunks read and write
        self.capture_missing = capture_missing
        self.device = weight.device
        self.dtype = weight.dtype
        self.graphs: dict[GraphKey, _CapturedSolve] = {}
        self.capture_seconds = 0.0
        self._reported_missing: set[GraphKey] = set()
        self._pool = torch.cuda.graph_pool_handle()
        # Warm-up and capture run on this stream: the per-stream library state the
        # warm-up sets up is then the one the capture uses. Captured kernels keep its priority.
        self._stream = torch.cuda.Stream(self.device, priority=priority)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        self._reserved_at_start = torch.cuda.memory_reserved(self.device)
        # Static buffers for the largest bucket; each graph views a prefix of them.
        elements = buckets.max_batch * cfm.config.estimator.out_channels * buckets.max_frame_bucket
        self._static_mu = torch.zeros(elements, device=self.device, dtype=self.dtype)
        self._static_cond = torch.zeros(elements, device=self.device, dtype=self.dtype)
        self._static_x = torch.zeros(elements, device=self.device, dtype=self.dtype)
        self._static_mask = torch.zeros(
            buckets.max_batch * buckets.max_frame_bucket, device=self.device, dtype=self.dtype
        )
        self._static_spks = torch.zeros(
            buckets.max_batch * cfm.config.spk_emb_dim, device=self.device, dtype=self.dtype
        )
        self._static_slots = torch.zeros(buckets.max_batch, device=self.device, dtype=torch.long)
        if pool is not None:  # TurnRows after slots: page table, stored, turn slot, commit
            index = {"device": self.device, "dtype": torch.long}
            self._static_turn_rows = (
                torch.zeros(buckets.max_batch, TABLE_PAGES, **index),
                *(torch.zeros(buckets.max_batch, **index) for _ in range(3)),
            )
        self._step = torch.zeros(1, device=self.device, dtype=torch.long)  # the Euler step a replay runs
        self._times = cfm.step_times(steps, self.device, self.dtype)
        self.reserved_bytes = self._measure_reserved()

    # ------------------------------------------------------------------ capture

    @torch.inference_mode()
    def capture(
        self, batches: Iterable[int], frames: Iterable[int], streaming_flags: Iterable[bool], after_prefix: bool = False,
        max_row_frames: int | None = None, paged: bool = False,
    ) -> None:
        """Captures a graph for every bucket of ``batches`` x ``frames`` x ``streaming_flags``
        (each value rounded up to its bucket) that has none yet; updates ``reserved_bytes``.
        ``after_prefix``: graphs of ``CFM.solve_after`` over the bank (streaming only).
        ``max_row_frames``: only buckets of one row or of at most this many rows x frames;
        ``paged``: graphs after the rows' stored frames in the turn-state pool."""
        if (after_prefix or paged) and self.bank is None:
            raise ValueError("graphs after voice prefixes need the prefix bank")
        if paged and self.pool is None:
            raise ValueError("graphs after stored chunks need the turn-state pool")
        keys = self.buckets.keys(batches, frames, streaming_flags, after_prefix, max_row_frames, paged)
        started = time.perf_counter()
        # Largest first: smaller graphs then fit in the pool blocks the larger ones freed.
        for key in sorted(keys - self.graphs.keys(), key=bucket_order, reverse=True):
            self.graphs[key] = self._capture(key)
        self.capture_seconds += time.perf_counter() - started
        self.reserved_bytes = self._measure_reserved()

    def _static_views(self, key: GraphKey) -> tuple[tuple[Tensor, ...], Tensor]:
        channels = self.cfm.config.estimator.out_channels

        def view(buffer: Tensor, *shape: int) -> Tensor:
            return buffer[: math.prod(shape)].view(*shape)

        inputs = (
            view(self._static_mu, key.batch, channels, key.frames),
            view(self._static_mask, key.batch, 1, key.frames),
            view(self._static_spks, key.batch, self.cfm.config.spk_emb_dim),
            view(self._static_cond, key.batch, channels, key.frames),
        )
        if key.after_prefix:
            inputs += (self._static_slots[: key.batch],)
        if key.paged:
            inputs += tuple(index[: key.batch] for index in self._static_turn_rows)
        return inputs, view(self._static_x, key.batch, channels, key.frames)

    @holding_capture_lock
    def _capture(self, key: GraphKey) -> _CapturedSolve:
        inputs, x = self._static_views(key)
        mu, mask, spks, cond = inputs[:4]
        # Any valid inputs will do: the graph records kernels, not values.
        mu.zero_()
        cond.zero_()
        spks.zero_()
        mask.fill_(1)
        for index in inputs[4:]:  # bank slot 0; in a turn pool, nothing stored, nothing kept
            index.zero_()
        if key.paged:  # ... on the scratch page and slot
            inputs[5].fill_(self.pool.scratch)
            inputs[7].fill_(self.pool.slot_scratch)

        start, euler_step = step_program(self.cfm, key, inputs, x, self._step, self._times, self.bank, self.pool)

        def warm_up() -> None:
            for _ in range(WARMUP_RUNS):
                start()
                euler_step()

        graph, _ = capture_after_warm_up(euler_step, self._stream, self._pool, warm_up)
        return _CapturedSolve(graph, inputs, x, start, self.steps)

    @torch.inference_mode()
    def replay_error(self, key: GraphKey) -> float:
        """Largest |replay - eager solve| of ``key``'s graph on random inputs: a check of the
        capture on the GPU (the CPU tests cannot replay graphs)."""
        generator = torch.Generator(self.device).manual_seed(0)
        channels, batch, frames = self.cfm.config.estimator.out_channels, key.batch, key.frames

        def random(*shape: int) -> Tensor:
            return torch.randn(*shape, generator=generator, device=self.device).to(self.dtype)

        mu, cond = random(batch, channels, frames), random(batch, channels, frames)
        spks = random(batch, self.cfm.config.spk_emb_dim)
        mask = torch.ones(batch, 1, frames, device=self.device, dtype=self.dtype)
        if key.paged:  # new turns in the pool, committing nothing, given back after, not counted
            slots = [b % self.bank.slots for b in range(batch)]
            ends = [self.bank.start_frames[slot] + frames for slot in slots]
            with self.pool.uncounted():
                rows, turns, served = turn_rows(self.bank, self.pool, slots, [None] * batch, ends, [0] * batch)
                try:
                    if not all(served):
                        raise ValueError(f"the turn-state pool has no room to check {key}")
                    replayed = self.run_paged(rows, mu, mask, spks, cond)
                    replayed = replayed and replayed[0]
                    eager = solve_paged(self.cfm, self.bank, self.pool, rows, mu, mask, spks, cond)
                finally:
                    for turn in turns:
                        self.pool.release(turn)
        elif key.after_prefix:
            slots = torch.arange(batch, device=self.device) % self.bank.slots
            replayed = self.run_after_prefix(slots, mu, mask, spks, cond)
            eager = solve_after_prefix(self.cfm, self.bank, slots, mu, mask, spks, cond)
        else:
            replayed = self.run(mu, mask, spks, cond, key.streaming)
            eager = self.cfm(mu, mask, spks, cond, key.streaming, noise=self.cfm.noise, n_timesteps=self.steps)
        if replayed is None:
            raise ValueError(f"no graph for {key}")
        return float((replayed - eager).abs().max())

    def _measure_reserved(self) -> int:
        # Drops the ordinary allocator's cached blocks (warm-up runs) so that what stays
        # reserved beyond the start is the graphs' pool and the static buffers.
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved(self.device) - self._reserved_at_start

    # ------------------------------------------------------------------ serving

    def has(self, rows: int, frames: int, streaming: bool, after_prefix: bool = False) -> bool:
        """Whether a call of this shape would replay a graph (capturing it first, if allowed).
        With a turn-state pool, calls after voice prefixes are paged calls (turns falling back replay
        the graphs after voice prefixes, which start-up captures for the same shapes)."""
        key = self.buckets.key(rows, frames, streaming, after_prefix, after_prefix and self.pool is not None)
        return key in self.graphs or self._capturable(key)

    def _capturable(self, key: GraphKey) -> bool:
        """Whether a missing graph is captured on first use (``capture_missing``)."""
        if not self.buckets.covers(key) or (key.after_prefix and self.bank is None):
            return False
        return self.capture_missing and (not key.paged or self.pool is not None)

    @torch.inference_mode()
    def run(self, mu: Tensor, mask: Tensor, spks: Tensor, cond: Tensor, streaming: bool) -> Tensor | None:
        """The solve by graph replay (float32 ``[B, 80, T]``, a fresh tensor), or None when
        this shape has no graph (the caller then runs it eagerly)."""
        return self._replay(self.buckets.key(mu.shape[0], mu.shape[2], streaming), (mu, mask, spks, cond))

    @torch.inference_mode()
    def run_after_prefix(self, slots: Tensor, mu: Tensor, mask: Tensor, spks: Tensor, cond: Tensor) -> Tensor | None:
        """``CFM.solve_after`` over this object's bank by graph replay, or None as ``run``."""
        key = self.buckets.key(mu.shape[0], mu.shape[2], True, after_prefix=True)
        return self._replay(key, (mu, mask, spks, cond, slots))

    @torch.inference_mode()
    def run_paged(
        self, rows: TurnRows, mu: Tensor, mask: Tensor, spks: Tensor, cond: Tensor
    ) -> tuple[Tensor, int] | None:
        """``solve_paged`` over this object's bank and pool by graph replay, with the row-frames
        the graph computed, or None as ``run``."""
        key = self.buckets.key(mu.shape[0], mu.shape[2], True, paged=True)
        mel = self._replay(key, (mu, mask, spks, cond), rows)
        return None if mel is None else (mel, key.row_frames)

    def _replay(self, key: GraphKey, inputs: tuple[Tensor, ...], rows: TurnRows | None = None) -> Tensor | None:
        mu = inputs[0]
        if mu.dtype != self.dtype or mu.device != self.device:
            raise ValueError(
                f"graphs were captured for {self.dtype} on {self.device}, called with {mu.dtype} on {mu.device}"
            )
        batch, _, length = mu.shape
        captured = self.graphs.get(key)
        if captured is None:
            if self._capturable(key):
                log.info("capturing a flow CUDA graph on first use: %s", key)
                self.capture([key.batch], [key.frames], [key.streaming], key.after_prefix, paged=key.paged)
                captured = self.graphs[key]
            else:
                if key not in self._reported_missing:
                    self._reported_missing.add(key)
                    log.info("no flow CUDA graph for %s (%d rows x %d frames): running eagerly", key, batch, length)
                return None
        padded = pad_inputs(*inputs[:4], key.batch, key.frames) + tuple(pad_rows(x, key.batch) for x in inputs[4:])
        if rows is not None:
            padded += pad_turn_rows(rows, self.pool, key.batch).as_tuple()
        with CAPTURE_LOCK:  # a replay while the other thread captures a graph would fail (buckets.py)
            captured.replay(padded)
        # The state buffer is shared by all graphs: copy it out before any other replay.
        return captured.x[:batch, :, :length].to(torch.float32, copy=True)


