"""Where a token2wav call's time goes, phase by phase: on the GPU's timeline and the thread's.

A call's phases (the token encoder, the decoder, flow calls outside the pool, the vocoder,
the output) run one after another on one CUDA stream, launched by one thread.
``PhaseClock.lap(phase)`` closes the phase that ran since the last lap: it records a CUDA
event on the stream (nothing waits for it) and reads the thread's clock. Once the call has
waited for its work (``wait``: its audio copied to the host), ``close`` reads the events. The
GPU time between two laps is how long the stream took to get through that phase's work, idle
gaps included (the GPU waiting for kernels the thread had not launched yet): what the phase
cost the call. The thread's time says how much of it was the thread
launching, and how much waiting. Off a GPU only the thread's clock is read.

The thread's series is wall time. The call's wait for its audio on the host is a phase of its
own (``wait``), on the thread's clock only: the thread may launch its next call first. A wait
for the GPU inside a phase (a fallback's positions read to the host) lands in that phase, not
in the phase whose work it waits for; the GPU series puts each phase's work where it ran, from
when the stream got to the call (past the work enqueued before it). The totals are exported as
running counters (``Token2WavRunner.work_totals``, the phases named in ``metrics.PHASES``), read
per level by ``bench/gpu_check.py``.
"""

from __future__ import annotations

import collections
import time

import torch

from tts_gateway.engine.cosyvoice2.metrics import PHASES


class PhaseClock:
    """Laps of one call on one stream (``stream`` None: the thread's clock only)."""

    def __init__(self, stream: torch.cuda.Stream | None) -> None:
        self._stream = stream
        self._start = self._mark()
        self._laps: list[tuple[str, float, torch.cuda.Event | None]] = []
        self._waited = 0.0

    def lap(self, phase: str) -> None:
        """The work launched since the last lap (or the start) was ``phase``'s."""
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}")
        self._laps.append((phase, *self._mark()))

    def wait(self, done: torch.cuda.Event | None) -> None:
        """Wait for the call's work to be done (its last event, None off a GPU): the thread's
        ``wait``. A thread may launch its next call before it waits for this one, so the wait
        has no place on the stream's timeline, and the thread's time between the last lap and
        the wait belongs to other work."""
        started = time.perf_counter()
        if done is not None:
            done.synchronize()
        self._waited += time.perf_counter() - started

    def close(self) -> collections.Counter[str]:
        """Seconds per phase, ``thread_seconds_<phase>`` and ``gpu_seconds_<phase>`` (on a GPU):
        waits for the last lap's event, which the call's final copy to the host has passed."""
        totals: collections.Counter[str] = collections.Counter()
        before_s, before_event = self._start
        for phase, at_s, event in self._laps:
            totals[f"thread_seconds_{phase}"] += at_s - before_s
            if event is not None and before_event is not None:
                event.synchronize()
                totals[f"gpu_seconds_{phase}"] += before_event.elapsed_time(event) / 1000
            before_s, before_event = at_s, event
        if self._waited:
            totals["thread_seconds_wait"] += self._waited
        return totals

    def _mark(self) -> tuple[float, torch.cuda.Event | None]:
        event = None
        if self._stream is not None:
            event = torch.cuda.Event(enable_timing=True)
            event.record(self._stream)
        return time.perf_counter(), event
