"""The token2wav scheduler: which utterances' chunks run next, together, on which thread.

One worker thread serves every utterance: whenever chunks are ready it takes up to
``max_batch`` of them, most urgent listener first (earliest playback deadline: an
utterance with no audio yet is due at once, one that is playing is due when its audio runs
out; with ``playing_first``, a playing one about to run out goes before those with none),
leaving out chunks whose context is so much longer than the rest that padding would
waste the batch (they go with a batch of their size), and runs them together. A playing
utterance about to run out of audio, with too few tokens for a whole hop, gets the tokens
there are as an early chunk while batches are short. An utterance whose consumer has not
taken its last chunks is not scheduled, so output stays bounded.

With a first-chunk lane (a GPU's second stream and graphs, see ``calls.Lane``) a second
thread runs new turns' first chunks there, up to ``FIRST_LANE_MAX_BATCH`` at a time, as
soon as they are ready: a first chunk then does not wait for the flow call in flight.
While the lane is busy, the main thread takes first chunks too (a burst of new turns).

A batch may run as several flow calls, a round. Chunks that become ready during a round
wait for its end, unless they go between its calls: without a lane, new turns' first
chunks; with ``urgent_between_calls``, playing listeners' chunks that would be late after it.

Requests (request.py) are the scheduler's: every change to one happens under its lock.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tts_gateway.engine.base import EngineError
from tts_gateway.engine.cosyvoice2.serving.call_plan import PADDING_LIMIT
from tts_gateway.engine.cosyvoice2.serving.calls import Lane, LaunchedCall
from tts_gateway.engine.cosyvoice2.serving.chunking import ChunkJob, call_kind
from tts_gateway.engine.cosyvoice2.serving.latency import LatencyBook
from tts_gateway.engine.cosyvoice2.serving.request import Request, RequestStatus

log = logging.getLogger(__name__)

OUTPUT_CHUNKS = 4  # chunks an utterance may hold before its consumer takes them
# Early chunks (ChunkSchedule.next_job(early=True)) only while batches take less than this.
EARLY_MAX_BATCH_S = 0.3
# First chunks the first-chunk lane runs in one call (its graphs' largest batch).
FIRST_LANE_MAX_BATCH = 8
# first_chunk_by_load judges a short first chunk by the recent flow call time, which says
# nothing of load that has just come: when 64 replies began within half a second, each kept
# its short first chunk on an idle worker's call times, and each stalled after it (H100,
# docs/benchmarks.md). So a short first chunk is kept only while the open requests number at
# most this factor of those open when the recent batches started, plus LOAD_RISE_SLACK.
LOAD_RISE_FACTOR = 1.5
LOAD_RISE_SLACK = 2
END = object()  # the last item of a request's output
# min_call_rows holds chunks back only while their listeners have more audio than this many
# recent calls, plus a margin, take.
HOLD_CALLS = 3
HOLD_MARGIN_S = 0.3
# A playing listener is urgent while its audio would run out within this many recent calls of
# the engine thread, plus URGENT_MARGIN_S: its chunk can wait for the call in flight, then must
# run in the next. Such a chunk is not left out of a batch for its padding, and with
# playing_first it goes before new turns' first chunks.
URGENT_CALLS = 2
URGENT_MARGIN_S = 0.1
# How often the engine thread looks whether the call in flight is done, while it waits to
# launch the next (launch_ahead).
LAUNCH_POLL_S = 0.002
# How long stop() waits for each worker thread: a thread stuck in a call (the watchdog's
# case) is left behind, a daemon, rather than holding the process up.
STOP_JOIN_S = 5.0


@dataclass
class InFlight:
    """A call a worker thread has launched (``launched``, or the ``error`` it raised) and not yet
    delivered: its (request, job) pairs, its kind (``call_kind``), whether it ran on the first-chunk
    lane, when it was launched."""

    batch: list[tuple[Request, ChunkJob]]
    kind: str
    on_lane: bool
    launched_at: float
    launched: LaunchedCall | None = None
    error: EngineError | None = None


def _call_failed(exc: Exception) -> EngineError:
    """A token2wav call's error, as each of its requests is failed with it (logged once)."""
    log.exception("token2wav failed")
    return EngineError(f"audio generation failed: {exc}")


def short_first_chunk_fits(playable_s: float, next_tokens: int, token_s: float, call_s: float, busy_s: float) -> bool:
    """Whether the chunk after a short first chunk can be out before that one has played.

    Either chunk takes about one flow call (``call_s``) once it runs; the next one also waits
    for the ``next_tokens`` it needs, one every ``token_s`` from now, and ``busy_s`` for the
    work its worker has in hand (0 when idle). The first chunk's listener plays ``playable_s``."""
    next_out = max(next_tokens * token_s, call_s) + busy_s + call_s
    return next_out <= call_s + playable_s


class Scheduler:
    """Runs token2wav for every open request, most urgent first, in batches.

    ``runner``: what runs chunks (runner.Token2WavRunner: ``schedule``, ``plan``, ``launch`` (a call
    whose ``gpu_seconds`` its ``finish`` sets), ``finish``, ``done``, ``call_frames``, ``release``,
    ``lane_serves``, ``work_totals``); ``loop``: the event loop the requests' outputs belong to.
    """

    def __init__(
        self, runner, max_batch: int, loop: asyncio.AbstractEventLoop, *, early_chunks: bool = True,
        first_chunk_lane: Lane | None = None, first_chunk_by_load: bool = False, launch_ahead: bool = False,
        min_call_rows: int = 1, playing_first: bool = False, urgent_between_calls: bool = False,
        first_chunk_waits_round: bool = False,
    ) -> None:
        self.runner = runner
        self.schedule = runner.schedule
        self.max_batch = max_batch
        self.loop = loop
        self.early_chunks = early_chunks
        self.first_chunk_lane = first_chunk_lane
        self.first_chunk_by_load = first_chunk_by_load
        self.launch_ahead = launch_ahead
        self.min_call_rows = min_call_rows
        self.playing_first = playing_first
        self.urgent_between_calls = urgent_between_calls
        self.first_chunk_waits_round = first_chunk_waits_round
        self._lane_busy = False
        self._recent_batch_s = 0.0  # moving average of a batch's run time, all its groups
        # Moving average of one flow call of the main thread: its share of the thread (from its
        # launch, or the last delivery if later: calls in flight overlap, see _deliver).
        self._recent_call_s = 0.0
        self._recent_gpu_s = 0.0  # ... of its GPU time (the stream's, from when it got to the call)
        self._recent_launch_s = 0.0  # ... of the time to launch one
        self._delivered_at: dict[int, float] = {}  # worker thread ident -> when it last delivered a call
        self._recent_lane_call_s = 0.0  # ... and of the first-chunk lane
        self._recent_call_requests = 0.0  # moving average of the open requests as batches (either thread's) start
        self._wake_at: float | None = None  # when a listener becomes urgent (early chunks)
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        self.requests: set[Request] = set()
        self.running = 0
        self._engine_round = False  # the engine thread is running a round of calls
        self.latency = LatencyBook()
        self._stopping = False
        # Why the scheduler can serve no more (a worker thread died, the watchdog saw a stall).
        self.failure: str | None = None
        # Worker thread ident -> when each of its calls in flight was launched, oldest first.
        self._calls_since: dict[int, collections.deque[float]] = {}
        self._threads = [threading.Thread(target=self._guarded(self._run), name="cosyvoice2-token2wav", daemon=True)]
        if first_chunk_lane is not None:
            self._threads.append(threading.Thread(
                target=self._guarded(self._run_first_chunk_lane), name="cosyvoice2-token2wav-first", daemon=True
            ))
        for thread in self._threads:
            thread.start()

    # ------------------------------------------------------------ requests (event loop's thread)

    def add(self, request: Request) -> None:
        """Schedule a new request (it runs once its first chunk's tokens are there)."""
        with self.lock:
            if self.failure is not None:
                self._fail(request, EngineError(self.failure))
                return
            self.requests.add(request)

    def text_sent(self, request: Request) -> None:
        if request.text_at is None:
            request.text_at = time.monotonic()

    def push_tokens(self, request: Request, tokens: list[int]) -> None:
        now = time.monotonic()
        with self.lock:
            if request.status.ended:
                return
            if request.first_token_at is None:
                request.first_token_at = now
            request.lm_progress_at = now
            request.tokens.extend(tokens)
            self._mark_ready(request, now)
            self.wake.notify_all()

    def end_input(self, request: Request) -> None:
        """No more text; a request that ended meanwhile (a failure) stays as it is."""
        with self.lock:
            if request.status is RequestStatus.OPEN:
                request.advance(RequestStatus.INPUT_ENDED)
                request.lm_progress_at = time.monotonic()

    def tokens_done(self, request: Request) -> None:
        """The LM stage has produced the request's last speech token (before the input ended, if
        it ended the reply itself: then no more text is taken either)."""
        with self.lock:
            if request.status.ended:
                return
            if request.status is RequestStatus.OPEN:
                request.advance(RequestStatus.INPUT_ENDED)
            request.advance(RequestStatus.TOKENS_DONE)
            self._mark_ready(request, time.monotonic())
            self.wake.notify_all()

    def taken(self, request: Request) -> None:
        """The request's consumer took a chunk: room for the next."""
        with self.lock:
            request.pending -= 1
            self.wake.notify_all()

    def cancel(self, request: Request) -> None:
        """Forget a request at once; its state is freed now, or when its call is delivered."""
        with self.lock:
            if not request.status.ended:
                request.advance(RequestStatus.CANCELLED)
            self.requests.discard(request)
            self._release(request)

    def fail(self, request: Request, error: EngineError) -> None:
        """End a request with an error its consumer raises."""
        with self.lock:
            self._fail(request, error)

    def _fail(self, request: Request, error: EngineError) -> None:
        if request.status.ended:
            return
        request.advance(RequestStatus.FAILED)
        self.requests.discard(request)
        self._release(request)
        self.loop.call_soon_threadsafe(request.output.put_nowait, error)

    def _release(self, request: Request) -> None:
        """Free an ended request's token2wav state (pages of the turn-state pool) unless a
        worker is running its chunk; ``_deliver`` frees it then."""
        if not request.running:
            self.runner.release(request.stream)

    def counts(self) -> tuple[int, int]:
        """Chunks ready but not started, and chunks running."""
        with self.lock:
            queued = sum(
                1 for r in self.requests
                if not r.running and r.pending < OUTPUT_CHUNKS and self.schedule.next_job(r) is not None
            )
            return queued, self.running

    def totals(self) -> dict[str, float]:
        """Where the time goes, as running totals (exported as tts_<name>_total; latency.py)."""
        with self.lock:
            totals = self.latency.totals()
        return totals | {f"token2wav_{name}": value for name, value in self.runner.work_totals().items()}

    def stop(self) -> None:
        with self.lock:
            self._stopping = True
            self.wake.notify_all()
        for thread in self._threads:
            thread.join(STOP_JOIN_S)
            if thread.is_alive():
                log.warning("%s is still in a call; leaving it behind", thread.name)

    # ------------------------------------------------------------ failure (any thread)

    def fail_all(self, reason: str) -> None:
        """The scheduler can serve no more: every request ends with an error, and so does any
        request added later."""
        with self.lock:
            if self.failure is None:
                self.failure = reason
            for request in list(self.requests):
                self._fail(request, EngineError(reason))

    def stalled(self, timeout_s: float) -> str | None:
        """Why work has made no progress for ``timeout_s`` (a hung stage), or None: a token2wav
        call running that long, or a request whose text has all been sent waiting that long
        for its next speech token. Reads without the lock: a hung worker may hold it."""
        now = time.monotonic()
        for launched in tuple(self._calls_since.values()):
            started = next(iter(tuple(launched)), now)
            if now - started > timeout_s:
                return f"a token2wav call has run for more than {timeout_s:g} s"
        for request in tuple(self.requests):
            waiting_since = request.lm_progress_at
            if request.status is RequestStatus.INPUT_ENDED and waiting_since is not None and now - waiting_since > timeout_s:
                return f"the LM stage has produced no speech token for more than {timeout_s:g} s"
        return None

    def _guarded(self, work):
        """A worker thread's loop; if it raises (outside a request's call, which fails only that
        call's requests), the scheduler has lost a worker and fails everything."""

        def run() -> None:
            try:
                work()
            except Exception as exc:
                log.exception("token2wav worker thread failed")
                self.fail_all(f"the token2wav worker failed: {exc}")

        return run

    # ------------------------------------------------------------ picking work (under the lock)

    def _mark_ready(self, request: Request, now: float) -> None:
        if request.ready_at is None and self.schedule.next_job(request) is not None:
            request.ready_at = now

    def _early_margin(self) -> float | None:
        """How long before a listener runs dry its tokens are spoken early (None: not now).

        Twice the recent batch time, plus a little: the early chunk must be out before the
        listener's audio is. Only while batches are short: under load an early chunk is an
        extra flow pass the worker has no time for."""
        if not self.early_chunks or self._recent_batch_s > EARLY_MAX_BATCH_S:
            return None
        return 2 * self._recent_batch_s + 0.05

    def _job(self, request: Request, now: float) -> ChunkJob | None:
        """The chunk this request can run now, if any. With ``first_chunk_by_load``, a short
        first chunk is kept only if the chunk after it can follow before it has played
        (``short_first_chunk_fits``, from the tokens' pace so far and the recent flow call
        time) and the load has not risen since those calls (LOAD_RISE_FACTOR); else the
        stream waits for the official first chunk."""
        schedule = self.schedule
        job = schedule.next_job(request)
        if job is None or not job.first or job.finalize or not self.first_chunk_by_load or request.first_chunk_chosen:
            return job
        request.first_chunk_chosen = True
        spoken = len(request.tokens) - 1
        token_s = (now - request.first_token_at) / spoken if request.first_token_at is not None and spoken > 0 else 0.0
        # An early chunk can follow with first_hop_len tokens, while the worker has time for one.
        next_tokens = schedule.first_hop_len if self._early_margin() is not None else schedule.hop_len
        playable_s = schedule.first_chunk_playable_s(request)
        # The lane may run the chunk after a short first chunk (ChunkSchedule.opens_turn).
        if self.first_chunk_lane is not None and schedule.second_on_lane:
            call_s = self._recent_lane_call_s
            busy_s = call_s if self._lane_busy else 0.0
        else:
            call_s = self._recent_call_s
            busy_s = self._engine_thread_wait_s()
        rising = len(self.requests) > LOAD_RISE_FACTOR * self._recent_call_requests + LOAD_RISE_SLACK
        if not rising and short_first_chunk_fits(playable_s, next_tokens, token_s, call_s, busy_s):
            return job
        if not schedule.lengthen_first_chunk(request):
            return job
        self.latency.count("token2wav_first_chunks_lengthened")
        request.ready_at = None  # its chunk is ready once the longer chunk's tokens are there
        return schedule.next_job(request)

    def _engine_thread_wait_s(self) -> float:
        """How long a chunk that becomes ready now may wait for the engine thread's work in hand.
        By default one call while any chunk runs (on either thread). With
        ``first_chunk_waits_round``, where no chunk goes between a round's calls (with the
        first-chunk lane, unless ``urgent_between_calls``), a whole recent round while the engine
        thread runs one (a bound on what is left of it): there a second chunk waits for the
        round's end."""
        takes_arrivals = self.first_chunk_lane is None or self.urgent_between_calls
        if self.first_chunk_waits_round and not takes_arrivals:
            return max(self._recent_batch_s, self._recent_call_s) if self._engine_round else 0.0
        return self._recent_call_s if self.running > 0 else 0.0

    def _next_batch(self) -> list[tuple[Request, ChunkJob]]:
        now = time.monotonic()
        margin = self._early_margin()
        self._wake_at = None
        ready = []
        for request in list(self.requests):
            if request.pending >= OUTPUT_CHUNKS or request.running:
                continue
            job = self._job(request, now)
            if job is not None and self._for_lane(job) and not self._lane_busy:
                continue  # the lane is free to take it now
            if job is None and margin is not None and request.clock.first_audio_at is not None:
                early = self.schedule.next_job(request, early=True)
                urgent_at = request.clock.deadline(now) - margin
                if early is not None and urgent_at <= now:
                    job = early
                elif early is not None:
                    self._wake_at = urgent_at if self._wake_at is None else min(self._wake_at, urgent_at)
            if job is not None:
                ready.append((request.clock.deadline(now), request.request_id, request, job))
            elif request.status is RequestStatus.TOKENS_DONE and not request.tokens:
                self._finish(request)  # nothing was generated: nothing to say
        urgent_s = self._urgent_s()
        ready.sort(key=lambda item: (*self._urgency(item[2], item[0], now, urgent_s), item[1]))
        if self._holds(ready, now):
            return []
        batch: list[tuple[Request, ChunkJob]] = []
        useful = width = 0
        for deadline, _, request, job in ready:
            if len(batch) == self.max_batch:
                break
            frames = self.runner.call_frames(job)
            padded = (len(batch) + 1) * max(width, frames)
            # A much longer context than the batch's that can wait for another call waits for a
            # batch of its size: now it would run on its own after the others (see _run_calls),
            # holding back whatever arrives meanwhile. (An urgent one must run now: on an H100 a
            # turn's second chunk, wide after a first chunk on the lane, waited out two calls
            # this way and its listener ran dry.) A narrower one joins: the planner gives it
            # a call with rows of its width.
            waits = deadline - now > urgent_s
            if batch and waits and frames > width and padded > PADDING_LIMIT * (useful + frames):
                continue
            batch.append((request, job))
            useful, width = useful + frames, max(width, frames)
        return batch

    def _urgent_s(self) -> float:
        """How soon a playing listener's audio must run out for it to be urgent (URGENT_CALLS)."""
        return URGENT_CALLS * self._recent_call_s + URGENT_MARGIN_S

    @staticmethod
    def _playing_urgent(request: Request, deadline: float, now: float, urgent_s: float) -> bool:
        """Whether a playing listener's audio runs out within ``urgent_s``."""
        return request.clock.first_audio_at is not None and deadline - now < urgent_s

    @classmethod
    def _runs_dry(cls, request: Request, now: float, within_s: float) -> bool:
        """``_playing_urgent`` for a request whose deadline is not at hand: asked only once its
        listener plays (asking starts a new turn's wait for first audio, PlaybackClock.deadline)."""
        clock = request.clock
        return clock.first_audio_at is not None and cls._playing_urgent(request, clock.deadline(now), now, within_s)

    def _urgency(self, request: Request, deadline: float, now: float, urgent_s: float) -> tuple[bool, float]:
        """A ready chunk's place in the queue, most urgent first: by deadline, and with
        ``playing_first`` urgent playing listeners ahead of the rest."""
        return not (self.playing_first and self._playing_urgent(request, deadline, now, urgent_s)), deadline

    def _arrivals_at(self, calls: list[list[tuple[Request, ChunkJob]]]) -> int:
        """Where the chunks that became ready during a round (``_arrivals``) go among its calls still
        to run: after the calls of first chunks that were ready before them, and with ``playing_first``
        after those that serve an urgent playing listener (``_playing_urgent``). Both kinds lead
        the round (``_run_calls``)."""
        now, urgent_s = time.monotonic(), self._urgent_s()

        def goes_first(call: list[tuple[Request, ChunkJob]]) -> bool:
            return all(job.first for _, job in call) or self.playing_first and any(
                self._runs_dry(request, now, urgent_s) for request, _ in call
            )

        at = 0
        while at < len(calls) and goes_first(calls[at]):
            at += 1
        return at

    def _holds(self, ready: list[tuple], now: float) -> bool:
        """Whether the engine thread waits for more ready chunks before its next call
        (``min_call_rows``): while fewer are ready and every one of their listeners has audio
        to spare beyond HOLD_CALLS recent calls and HOLD_MARGIN_S (a listener with no audio yet
        is due at once). A call's decoder costs much the same for a few rows as for several
        (its kernels are latency-bound at small sizes: on an H100 ~70 ms a call plus ~65 us a
        row-frame at 10 Euler steps, from calls at one and at 64 sessions), so calls of more
        rows serve more audio per second of GPU. Sets ``_wake_at`` to when the most urgent of
        them stops having audio to spare."""
        if len(ready) >= self.min_call_rows or not ready:
            return False
        urgent_at = min(item[0] for item in ready) - HOLD_CALLS * self._recent_call_s - HOLD_MARGIN_S
        if urgent_at <= now:
            return False
        self._wake_at = urgent_at if self._wake_at is None else min(self._wake_at, urgent_at)
        return True

    def _finish(self, request: Request) -> None:
        request.advance(RequestStatus.FINISHED)
        self.requests.discard(request)
        self.loop.call_soon_threadsafe(request.output.put_nowait, END)

    def _for_lane(self, job: ChunkJob) -> bool:
        """Whether the first-chunk lane runs this job: an opening chunk of its turn (the first;
        with ``second_chunk_on_lane``, after a short first chunk the next too) of a voice it
        has graphs for (a voice registered while serving has none there; the main thread
        takes it)."""
        lane = self.first_chunk_lane
        return lane is not None and self.runner.lane_serves(job, lane)

    def _take(self, batch: list[tuple[Request, ChunkJob]]) -> list[tuple[Request, ChunkJob]]:
        """Mark a batch's requests running (under the lock) and count its chunks; note the load
        its calls start at (first_chunk_by_load)."""
        for request, _ in batch:
            request.running = True
        self.running += len(batch)
        if batch:
            self._recent_call_requests += 0.2 * (len(self.requests) - self._recent_call_requests)
        return batch

    def _ready_first_chunks(self, limit: int) -> list[tuple[Request, ChunkJob]]:
        """(request, job) of up to ``limit`` first chunks the lane runs (_for_lane) ready to run,
        of requests no thread holds, earliest deadline first."""
        return self._ready(
            limit, lambda request, job, now: self._for_lane(job), lambda request, deadline, now: (deadline,)
        )

    def _arrivals(self, calls_left: int) -> list[tuple[Request, ChunkJob]]:
        """What goes between the engine thread's calls of a round, of the chunks ready now (up to
        ``max_batch``, most urgent first as in ``_next_batch``): without a first-chunk lane, new
        turns' first chunks; with ``urgent_between_calls`` and calls of the round still to run
        (``calls_left``, the one in flight counted), a playing listener's chunk whose audio would
        run out before those calls have taken a recent call's time each and its own call
        ``_urgent_s`` more (not one the idle lane takes). Waiting for the round's end, it would be
        late (on an H100 at 64 sessions the opening burst's calls took up to half a second,
        docs/benchmarks.md). After a round's last call only first chunks are: the next batch
        (``_next_batch``) takes a playing listener's chunk with the rest."""
        urgent_s = self._urgent_s()
        due_s = urgent_s + calls_left * self._recent_call_s

        def goes_between(request: Request, job: ChunkJob, now: float) -> bool:
            if job.first:
                return self.first_chunk_lane is None
            if not (self.urgent_between_calls and calls_left) or (self._for_lane(job) and not self._lane_busy):
                return False
            return self._runs_dry(request, now, due_s)

        return self._ready(
            self.max_batch, goes_between, lambda request, deadline, now: self._urgency(request, deadline, now, urgent_s)
        )

    def _ready(
        self, limit: int, takes: Callable[[Request, ChunkJob, float], bool],
        urgency: Callable[[Request, float, float], tuple],
    ) -> list[tuple[Request, ChunkJob]]:
        """(request, job) of up to ``limit`` chunks ready to run, of requests no thread holds,
        that ``takes(request, job, now)``, in the order of ``urgency(request, deadline, now)``
        (then of the requests' ids). Only those taken are asked their deadline: asking starts a
        new turn's wait for first audio (PlaybackClock.deadline), which is the thread's that
        takes it."""
        now = time.monotonic()
        ready = []
        for request in self.requests:
            if request.running or request.pending >= OUTPUT_CHUNKS:
                continue
            job = self._job(request, now)
            if job is not None and takes(request, job, now):
                deadline = request.clock.deadline(now)
                ready.append((urgency(request, deadline, now), request.request_id, request, job))
        ready.sort(key=lambda item: item[:2])
        return [(request, job) for _, _, request, job in ready[:limit]]

    # ------------------------------------------------------------ the worker threads

    def _run(self) -> None:
        """The engine thread. With ``launch_ahead`` it launches each call before it waits for the
        one in flight, as late as lets the launch end about when that call's GPU work does
        (``_next_launch``): the GPU has the next call queued while the host finishes the last
        one, so its launches (the token encoder's kernels, the graphs' inputs) do not leave the
        GPU idle, and a call still takes every chunk that became ready while the last one ran.
        Without it, each call is delivered before the next is picked."""
        in_flight: InFlight | None = None
        while True:
            with self.lock:
                batch = self._next_launch(in_flight)
                if self._stopping:
                    break
                self._take(batch)
                self._engine_round = bool(batch) or in_flight is not None
            if not batch:  # nothing to launch behind the call in flight: deliver it, then look again
                self._deliver(in_flight)
                in_flight = None
                continue
            started = time.monotonic()
            in_flight = self._run_calls(batch, in_flight=in_flight)
            with self.lock:
                self._engine_round = in_flight is not None  # launched ahead: still running
            # The whole round of calls: how long until the worker looks at the queue again.
            self._recent_batch_s += 0.2 * (time.monotonic() - started - self._recent_batch_s)
        self._deliver(in_flight)

    def _next_launch(self, in_flight: InFlight | None) -> list[tuple[Request, ChunkJob]]:
        """The engine thread's next batch (under the lock). With a call in flight, picked once
        that call has run a recent call's GPU time less a recent launch's time, or is done
        (looked at every LAUNCH_POLL_S); with none, at once when work is ready, else when work
        comes. Empty if there is nothing to launch then, or the scheduler is stopping."""
        if in_flight is not None:
            launch_at = in_flight.launched_at + self._recent_gpu_s - self._recent_launch_s
            while not self._stopping and not self.runner.done(in_flight.launched):
                delay = launch_at - time.monotonic()
                if delay <= 0:
                    break
                self.wake.wait(min(delay, LAUNCH_POLL_S))
            return [] if self._stopping else self._next_batch()
        batch = self._next_batch()
        while not batch and not self._stopping:
            self.wake.wait(None if self._wake_at is None else max(0.0, self._wake_at - time.monotonic()))
            batch = self._next_batch()
        return batch

    def _run_first_chunk_lane(self) -> None:
        lane = self.first_chunk_lane
        while True:
            with self.lock:
                batch = self._ready_first_chunks(FIRST_LANE_MAX_BATCH)
                while not batch and not self._stopping:
                    self.wake.wait()
                    batch = self._ready_first_chunks(FIRST_LANE_MAX_BATCH)
                if self._stopping:
                    return
                self._take(batch)
                self._lane_busy = True
            self._run_calls(batch, lane)  # first chunks go out as soon as each is done
            with self.lock:
                self._lane_busy = False
                self.wake.notify_all()  # first chunks the main thread left to the lane

    def _run_calls(
        self, batch: list[tuple[Request, ChunkJob]], lane: Lane | None = None, in_flight: InFlight | None = None
    ) -> InFlight | None:
        """Run a batch as the flow calls ``_calls`` plans, in their order (with ``playing_first``,
        that of each call's most urgent chunk). With ``launch_ahead`` on the engine thread, each is launched
        before the call in flight (``in_flight``, then each of these in turn) is delivered, and
        the last is returned still in flight; else each is delivered once done (None returned).
        ``lane``: on the first-chunk lane.

        A call runs to its end, and the rest of the batch may take many calls: on the engine
        thread, ``_arrivals`` that became ready meanwhile go next (after first chunks that were
        ready before them, and with ``playing_first`` after the round's calls of urgent playing
        listeners), so that they wait for one call, not for the whole round.
        """
        try:
            calls = self._calls(batch, lane, by_urgency=self.playing_first)
            while calls:
                previous, in_flight = in_flight, self._launch(calls.pop(0), lane)
                self._deliver(previous)
                if not self.launch_ahead or lane is not None:  # delivered as soon as it is done
                    done, in_flight = in_flight, None
                    self._deliver(done)
                if lane is not None or (self.first_chunk_lane is not None and not self.urgent_between_calls):
                    continue  # no arrivals to take
                with self.lock:
                    arrived = self._take(self._arrivals(len(calls) + (in_flight is not None)))
                    at = self._arrivals_at(calls) if arrived else 0
                if arrived:
                    by_urgency = self.playing_first and self.urgent_between_calls
                    calls[at:at] = self._calls(arrived, None, by_urgency)
        except BaseException:  # the worker is lost (see _guarded): the call in flight still ends
            self._deliver(in_flight)
            raise
        return in_flight

    def _calls(
        self, batch: list[tuple[Request, ChunkJob]], lane: Lane | None, by_urgency: bool
    ) -> list[list[tuple[Request, ChunkJob]]]:
        """A batch's flow calls (``runner.plan``) in the order they run: the planner's (new turns'
        first chunks, then narrowest first), or ``by_urgency``, that of each call's most urgent
        chunk (a batch is most urgent first). With ``playing_first`` and ``urgent_between_calls``
        on the engine thread, urgent playing listeners' chunks (``_playing_urgent``) are planned
        apart and run first: a chunk with audio to spare in their call would only lengthen it
        (on an H100, urgent second chunks waited behind such a call of 369 ms)."""
        parts = [list(range(len(batch)))]
        if lane is None and self.playing_first and self.urgent_between_calls:
            now, urgent_s = time.monotonic(), self._urgent_s()
            urgent = {i for i, (request, _) in enumerate(batch) if self._runs_dry(request, now, urgent_s)}
            parts = [sorted(urgent), [i for i in parts[0] if i not in urgent]]
        calls = []
        for part in filter(None, parts):
            plan = [[part[k] for k in group] for group in self.runner.plan([batch[i][1] for i in part], lane)]
            if by_urgency:
                plan.sort(key=min)
            calls += [[batch[i] for i in group] for group in plan]
        return calls

    def _launch(self, batch: list[tuple[Request, ChunkJob]], lane: Lane | None) -> InFlight:
        """Launch one call (``runner.launch``); an error fails the call's requests when it is
        delivered."""
        jobs = [job for _, job in batch]
        call = InFlight(batch, call_kind(jobs), lane is not None, time.monotonic())  # kind: before the streams move on
        self._calls_since.setdefault(threading.get_ident(), collections.deque()).append(call.launched_at)
        try:
            call.launched = self.runner.launch(jobs, lane)
        except Exception as exc:
            call.error = _call_failed(exc)
        if not call.on_lane:
            self._recent_launch_s += 0.2 * (time.monotonic() - call.launched_at - self._recent_launch_s)
        return call

    def _deliver(self, call: InFlight | None) -> None:
        """Wait for a launched call's audio and hand each request its chunk (or the error)."""
        if call is None:
            return
        thread = threading.get_ident()
        audio = None
        if call.error is None:
            try:
                audio = self.runner.finish(call.launched)
            except Exception as exc:
                call.error = _call_failed(exc)
        now = time.monotonic()
        # The call's share of the thread: from its launch, or from the last delivery if that was
        # later (calls in flight overlap); its chunks' latency runs from the launch.
        busy_from = max(call.launched_at, self._delivered_at.get(thread, call.launched_at))
        self._delivered_at[thread] = now
        self._calls_since[thread].popleft()  # calls are delivered in the order they were launched
        batch, jobs = call.batch, [job for _, job in call.batch]
        compute_s = (now - busy_from) / max(len(batch), 1)
        with self.lock:
            self.latency.call(call.kind, jobs, busy_from, now, call.on_lane, call.launched)
            if call.on_lane:
                self._recent_lane_call_s += 0.2 * (now - call.launched_at - self._recent_lane_call_s)
            else:
                self._recent_call_s += 0.2 * (now - busy_from - self._recent_call_s)
                if call.launched is not None and call.launched.gpu_seconds is not None:
                    self._recent_gpu_s += 0.2 * (call.launched.gpu_seconds - self._recent_gpu_s)
            self.running -= len(batch)
            for i, (request, job) in enumerate(batch):
                request.running = False
                if request not in self.requests:
                    self._release(request)  # cancelled while running
                    continue
                if call.error is not None:
                    self._fail(request, call.error)
                    continue
                samples = audio[i]
                self.latency.delivered(request, call.launched_at, now)
                request.clock.produced(len(samples) / self.schedule.sample_rate, now)
                request.pending += 1
                self.loop.call_soon_threadsafe(request.output.put_nowait, (samples, compute_s, job.finalize))
                if job.finalize:
                    self._finish(request)
                else:
                    self._mark_ready(request, now)  # the next chunk's tokens may be there already
