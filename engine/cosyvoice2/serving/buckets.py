"""The shape buckets CUDA graphs are captured for, and padding a call up to its bucket.

A graph replays one fixed shape, so calls are padded up to a small set of shapes:
batch buckets 1, 2, 4, ... and frame buckets of every multiple of a step, coarser for
long contexts. Padding is exact: frames are padded on the right with zeros and mask 0
(every convolution is causal and attention masks keys by the mask, so no real frame sees
a padding frame), and rows with copies of row 0 (rows are independent; the copies are cut
off). flow_graphs.py and hift_graphs.py both use these.
"""

from __future__ import annotations

import bisect
import functools
import math
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import Tensor


# While any thread captures a graph, the CUDA random generator is in capture mode, and a draw
# from another thread fails ("offset increment outside graph capture"). So does any graph's
# replay: every graph registers that generator, and its replay advances it. The first-chunk
# lane and the engine thread both capture on first use and both vocode (the vocoder's source
# draws noise, eagerly or by replay), so captures, vocoder calls and replays take this lock.
CAPTURE_LOCK = threading.RLock()

T = TypeVar("T")


def holding_capture_lock(capture):
    """A graph-capturing method that runs under ``CAPTURE_LOCK``."""

    @functools.wraps(capture)
    def locked(*args, **kwargs):
        with CAPTURE_LOCK:
            return capture(*args, **kwargs)

    return locked


def capture_after_warm_up(
    call: Callable[[], T], stream: torch.cuda.Stream, pool, warm_up: Callable[[], object] | None = None
) -> tuple[torch.cuda.CUDAGraph, T]:
    """A CUDA graph of ``call`` captured on ``stream`` into the memory ``pool``, and what the
    capture returned (the graph's outputs). ``warm_up`` (default: ``call``) runs eagerly on that
    stream first, so that each library's lazy per-shape set-up (cuBLAS workspaces, kernel
    choice) happens outside the graph. ``thread_local``: other threads (the LM stage, the other
    token2wav thread) may use CUDA meanwhile; only this thread's calls must be capture-safe."""
    current = torch.cuda.current_stream(stream.device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        (warm_up or call)()
    current.wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
        outputs = call()
    return graph, outputs


@dataclass(frozen=True)
class GraphKey:
    batch: int  # rows of the padded solve (before CFG doubling)
    frames: int
    streaming: bool
    after_prefix: bool = False  # CFM.solve_after over the bank's voice prefixes (frames: those after them)
    paged: bool = False  # after the rows' stored frames too, in the turn-state pool (turn_pool.py)

    @property
    def row_frames(self) -> int:
        """The rows x frames a replay of this graph computes."""
        return self.batch * self.frames


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, ... (powers of two below ``max_batch``), then ``max_batch``."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    return tuple([2**i for i in range(max_batch.bit_length()) if 2**i < max_batch] + [max_batch])


def pad_rows(x: Tensor, rows: int) -> Tensor:
    """``x`` with copies of its row 0 appended up to ``rows`` rows."""
    if x.shape[0] > rows:
        raise ValueError(f"cannot pad {x.shape[0]} rows down to {rows}")
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x[:1].expand(rows - x.shape[0], *x.shape[1:])])


# Frame buckets are the multiples of frame_step up to this many steps; beyond, the step
# doubles each time the width does. A wide call is then padded by at most ~1/6 of its
# frames, and contexts of a minute need a few more graphs rather than dozens.
FINE_FRAME_STEPS = 12


@dataclass(frozen=True)
class FlowBuckets:
    """The shapes graphs can exist for: batch buckets, and frame buckets of every multiple of
    ``frame_step`` frames up to ``FINE_FRAME_STEPS`` steps, coarser beyond, up to
    ``max_frames`` (rounded up)."""

    batches: tuple[int, ...]
    frame_step: int
    max_frames: int

    def __post_init__(self) -> None:
        if not self.batches or any(b < 1 for b in self.batches) or list(self.batches) != sorted(set(self.batches)):
            raise ValueError(f"batch buckets must be increasing positive integers, got {self.batches}")
        if self.frame_step < 1 or self.max_frames < self.frame_step:
            raise ValueError(f"need 1 <= frame_step <= max_frames, got {self.frame_step}, {self.max_frames}")

    @classmethod
    def up_to(cls, max_batch: int, max_frames: int, frame_step: int = 50) -> FlowBuckets:
        """Batch buckets 1, 2, 4, ... (powers of two below ``max_batch``) and ``max_batch``.

        The default frame step is one attention chunk of the flow (25 tokens = 50 frames).
        """
        return cls(batch_buckets(max_batch), frame_step, max_frames)

    @property
    def max_batch(self) -> int:
        return self.batches[-1]

    @property
    def max_frame_bucket(self) -> int:
        return self._frame_buckets[-1]

    def frame_bucket(self, frames: int) -> int:
        """The bucket of ``frames`` (beyond the largest: a multiple of frame_step, not covered)."""
        buckets = self._frame_buckets
        if frames > buckets[-1]:
            return math.ceil(frames / self.frame_step) * self.frame_step
        return buckets[bisect.bisect_left(buckets, frames)]

    def frame_buckets(self) -> list[int]:
        """Every frame bucket, shortest first."""
        return list(self._frame_buckets)

    @functools.cached_property
    def _frame_buckets(self) -> tuple[int, ...]:
        buckets = [self.frame_step]
        while buckets[-1] < self.max_frames:
            step = self.frame_step
            while buckets[-1] >= FINE_FRAME_STEPS * step:
                step *= 2
            buckets.append(buckets[-1] + step)
        return tuple(buckets)

    def key(
        self, batch: int, frames: int, streaming: bool, after_prefix: bool = False, paged: bool = False
    ) -> GraphKey:
        """The bucket a call of this shape pads to; outside ``covers`` when it is too large.
        ``paged``: a call after the rows' stored frames too (turn_pool.py)."""
        batch_bucket = next((b for b in self.batches if b >= batch), batch)
        return GraphKey(batch_bucket, self.frame_bucket(frames), streaming, after_prefix or paged, paged)

    def covers(self, key: GraphKey) -> bool:
        return key.batch in self.batches and key.frames <= self.max_frame_bucket

    def keys(
        self, batches: Iterable[int], frames: Iterable[int], streaming_flags: Iterable[bool], after_prefix: bool = False,
        max_row_frames: int | None = None, paged: bool = False,
    ) -> set[GraphKey]:
        """The buckets of ``batches`` x ``frames`` x ``streaming_flags`` (``paged``: of calls after
        stored frames); with ``max_row_frames`` only those of one row or of at most that many
        rows x frames. Raises ValueError for shapes outside the buckets."""
        keys = {
            self.key(b, f, s, after_prefix, paged) for b in batches for f in frames for s in streaming_flags
        }
        if max_row_frames is not None:
            keys = {key for key in keys if key.batch == 1 or key.row_frames <= max_row_frames}
        if after_prefix and not all(key.streaming for key in keys):
            raise ValueError("a solve after voice prefixes is a streaming solve")
        outside = [key for key in keys if not self.covers(key)]
        if outside:
            raise ValueError(f"shapes outside the buckets {self}: {sorted(outside, key=bucket_order)}")
        return keys


def pad_inputs(
    mu: Tensor, mask: Tensor, spks: Tensor, cond: Tensor, batch: int, frames: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``CFM.forward`` inputs padded to ``batch`` rows and ``frames`` frames.

    Frames: zeros on the right, mask 0. Rows: copies of row 0.
    """
    rows, _, length = mu.shape
    if rows > batch or length > frames:
        raise ValueError(f"cannot pad {rows} rows x {length} frames down to {batch} x {frames}")

    def padded(x: Tensor) -> Tensor:
        if x.dim() == 3:
            x = torch.nn.functional.pad(x, (0, frames - length))
        return pad_rows(x, batch)

    return padded(mu), padded(mask), padded(spks), padded(cond)


def bucket_order(key: GraphKey) -> tuple[int, int, bool, bool, int]:
    return key.batch, key.frames, key.streaming, key.after_prefix, key.paged
