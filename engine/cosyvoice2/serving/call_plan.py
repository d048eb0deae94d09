"""Call planning: which of a batch's chunks share one flow call, and in what order calls run.

Rows of one flow call are padded to its widest context, and a call runs to its end while
whatever became urgent meanwhile waits. So a batch is split by kind (a new turn's first
chunks never wait for a long turn's call) and each kind into the calls that cost least in
all, by a cost model measured on the H200 (docs/cosyvoice2.md).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tts_gateway.engine.cosyvoice2.serving.chunking import ChunkJob, ChunkSchedule

if TYPE_CHECKING:
    from tts_gateway.engine.cosyvoice2.serving.flow_graphs import FlowGraphs

# A flow call's cost, in row-frames (rows x context frames: what its compute grows with).
# Measured on the H200 (full size, bf16; docs/cosyvoice2.md): a solve costs ~0.028 ms per
# row-frame, plus ~39 ms per call under a CUDA graph (~1400 row-frames). Run eagerly, the
# kernel launches of its 10 estimator calls take ~375 ms whatever its size (~13 000
# row-frames): the GPU waits on the CPU, and a smaller eager call saves nothing.
CALL_ROW_FRAMES = 1400
EAGER_FLOOR_ROW_FRAMES = 13000
# A call runs to its end, and whatever becomes urgent meanwhile (a new turn's first chunk)
# waits for it: a call of several rows is held to about an eager call's launch floor of
# work (~0.4 s), so eager calls, which cost that anyway, are not split for it.
MAX_CALL_ROW_FRAMES = EAGER_FLOOR_ROW_FRAMES
# Rows of one flow call are padded to its longest context; the scheduler keeps a much
# longer, not yet due context out of a batch whose padding it would raise by more than this.
PADDING_LIMIT = 1.25


def cheapest_groups(widths: list[int], cost: Callable[[int, int], float]) -> list[list[int]]:
    """Indices of rows of these context widths split into calls, narrowest call first, so
    that the calls' total ``cost(rows, widest row)`` is the least possible.

    Rows are padded to their call's widest, so the best split takes runs of the rows
    sorted by width: an exact dynamic programme over the cut points (quadratic in rows).
    """
    order = sorted(range(len(widths)), key=widths.__getitem__)
    best = [0] * (len(order) + 1)  # best[j]: the cheapest split of the j narrowest rows
    cut = [0] * (len(order) + 1)  # ... whose last call starts at row cut[j]
    for j in range(1, len(order) + 1):
        width = widths[order[j - 1]]
        best[j], cut[j] = min((best[i] + cost(j - i, width), i) for i in range(j))
    groups: list[list[int]] = []
    j = len(order)
    while j:
        groups.append(order[cut[j] : j])
        j = cut[j]
    return groups[::-1]


@dataclass(frozen=True)
class CallPlanner:
    """Plans a batch's flow calls. ``on_gpu``: calls have a launch floor and may replay CUDA
    graphs (on a CPU neither); ``final_streaming``: last chunks are chunk-causal too;
    ``later_with_first``: later chunks no wider than the batch's first chunks may share their
    calls (see ``plan``)."""

    schedule: ChunkSchedule
    on_gpu: bool
    final_streaming: bool = False
    later_with_first: bool = False

    def plan(
        self, jobs: list[ChunkJob], graphs: FlowGraphs | None, prefix: int | None,
        stored: Callable[[ChunkJob], int] | None = None,
    ) -> list[list[int]]:
        """Indices of ``jobs`` in flow calls, in the order to run them.

        Non-final recompute chunks and final chunks go in separate calls (a call of the
        recompute path has one ``finalize``), and so do first chunks (no audio out yet) and
        later ones: a new turn's first chunk must not wait for a long turn's call, which a
        single row's padding would otherwise often make the cheaper choice. After stored frames
        (``stored``) with chunk-causal last chunks, a last chunk is one more row of the later
        chunks' call: a paged call takes ``finalize`` per row, and one call costs less than two.
        Each such kind is split into the calls that cost least in all (see ``cheapest_groups``),
        none of several rows above ``MAX_CALL_ROW_FRAMES``. With ``later_with_first``, a later
        chunk no wider than the batch's widest first chunk is of the first chunks' kind: it
        raises no first chunk's padding, and in a burst of new turns the second chunks of the
        turns served first need not wait behind the rest of the burst's first-chunk calls.
        Calls of first chunks run first, then the rest, narrowest first; incremental chunks,
        which run one by one, go together. ``graphs``: the flow graphs the calls would replay;
        ``prefix``: the frames a call after the voice prefixes starts at least (None: none);
        ``stored``: a job's decoder frames stored beyond its voice prefix (turn_pool.py), which
        its call does not compute either.
        """
        def job_frames(job: ChunkJob) -> int:
            return self.schedule.job_frames(job) - (stored(job) if stored is not None else 0)

        def cost_frames(job: ChunkJob, finalize: bool) -> int:
            """``job_frames`` as the cost of a call of that ``finalize`` counts them (``call_cost``
            takes a later chunk's look-ahead frames off: a last chunk in such a call has none)."""
            return job_frames(job) + (self.lookahead_frames if job.finalize and not finalize else 0)

        last_with_later = stored is not None and self.final_streaming
        call_finalize = {i: job.finalize and not last_with_later for i, job in enumerate(jobs)}
        incremental = [
            i for i, job in enumerate(jobs)
            if self.streaming(job.finalize) and job.request.stream.flow_cache is not None
        ]
        # A later chunk no wider than the first chunks of a call of its finalize adds rows to
        # their call, not width: it costs that call a little and saves a call of its own.
        first_width = {
            finalize: max(
                (cost_frames(job, finalize) for i, job in enumerate(jobs)
                 if job.first and call_finalize[i] == finalize and i not in incremental),
                default=-1,
            )
            for finalize in (False, True)
        }
        kinds: dict[tuple[bool, bool], list[int]] = {}
        for i, job in enumerate(jobs):
            if i in incremental:
                continue
            finalize = call_finalize[i]
            with_first = job.first or (self.later_with_first and cost_frames(job, finalize) <= first_width[finalize])
            kinds.setdefault((finalize, with_first), []).append(i)
        groups = [incremental] if incremental else []

        for (finalize, _), rows in kinds.items():
            widths = [cost_frames(jobs[i], finalize) for i in rows]
            cost = functools.partial(self.call_cost, finalize=finalize, prefix=prefix, graphs=graphs)
            groups += [[rows[k] for k in group] for group in cheapest_groups(widths, cost)]
        return sorted(groups, key=lambda group: (
            not any(jobs[i].first for i in group), max(job_frames(jobs[i]) for i in group)
        ))

    def call_cost(
        self, rows: int, frames: int, finalize: bool, prefix: int | None, graphs: FlowGraphs | None
    ) -> float:
        """A flow call's cost in row-frames (see ``CALL_ROW_FRAMES``) for ``rows`` contexts of
        up to ``frames``, infinite for a call of several rows above ``MAX_CALL_ROW_FRAMES``;
        ``prefix``: the frames a call after the voice prefixes starts at (None: none);
        ``graphs``: the flow graphs the call would replay. A graph computes its bucket's rows
        and frames: on a GPU that padding is work too (batch buckets 1, 2, 4, 8, ... pad five
        rows to eight), so a call that replays one costs its bucket's row-frames."""
        width = self.decoder_width(frames, finalize)
        streaming = self.streaming(finalize)
        whole = self.replayed_row_frames(graphs, rows, width, streaming)
        after_prefix = streaming and prefix is not None and whole is None  # as the runner decides
        cost = CALL_ROW_FRAMES + rows * (frames - prefix if after_prefix else frames)
        if rows > 1 and cost > MAX_CALL_ROW_FRAMES:
            return math.inf
        if not self.on_gpu:  # no launch floor, no graphs
            return cost
        if whole is not None:
            return CALL_ROW_FRAMES + whole
        if after_prefix:
            after = self.replayed_row_frames(graphs, rows, width - prefix, True, after_prefix=True)
            if after is not None:
                return CALL_ROW_FRAMES + after
        return max(EAGER_FLOOR_ROW_FRAMES, cost)

    def replayed_row_frames(
        self, graphs: FlowGraphs | None, rows: int, width: int, streaming: bool, after_prefix: bool = False
    ) -> int | None:
        """The rows x frames a call of this shape computes when it replays one of ``graphs``
        (its bucket's, padding included); None when it runs eagerly (no graph, or a CPU)."""
        if graphs is None or not self.on_gpu or not graphs.has(rows, width, streaming, after_prefix):
            return None
        return graphs.buckets.key(rows, width, streaming, after_prefix).row_frames

    def streaming(self, finalize: bool) -> bool:
        """Whether a chunk's flow call is chunk-causal: all but a last chunk of full attention."""
        return not finalize or self.final_streaming

    @property
    def lookahead_frames(self) -> int:
        return self.schedule.mel_ratio * self.schedule.lookahead

    def decoder_width(self, frames: int, finalize: bool) -> int:
        """The decoder's width for a call of this context: the look-ahead tokens are context only."""
        return frames - (0 if finalize else self.lookahead_frames)
