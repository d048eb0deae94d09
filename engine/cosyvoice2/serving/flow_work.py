"""The token2wav runner's work as running totals: its flow calls, what they needed and computed, their phases.

Two worker threads (the engine's and the first-chunk lane's) add to one set of totals, which
the engine exports as metrics, and each call keeps its own share of what it added while it
was launched (``LaunchedCall.work``), so that a bench can tell one call's work from the rest.
"""

from __future__ import annotations

import collections
import threading

from tts_gateway.engine.cosyvoice2.serving.chunking import ChunkJob, call_kind


class FlowWork:
    """The flow's work so far (``totals``, named ``flow_<name>``): ``calls``, of which
    ``eager_calls`` had no CUDA graph, ``encoder_graph_calls`` had their token encoder replayed
    from one, and ``lane_calls_after_prefix`` were the first-chunk lane's calls after voice
    prefixes; ``vocoder_eager_calls``, vocoder calls no graph held; ``row_frames_{first,later,final}``,
    the mel frames the decoder had to compute for each kind of chunk (rows x their own widths:
    what the work grows with); ``padded_row_frames``, what it computed (rows and frames padded
    to the call's widest row, or to its graph's bucket). Padded / needed is the share spent on
    padding. The engine thread's calls phase by phase (phase_clock.py): ``phase_calls``, and
    ``phase_gpu_seconds_<phase>`` (on a GPU) and ``phase_thread_seconds_<phase>``; the
    first-chunk lane's as ``lane_phase_*``."""

    def __init__(self) -> None:
        self._totals: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()  # two worker threads add to the totals
        self._call = threading.local()  # this thread's call in flight: .work, its share (open_call)

    def totals(self) -> dict[str, float]:
        """The totals so far, each named ``flow_<name>``."""
        with self._lock:
            return {f"flow_{name}": float(value) for name, value in self._totals.items()}

    def open_call(self) -> collections.Counter[str]:
        """The share of the call this thread starts to launch: what ``add`` adds on this thread
        from now until ``close_call``."""
        self._call.work = work = collections.Counter()
        return work

    def close_call(self) -> None:
        self._call.work = None

    def count(self, total: str) -> None:
        self.add({total: 1})

    def add(self, counts: dict[str, int]) -> None:
        """Add to the work totals, and to the share of the call this thread is launching."""
        with self._lock:
            self._totals.update(counts)
        call = getattr(self._call, "work", None)
        if call is not None:
            call.update(counts)

    def book(self, jobs: list[ChunkJob], widths: list[int], width: int, replayed: int | None) -> None:
        """Book one flow call of these jobs, whose rows needed ``widths`` decoder frames each and
        were ``width`` frames wide; ``replayed``: the row-frames of the CUDA graph that held it
        (None: it ran eager, over its rows at that width)."""
        kind = call_kind(jobs)  # as the scheduler books the call's time: per call, not per row
        padded = len(widths) * width if replayed is None else replayed
        self.add({
            "calls": 1, "eager_calls": int(replayed is None), f"row_frames_{kind}": sum(widths),
            "padded_row_frames": padded,
        })

    def book_phases(self, infix: str, seconds: dict[str, float]) -> None:
        """Book a finished call's seconds by phase (``PhaseClock.close``) under ``<infix>phase_``
        (``infix``: its thread's, ``LaunchedCall.infix``): to the totals only, its launch is over."""
        with self._lock:
            self._totals.update({f"{infix}phase_{name}": value for name, value in seconds.items()})
            self._totals[f"{infix}phase_calls"] += 1
