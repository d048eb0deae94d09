"""Where token2wav's time goes, as running totals (exported as ``tts_<name>_total``).

``token2wav_busy_seconds`` against wall time near 1 means the stage is saturated.
``first_audio_*_seconds`` split each utterance's first chunk into its stages (divide by
``first_audio_chunks`` for the mean): text in -> first speech token -> the chunk's tokens
complete -> its call starts -> its audio is out. A chunk delivered after its listener ran
out of audio is a late chunk, blamed on the LLM stage when its tokens were complete only
after that moment, else on token2wav. Calls are counted and timed by kind (first, later,
final: ``chunking.call_kind``), and by thread (the first-chunk lane apart); on a GPU also by
their time on their stream's timeline (``token2wav_call_gpu_seconds_<kind>``: from when the
stream reached the call, idle gaps and other processes' kernels beside it included, as
phase_clock.py times phases). Wall time runs from the call's share of its thread; with
``launch_ahead`` a call's GPU time may start before that share and exceed it.

The scheduler calls these under its lock.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

from tts_gateway.engine.cosyvoice2.metrics import FIRST_AUDIO_STAGES
from tts_gateway.engine.cosyvoice2.serving.chunking import ChunkJob
from tts_gateway.engine.cosyvoice2.serving.request import Request

if TYPE_CHECKING:
    from tts_gateway.engine.cosyvoice2.serving.calls import LaunchedCall


class LatencyBook:
    def __init__(self) -> None:
        self._totals: collections.Counter[str] = collections.Counter()

    def totals(self) -> dict[str, float]:
        return {name: float(value) for name, value in self._totals.items()}

    def count(self, name: str) -> None:
        self._totals[name] += 1

    def call(
        self, kind: str, jobs: list[ChunkJob], started: float, now: float, on_lane: bool,
        launched: LaunchedCall | None = None,
    ) -> None:
        """Book one token2wav call (flow and vocoder) of ``jobs``, of this kind (``launched``:
        its work, None if it failed to launch)."""
        totals = self._totals
        thread = "token2wav_first_lane" if on_lane else "token2wav"
        totals[f"{thread}_batches"] += 1
        totals[f"{thread}_chunks"] += len(jobs)
        totals["token2wav_early_chunks"] += sum(job.early for job in jobs)
        totals[f"{thread}_busy_seconds"] += now - started
        totals[f"token2wav_calls_{kind}"] += 1
        totals[f"token2wav_call_seconds_{kind}"] += now - started
        if launched is not None and launched.gpu_seconds is not None:
            totals[f"token2wav_call_gpu_seconds_{kind}"] += launched.gpu_seconds

    def delivered(self, request: Request, started: float, now: float) -> None:
        """Book a chunk's latency by stage, before its audio is counted as produced."""
        totals = self._totals
        ready_at = request.ready_at if request.ready_at is not None else started
        request.ready_at = None
        if request.clock.first_audio_at is None:
            moments = {
                "text": request.text_at if request.text_at is not None else started,
                "first_token": request.first_token_at if request.first_token_at is not None else ready_at,
                "ready": ready_at, "launched": started, "done": now,
            }
            totals["first_audio_chunks"] += 1
            for stage, (begin, end) in FIRST_AUDIO_STAGES.items():
                totals[f"first_audio_{stage}_seconds"] += max(0.0, moments[end] - moments[begin])
            return
        runs_out = request.clock.deadline(now)
        if now > runs_out:
            totals["late_chunks_llm_bound" if ready_at > runs_out else "late_chunks_token2wav_bound"] += 1
