"""The token2wav scheduler: most urgent listener first, batches, bounded output, cancel."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest

from tts_gateway.engine.cosyvoice2.serving.call_plan import cheapest_groups
from tts_gateway.engine.cosyvoice2.serving.calls import Lane
from tts_gateway.engine.cosyvoice2.serving.request import Request, RequestStatus
from tts_gateway.engine.cosyvoice2.serving.scheduler import END, Scheduler, short_first_chunk_fits

from tests.conftest import eventually, until


@dataclass
class FakeState:
    name: str
    chunks: int  # chunks it can still run
    finished: bool = False
    tokens: list = field(default_factory=list)
    frames: int = 300  # context of its chunks, in mel frames
    first: bool = False  # its next chunk is its first: no audio yet
    short_first: bool = False  # its first chunk is short: the chunk after it opens the turn too
    after_short_first: bool = False  # its next chunk is the one after a short first chunk


@dataclass(frozen=True)
class FakeJob:
    request: Request
    finalize: bool
    early: bool = False

    @property
    def state(self) -> FakeState:
        return self.request.stream

    @property
    def first(self) -> bool:
        return self.state.first


def add(scheduler: Scheduler, state: FakeState, queue: asyncio.Queue) -> Request:
    """A request whose token2wav state is ``state`` (the fake runner reads it), scheduled.
    Its text has ended; its speech tokens are the fake's business."""
    request = Request(prompt=None, stream=state, output=queue, status=RequestStatus.INPUT_ENDED)
    scheduler.add(request)
    return request


def add_playing(scheduler: Scheduler, queues: dict[str, asyncio.Queue], left: dict[str, float]) -> None:
    """Single-chunk utterances whose listeners have played a second and have ``left[name]``
    seconds still buffered, scheduled, and the scheduler woken."""
    requests = {name: add(scheduler, FakeState(name, 1), queues[name]) for name in left}
    with scheduler.lock:
        now = time.monotonic()
        for name, seconds in left.items():
            requests[name].clock.produced(1.0 + seconds, now - 1)
        scheduler.wake.notify_all()


class FakeToken2Wav:
    """Runs 'chunks' of one second each and records which utterances ran, in which batches.
    It is the runner and its chunk schedule at once (``schedule`` is itself)."""

    sample_rate = 100

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.released: list[str] = []  # utterances whose state was freed, in order
        self.schedule = self

    def work_totals(self) -> dict[str, float]:
        return {"flow_calls": len(self.batches)}

    def release(self, state: FakeState) -> None:
        self.released.append(state.name)

    def job_frames(self, job: FakeJob) -> int:
        return job.state.frames

    call_frames = job_frames

    def plan(self, jobs, lane=None):
        # Calls padded to their longest row, at a small cost per call (as Token2WavRunner.plan).
        return cheapest_groups([job.state.frames for job in jobs], lambda rows, width: 100 + rows * width)

    def lane_serves(self, job, lane) -> bool:
        # The lane runs a turn's opening chunks (ChunkSchedule.opens_turn); it has graphs up to 1000 frames.
        opens = job.first or job.state.after_short_first
        return opens and not job.finalize and job.state.frames <= 1000

    def next_job(self, request: Request):
        state = request.stream
        if state.chunks == 0:
            return None
        if state.chunks == 1:  # a stream's last chunk is ready once all its tokens are
            request.status = RequestStatus.TOKENS_DONE
        return FakeJob(request, finalize=state.chunks == 1)

    def launch(self, jobs, lane=None):
        # Runs the call at once (its "GPU work" included); finish hands its audio over.
        return SimpleNamespace(audio=self.run(jobs, lane), gpu_seconds=None)

    def finish(self, launched):
        return launched.audio

    def done(self, launched) -> bool:
        return True

    def run(self, jobs, lane=None):
        self.batches.append([job.state.name for job in jobs])
        for job in jobs:
            job.state.chunks -= 1
            job.state.finished = job.finalize
            job.state.after_short_first = job.first and job.state.short_first
            job.state.first = False
        time.sleep(0.01)
        return [np.zeros(100, np.float32) for _ in jobs]


async def served_in_order(scheduler: Scheduler, fake: FakeToken2Wav, left: dict[str, float | None]) -> list:
    """One single-chunk utterance per name, its listener playing for 1 s with ``left[name]``
    seconds of audio still buffered (None: no audio yet, its chunk a first chunk), all in place
    before the scheduler looks; the calls that served them, once each has ended."""
    queues = {name: asyncio.Queue() for name in left}
    # add() does not wake the scheduler.
    requests = {name: add(scheduler, FakeState(name, 1, first=s is None), queues[name]) for name, s in left.items()}
    with scheduler.lock:
        now = time.monotonic()
        for name, seconds in left.items():
            if seconds is not None:
                requests[name].clock.produced(1.0 + seconds, now - 1)
        scheduler.wake.notify_all()
    for queue in queues.values():
        await until(queue.get())
        assert await until(queue.get()) is END
    return fake.batches


async def test_the_listener_closest_to_running_dry_goes_first():
    fake = FakeToken2Wav()
    scheduler = Scheduler(fake, max_batch=1, loop=asyncio.get_running_loop())
    try:
        # Most urgent first: c (no audio yet: due now), then b (1 s left), then a (29 s left).
        assert await served_in_order(scheduler, fake, {"a": 29.0, "b": 1.0, "c": None}) == [["c"], ["b"], ["a"]]
    finally:
        await asyncio.to_thread(scheduler.stop)


class FirstCallsFirstToken2Wav(FakeToken2Wav):
    """Plans each chunk a call of its own, new turns' first chunks first (as the runner's planner
    orders calls of first chunks before the rest)."""

    def plan(self, jobs, lane=None):
        return sorted(([i] for i in range(len(jobs))), key=lambda group: not jobs[group[0]].first)


@pytest.mark.parametrize("playing_first, order", [(False, ["c", "b", "a"]), (True, ["b", "c", "a"])])
async def test_with_playing_first_a_listener_about_to_run_dry_goes_before_a_new_turn(playing_first, order):
    """playing_first: a playing listener whose audio runs out within two recent calls and a
    margin is served before a new turn's first chunk, in the batch and in the order of
    its calls; one with audio to spare still waits for it. Without, a first chunk goes first."""
    fake = FirstCallsFirstToken2Wav()
    scheduler = Scheduler(fake, max_batch=3, loop=asyncio.get_running_loop(), playing_first=playing_first)
    try:
        # b runs dry in 0.05 s (urgent on an idle scheduler: 0.1 s); c has no audio yet.
        calls = await served_in_order(scheduler, fake, {"a": 30.0, "b": 0.05, "c": None})
        assert calls == [[name] for name in order]
    finally:
        await asyncio.to_thread(scheduler.stop)


async def test_calls_wait_for_min_call_rows_while_listeners_have_audio_to_spare():
    """min_call_rows: chunks whose listeners have audio to spare wait until that many are ready
    (then run in one call); a listener without audio never waits, and one whose audio runs low
    gets its chunk without company (the scheduler wakes by itself for it)."""
    fake = FakeToken2Wav()
    scheduler = Scheduler(fake, max_batch=4, loop=asyncio.get_running_loop(), min_call_rows=3)
    try:
        queues = {name: asyncio.Queue() for name in "abcd"}
        # add() does not wake the scheduler: each is in place before it looks.
        playing = [add(scheduler, FakeState(name, 1), queues[name]) for name in "ab"]
        with scheduler.lock:
            for request in playing:  # 30 s of audio buffered each
                request.clock.produced(30.0, time.monotonic())
            scheduler.wake.notify_all()
        await asyncio.sleep(0.3)
        assert fake.batches == []  # two ready, both listeners far from running dry: held
        add(scheduler, FakeState("c", 1), queues["c"])  # no audio yet: due at once
        with scheduler.lock:
            scheduler.wake.notify_all()
        for name in "abc":
            await until(queues[name].get())
        assert sorted(fake.batches[0]) == ["a", "b", "c"]  # one call of the three
        low = add(scheduler, FakeState("d", 1), queues["d"])
        with scheduler.lock:
            low.clock.produced(0.6, time.monotonic())  # runs dry in 0.6 s: waits at most ~0.3 s
            scheduler.wake.notify_all()
        await until(queues["d"].get(), 2)
        assert fake.batches[1] == ["d"]
    finally:
        await asyncio.to_thread(scheduler.stop)


class LaunchingToken2Wav(FakeToken2Wav):
    """Records when each call is launched and when its audio is taken (finish)."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, list[str]]] = []

    def launch(self, jobs, lane=None):
        names = [job.state.name for job in jobs]
        self.events.append(("launch", names))
        return SimpleNamespace(names=names, audio=self.run(jobs, lane), gpu_seconds=None)

    def finish(self, launched):
        self.events.append(("finish", launched.names))
        return launched.audio


@pytest.mark.parametrize("launch_ahead", [False, True])
async def test_with_launch_ahead_the_next_call_is_launched_before_the_last_is_delivered(launch_ahead):
    """launch_ahead: the engine thread launches its next call before it takes the audio of the
    one in flight (whose chunks then go out), and delivers the last when nothing follows;
    without it each call is delivered before the next is launched. Every chunk arrives."""
    fake = LaunchingToken2Wav()
    scheduler = Scheduler(fake, max_batch=1, loop=asyncio.get_running_loop(), launch_ahead=launch_ahead)
    try:
        queues = {name: asyncio.Queue() for name in "ab"}
        for name in "ab":
            add(scheduler, FakeState(name, 1), queues[name])
        with scheduler.lock:
            scheduler.wake.notify_all()
        for name in "ab":
            await until(queues[name].get())
            assert await until(queues[name].get()) is END
        if launch_ahead:
            assert fake.events == [("launch", ["a"]), ("launch", ["b"]), ("finish", ["a"]), ("finish", ["b"])]
        else:
            assert fake.events == [("launch", ["a"]), ("finish", ["a"]), ("launch", ["b"]), ("finish", ["b"])]
    finally:
        await asyncio.to_thread(scheduler.stop)


async def test_calls_are_timed_by_their_kind():
    """The scheduler books each call's count and time by its kind (first, later or final chunks):
    the totals behind tts_token2wav_calls_<kind>_total and tts_token2wav_call_seconds_<kind>_total."""
    fake = FakeToken2Wav()
    scheduler = Scheduler(fake, max_batch=1, loop=asyncio.get_running_loop())
    try:
        queue: asyncio.Queue = asyncio.Queue()
        add(scheduler, FakeState("a", 3, first=True), queue)
        with scheduler.lock:
            scheduler.wake.notify_all()
        for _ in range(3):
            await until(queue.get())
        totals = scheduler.totals()
        assert [totals[f"token2wav_calls_{kind}"] for kind in ("first", "later", "final")] == [1, 1, 1]
        for kind in ("first", "later", "final"):  # each fake call sleeps 10 ms
            assert 0.01 <= totals[f"token2wav_call_seconds_{kind}"] < 1.0
    finally:
        await asyncio.to_thread(scheduler.stop)


async def test_ready_chunks_of_many_utterances_run_as_one_batch():
    fake = FakeToken2Wav()
    scheduler = Scheduler(fake, max_batch=8, loop=asyncio.get_running_loop())
    try:
        queues = [asyncio.Queue() for _ in range(5)]
        for i, queue in enumerate(queues):
            add(scheduler, FakeState(str(i), 1), queue)
        with scheduler.lock:
            scheduler.wake.notify_all()
        for queue in queues:
            await until(queue.get())
        assert sorted(fake.batches[0]) == ["0", "1", "2", "3", "4"]
    finally:
        await asyncio.to_thread(scheduler.stop)


async def test_an_utterance_whose_consumer_lags_is_not_scheduled():
    fake = FakeToken2Wav()
    scheduler = Scheduler(fake, max_batch=1, loop=asyncio.get_running_loop())
    try:
        queue: asyncio.Queue = asyncio.Queue()
        request = add(scheduler, FakeState("slow", 20), queue)
        with scheduler.lock:
            scheduler.wake.notify_all()
        await eventually(lambda: queue.qsize() == 4)  # the output bound
        await asyncio.sleep(0.1)
        assert queue.qsize() == 4 and len(fake.batches) == 4
        await queue.get()
        scheduler.taken(request)  # the consumer takes one: one more is made
        await eventually(lambda: len(fake.batches) == 5)
        scheduler.cancel(request)  # cancel: nothing more runs
        await asyncio.sleep(0.1)
        assert len(fake.batches) == 5
    finally:
        await asyncio.to_thread(scheduler.stop)


async def test_a_much_longer_context_waits_for_a_batch_of_its_size():
    """Rows are padded to the longest: a long context joins short ones only when it cannot wait
    for another call (no audio yet, or its listener runs dry within two recent calls and a
    margin), and then runs as its own call after theirs."""
    taken: list[list[str]] = []  # the batches the scheduler took, before they are planned into calls

    class TakenToken2Wav(FakeToken2Wav):
        def plan(self, jobs, lane=None):
            taken.append(sorted(job.state.name for job in jobs))
            return super().plan(jobs, lane)

    async def batches_for(utterances: dict[str, tuple[int, float | None]]) -> list[list[str]]:
        """utterances: name -> (context frames, seconds of buffered audio left, or None for no audio yet)."""
        taken.clear()
        fake = TakenToken2Wav()
        scheduler = Scheduler(fake, max_batch=8, loop=asyncio.get_running_loop())
        try:
            queues = {name: asyncio.Queue() for name in utterances}
            # add() does not wake the scheduler, so all are in place before it looks.
            requests = {name: add(scheduler, FakeState(name, 1, frames=frames), queues[name])
                       for name, (frames, _) in utterances.items()}
            with scheduler.lock:
                now = time.monotonic()
                for name, (_, left) in utterances.items():
                    if left is not None:
                        requests[name].clock.produced(1.0 + left, now - 1.0)
                scheduler.wake.notify_all()
            for queue in queues.values():
                await until(queue.get())
            return [sorted(batch) for batch in fake.batches]
        finally:
            await asyncio.to_thread(scheduler.stop)

    assert await batches_for({"short1": (300, None), "short2": (300, 0.5), "long": (1200, 5.0)}) == [
        ["short1", "short2"],
        ["long"],
    ]
    assert taken == [["short1", "short2"], ["long"]]  # it waited for a batch of its own
    # Its listener runs dry in 0.05 s (urgent on an idle scheduler: 0.1 s): taken at once; the
    # narrower rows join the batch and get a call of their own width.
    assert await batches_for({"short1": (300, None), "short2": (300, 0.5), "long": (1200, 0.05)}) == [
        ["short1", "short2"],
        ["long"],
    ]
    assert taken == [["long", "short1", "short2"]]
    # Due now (no audio yet): it is taken at once, but runs after the narrower rows, so that
    # their audio does not wait for its context.
    assert await batches_for({"short": (300, None), "long": (1200, None)}) == [["short"], ["long"]]
    assert await batches_for({"a": (300, None), "long": (1200, None), "b": (320, None)}) == [["a", "b"], ["long"]]


async def test_a_new_turns_first_chunk_runs_between_the_calls_of_a_round():
    """A batch runs as several flow calls; a first chunk that becomes ready during one goes
    next, before the rest of the round."""
    fake = FakeToken2Wav()
    scheduler = Scheduler(fake, max_batch=8, loop=asyncio.get_running_loop())
    queues = {name: asyncio.Queue() for name in ("short", "mid", "long", "new")}
    run = fake.run

    def run_and_start_a_turn(jobs, lane=None):
        if len(fake.batches) == 0:  # during the round's first call, a new turn's tokens arrive
            add(scheduler, FakeState("new", 2, first=True), queues["new"])
        return run(jobs, lane)

    fake.run = run_and_start_a_turn
    try:
        # Padded to the longest row, these three contexts are cheapest as three calls.
        for name, frames in (("short", 300), ("mid", 1200), ("long", 3000)):
            add(scheduler, FakeState(name, 1, frames=frames), queues[name])
        with scheduler.lock:
            scheduler.wake.notify_all()
        for queue in queues.values():
            await until(queue.get())
        assert fake.batches[:4] == [["short"], ["new"], ["mid"], ["long"]]
    finally:
        await asyncio.to_thread(scheduler.stop)


@pytest.mark.parametrize("playing_first, order", [
    (False, ["a", "new1", "new2", "b", "c", "d"]), (True, ["a", "b", "c", "new1", "new2", "d"]),
])
async def test_first_chunks_that_arrive_during_a_round_wait_for_its_urgent_calls(playing_first, order):
    """Without a lane, a first chunk that becomes ready during a round of calls goes next, after
    first chunks that were ready before it; with playing_first, after the round's calls of
    playing listeners about to run dry too."""
    fake = FirstCallsFirstToken2Wav()
    scheduler = Scheduler(fake, max_batch=8, loop=asyncio.get_running_loop(), playing_first=playing_first)
    queues = {name: asyncio.Queue() for name in order}
    run = fake.run
    arrivals = {0: "new1", 1: "new2"}  # during the round's first and second calls, new turns' tokens arrive

    def run_and_start_a_turn(jobs, lane=None):
        if len(fake.batches) in arrivals:
            name = arrivals[len(fake.batches)]
            add(scheduler, FakeState(name, 1, first=True), queues[name])
        return run(jobs, lane)

    fake.run = run_and_start_a_turn
    try:
        # a, b and c run dry within 0.06 s (urgent), d has 30 s to spare: four calls, in that order.
        add_playing(scheduler, queues, {"a": 0.04, "b": 0.05, "c": 0.06, "d": 30.0})
        for name in order:
            await until(queues[name].get())
        assert fake.batches == [[name] for name in order]
    finally:
        await asyncio.to_thread(scheduler.stop)


@pytest.mark.parametrize("between_calls, lane, order", [
    (False, Lane(), ["x", "y", "z", "late", "spare"]),
    (True, Lane(), ["x", "late", "y", "z", "spare"]),
    (True, None, ["x", "late", "y", "z", "spare"]),
], ids=["off", "on", "on-without-a-lane"])
async def test_with_urgent_between_calls_a_listener_about_to_run_dry_goes_between_a_rounds_calls(
    between_calls, lane, order
):
    """urgent_between_calls: a playing listener's chunk that becomes ready during a round of calls
    and would run dry waiting for the round's end goes next, before the round's calls of
    listeners with audio to spare; one with audio to spare still waits for the round's end.
    Without it, both wait for the round's end."""
    fake = FirstCallsFirstToken2Wav()
    scheduler = Scheduler(
        fake, max_batch=8, loop=asyncio.get_running_loop(), first_chunk_lane=lane, playing_first=True,
        urgent_between_calls=between_calls,
    )
    queues = {name: asyncio.Queue() for name in order}
    run = fake.run

    def run_and_ready_playing_chunks(jobs, lane=None):
        if len(fake.batches) == 0:  # during the round's first call: replies with 0.05 s and 30 s left
            add_playing(scheduler, queues, {"late": 0.05, "spare": 30.0})
        return run(jobs, lane)

    fake.run = run_and_ready_playing_chunks
    try:
        # x, y and z have 30 s to spare: three calls of a round.
        add_playing(scheduler, queues, {"x": 30.0, "y": 30.1, "z": 30.2})
        for name in order:
            await until(queues[name].get())
        assert fake.batches == [[name] for name in order]
    finally:
        await asyncio.to_thread(scheduler.stop)


@pytest.mark.parametrize("between_calls, calls", [
    (False, [["a", "b", "c", "d"]]), (True, [["a", "b"], ["c", "d"]]),
])
async def test_with_urgent_between_calls_urgent_chunks_get_calls_of_their_own(between_calls, calls):
    """urgent_between_calls: the chunks of playing listeners about to run dry are planned apart
    from those with audio to spare, and run first; without it, chunks of one width share a call."""
    fake = FakeToken2Wav()
    scheduler = Scheduler(
        fake, max_batch=8, loop=asyncio.get_running_loop(), playing_first=True, urgent_between_calls=between_calls,
    )
    try:
        assert await served_in_order(scheduler, fake, {"a": 0.05, "b": 0.06, "c": 30.0, "d": 30.1}) == calls
    finally:
        await asyncio.to_thread(scheduler.stop)


async def test_a_request_with_no_chunk_ready_keeps_its_first_chunk_unclocked():
    """The scan for ready chunks (the lane's, and the engine thread's) leaves the playback
    clock of a request with nothing ready alone: a new turn's wait for first audio starts when
    its first chunk is ready, not when the scheduler first looks at it."""
    fake = FakeToken2Wav()
    scheduler = Scheduler(fake, max_batch=8, loop=asyncio.get_running_loop(), first_chunk_lane=Lane())
    try:
        waiting = add(scheduler, FakeState("waiting", 0, first=True), asyncio.Queue())  # no chunk ready
        with scheduler.lock:
            scheduler.wake.notify_all()
        await asyncio.sleep(0.1)  # both threads have looked
        with scheduler.lock:
            assert waiting.clock.ready_since is None
    finally:
        await asyncio.to_thread(scheduler.stop)


async def test_the_lane_leaves_the_clock_of_a_first_chunk_it_does_not_run_alone():
    """A first chunk the lane does not run (here, wider than its graphs) is the engine thread's:
    its wait for first audio starts when that thread first sees it, not when the lane does."""
    fake, lanes, release = lane_recording_fake(None)  # the engine thread's calls wait for release
    scheduler = Scheduler(fake, max_batch=8, loop=asyncio.get_running_loop(), first_chunk_lane=Lane())
    try:
        add_playing(scheduler, {"busy": asyncio.Queue()}, {"busy": 5.0})
        await eventually(lambda: lanes == [None])  # the engine thread is in its call
        wide = add(scheduler, FakeState("wide", 2, first=True, frames=2000), asyncio.Queue())
        with scheduler.lock:
            scheduler.wake.notify_all()
        await asyncio.sleep(0.1)  # the lane has looked
        with scheduler.lock:
            assert wide.clock.ready_since is None
        release.set()
        await eventually(lambda: wide.clock.ready_since is not None)  # the engine thread's, once it looks
    finally:
        release.set()
        await asyncio.to_thread(scheduler.stop)


def lane_recording_fake(blocked: Lane | str | None) -> tuple[FakeToken2Wav, list, threading.Event]:
    """A fake that records the lane of every call (None: the main thread) and holds the
    calls of ``blocked`` (a lane, or None for the main thread) until the event is set."""
    fake = FakeToken2Wav()
    lanes: list = []
    release = threading.Event()
    run = fake.run

    def run_recording_lanes(jobs, lane=None):
        lanes.append(lane)
        if lane is blocked:
            assert release.wait(10)
        return run(jobs, lane)

    fake.run = run_recording_lanes
    return fake, lanes, release


@pytest.mark.parametrize("short_first", [False, True], ids=["first-chunk", "short-first-chunk-and-the-next"])
async def test_the_first_chunk_lane_runs_a_new_turn_while_a_call_is_in_flight(short_first):
    """With a first-chunk lane, a new turn's first chunk runs on the lane's thread at once,
    while the main thread is still in its call; after a short first chunk (which plays a
    fraction of a second; second_chunk_on_lane) the chunk after it too. The turn's later
    chunks go to the main thread."""
    lane = Lane()  # on a CPU: no stream and no graphs of its own
    opening = 2 if short_first else 1
    fake, lanes, release = lane_recording_fake(blocked=None)
    scheduler = Scheduler(fake, max_batch=8, loop=asyncio.get_running_loop(), first_chunk_lane=lane)
    try:
        queues = {"long": asyncio.Queue(), "new": asyncio.Queue()}
        add(scheduler, FakeState("long", 2), queues["long"])
        with scheduler.lock:
            scheduler.wake.notify_all()
        await eventually(lambda: scheduler.running == 1)  # the main thread is in its call
        add(scheduler, FakeState("new", opening + 1, first=True, short_first=short_first), queues["new"])
        with scheduler.lock:
            scheduler.wake.notify_all()
        for _ in range(opening):
            await until(queues["new"].get())
        assert queues["long"].empty() and not release.is_set()
        # Calls in the order they started; batches in the order they ran through.
        assert lanes == [None] + [lane] * opening and fake.batches == [["new"]] * opening
        release.set()
        for name in ("long", "long", "new"):
            await until(queues[name].get())
        assert fake.batches[opening] == ["long"]
        assert sorted(name for batch in fake.batches[opening + 1:] for name in batch) == ["long", "new"]
        assert lanes[opening + 1:] == [None] * len(fake.batches[opening + 1:])
    finally:
        release.set()
        await asyncio.to_thread(scheduler.stop)


async def test_while_the_lane_is_busy_the_main_thread_takes_first_chunks():
    """A burst of new turns: first chunks the busy lane cannot take run on the main thread."""
    lane = Lane()
    fake, lanes, release = lane_recording_fake(blocked=lane)
    scheduler = Scheduler(fake, max_batch=8, loop=asyncio.get_running_loop(), first_chunk_lane=lane)
    try:
        queues = {"a": asyncio.Queue(), "b": asyncio.Queue()}
        add(scheduler, FakeState("a", 2, first=True), queues["a"])
        with scheduler.lock:
            scheduler.wake.notify_all()
        await eventually(lambda: lanes == [lane])
        add(scheduler, FakeState("b", 2, first=True), queues["b"])
        with scheduler.lock:
            scheduler.wake.notify_all()
        await until(queues["b"].get())
        assert lanes[:2] == [lane, None] and queues["a"].empty()
        release.set()
        await until(queues["a"].get())
    finally:
        release.set()
        await asyncio.to_thread(scheduler.stop)


async def test_a_first_chunk_the_lane_has_no_graph_for_runs_on_the_main_thread():
    """A voice registered while serving has no graphs on the lane: its first chunk goes to the
    main thread even while the lane is free, and the lane runs the others."""
    lane = Lane()
    fake, lanes, release = lane_recording_fake(blocked="nothing")
    release.set()
    scheduler = Scheduler(fake, max_batch=8, loop=asyncio.get_running_loop(), first_chunk_lane=lane)
    try:
        queues = {"new voice": asyncio.Queue(), "known voice": asyncio.Queue()}
        add(scheduler, FakeState("new voice", 2, first=True, frames=1200), queues["new voice"])
        with scheduler.lock:
            scheduler.wake.notify_all()
        await until(queues["new voice"].get())
        add(scheduler, FakeState("known voice", 2, first=True), queues["known voice"])
        with scheduler.lock:
            scheduler.wake.notify_all()
        await until(queues["known voice"].get())
        # Each one's first chunk (their second chunks are final: the main thread's anyway).
        calls = list(zip(fake.batches, lanes))
        assert calls[0] == (["new voice"], None) and (["known voice"], lane) in calls
    finally:
        await asyncio.to_thread(scheduler.stop)


class EarlyToken2Wav(FakeToken2Wav):
    """Regular chunks need a whole hop of tokens; an early chunk takes what there is."""

    HOP = 10

    def next_job(self, request: Request, early: bool = False):
        state = request.stream
        if len(state.tokens) >= self.HOP:
            return FakeJob(request, finalize=False)
        if early and state.tokens:
            return FakeJob(request, finalize=False, early=True)
        return None

    def run(self, jobs, lane=None):
        self.batches.append([f"{job.state.name}:{len(job.state.tokens)}" for job in jobs])
        for job in jobs:
            del job.state.tokens[: self.HOP]
        return [np.zeros(10, np.float32) for _ in jobs]  # 0.1 s each


async def test_a_listener_about_to_run_dry_gets_the_tokens_there_are():
    """Once its audio is about to run out, an utterance with part of a hop gets an early chunk:
    the scheduler wakes by itself for it, with no new token to wake it."""
    fake = EarlyToken2Wav()
    scheduler = Scheduler(fake, max_batch=4, loop=asyncio.get_running_loop())
    try:
        playing, quiet = asyncio.Queue(), asyncio.Queue()
        a = add(scheduler, FakeState("a", 0, tokens=[1, 2, 3]), playing)
        b = add(scheduler, FakeState("b", 0, tokens=[1, 2, 3]), quiet)
        with scheduler.lock:
            now = time.monotonic()
            a.clock.produced(1.0, now - 0.7)  # runs dry in 0.3 s
            b.clock.produced(10.0, now - 0.7)  # 9.3 s of audio left
            scheduler.wake.notify_all()
        started = time.monotonic()
        await until(playing.get(), 5)
        waited = time.monotonic() - started
        assert fake.batches == [["a:3"]]
        assert 0.1 < waited < 1.0  # not at once: only when close to running dry (margin ~50 ms here)
        assert quiet.empty()
        totals = scheduler.totals()
        assert totals["token2wav_early_chunks"] == 1 and totals["token2wav_flow_calls"] == 1
    finally:
        await asyncio.to_thread(scheduler.stop)


def test_a_short_first_chunk_fits_when_the_next_can_follow_before_it_has_played():
    # 0.24 s to play. Idle: 25 tokens at 3.5 ms and an 80 ms call are out in 0.17 s of 0.32.
    assert short_first_chunk_fits(0.24, 25, 0.0035, 0.08, busy_s=0.0)
    # Under load: 6.5 ms a token, 0.3 s calls, one in flight: 0.9 s against 0.54.
    assert not short_first_chunk_fits(0.24, 25, 0.0065, 0.3, busy_s=0.3)
    # The tokens alone can be too slow (11 ms each at 128 sessions), even with the scheduler idle...
    assert not short_first_chunk_fits(0.24, 25, 0.011, 0.08, busy_s=0.0)
    # ...unless an early chunk can follow with 5 of them.
    assert short_first_chunk_fits(0.24, 5, 0.011, 0.08, busy_s=0.0)
    # 50 ms calls and 4 ms a token fit behind one call in flight (0.2 s against 0.29), not
    # behind a round of 0.4 s (0.55 s).
    assert short_first_chunk_fits(0.24, 25, 0.004, 0.05, busy_s=0.05)
    assert not short_first_chunk_fits(0.24, 25, 0.004, 0.05, busy_s=0.4)


class FirstChunkToken2Wav(FakeToken2Wav):
    """First chunks that the scheduler may lengthen: a lengthened stream has no chunk until
    its test says the longer chunk's tokens are there."""

    hop_len, first_hop_len = 25, 5
    second_on_lane = False

    def __init__(self) -> None:
        super().__init__()
        self.lengthened: list[str] = []

    def first_chunk_playable_s(self, request) -> float:
        return 0.24

    def lengthen_first_chunk(self, request) -> bool:
        self.lengthened.append(request.stream.name)
        request.stream.waiting = True
        return True

    def next_job(self, request):
        return None if getattr(request.stream, "waiting", False) else super().next_job(request)


async def test_by_load_a_first_chunk_waits_for_the_official_length_when_the_next_cannot_follow():
    fake = FirstChunkToken2Wav()
    scheduler = Scheduler(fake, max_batch=4, loop=asyncio.get_running_loop(), first_chunk_by_load=True)
    try:
        idle, loaded = asyncio.Queue(), asyncio.Queue()
        add(scheduler, FakeState("idle", 2, first=True, tokens=[1] * 13), idle)
        with scheduler.lock:
            scheduler.wake.notify_all()
        for _ in range(2):  # an idle scheduler: the short first chunk runs, then the rest
            await until(idle.get())
        assert fake.lengthened == [] and fake.batches == [["idle"], ["idle"]]
        with scheduler.lock:
            scheduler._recent_call_s = 0.4  # calls take 0.4 s now: 0.8 s > 0.4 + 0.24
        request = add(scheduler, FakeState("loaded", 2, first=True, tokens=[1] * 13), loaded)
        with scheduler.lock:
            scheduler.wake.notify_all()
        await eventually(lambda: fake.lengthened == ["loaded"])
        await asyncio.sleep(0.1)
        assert loaded.empty() and scheduler.totals()["token2wav_first_chunks_lengthened"] == 1
        with scheduler.lock:  # the official first chunk's tokens are there: it runs, once decided
            request.stream.waiting = False
            scheduler.wake.notify_all()
        await until(loaded.get())
        assert fake.lengthened == ["loaded"] and fake.batches[-1] == ["loaded"]
    finally:
        await asyncio.to_thread(scheduler.stop)


async def test_by_load_first_chunks_wait_for_the_official_length_while_the_load_rises():
    """Call times of an idle worker say a short first chunk fits; but five replies opening at
    once are more than the recent calls ran beside (1.5 x 1 + 2): their first chunks wait for
    the official length. One reply alone at that load keeps its short one."""
    fake = FirstChunkToken2Wav()
    scheduler = Scheduler(fake, max_batch=8, loop=asyncio.get_running_loop(), first_chunk_by_load=True)
    try:
        opening = [Request(prompt=None, stream=FakeState(name, 2, first=True, tokens=[1] * 13),
                           output=asyncio.Queue(), status=RequestStatus.INPUT_ENDED) for name in "abcde"]
        with scheduler.lock:  # all five at once: the worker judges each at the load they make together
            scheduler._recent_call_s, scheduler._recent_call_requests = 0.02, 1.0
            scheduler.requests.update(opening)
            scheduler.wake.notify_all()
        await eventually(lambda: sorted(fake.lengthened) == list("abcde"))
        assert fake.batches == [] and scheduler.totals()["token2wav_first_chunks_lengthened"] == 5
        for request in opening:
            scheduler.cancel(request)
        alone = asyncio.Queue()
        add(scheduler, FakeState("alone", 2, first=True, tokens=[1] * 13), alone)
        with scheduler.lock:
            scheduler.wake.notify_all()
        await until(alone.get())
        assert len(fake.lengthened) == 5 and fake.batches[0] == ["alone"]
    finally:
        await asyncio.to_thread(scheduler.stop)


@pytest.mark.parametrize("waits_round, lane, between_calls, engine_round, lengthened", [
    (False, Lane(), False, True, False),  # one call counted: the short chunk is kept
    (True, Lane(), False, True, True),  # the round in flight counted: it is not
    (True, Lane(), True, True, False),  # chunks go between a round's calls: one call, as without the setting
    (True, None, False, True, False),  # no lane: the engine thread takes chunks between its calls
    (True, Lane(), False, False, False),  # only the lane is busy: no round to wait for
])
async def test_by_load_the_next_chunk_waits_for_the_round_in_flight_where_none_goes_between_calls(
    waits_round, lane, between_calls, engine_round, lengthened
):
    """The engine thread is busy with a round of 0.4 s in calls of 50 ms, and tokens come every
    4 ms: 25 more follow the short first chunk within its 0.24 s behind one call, not behind
    the round."""
    fake = FirstChunkToken2Wav()
    scheduler = Scheduler(
        fake, max_batch=4, loop=asyncio.get_running_loop(), first_chunk_by_load=True, first_chunk_lane=lane,
        urgent_between_calls=between_calls, first_chunk_waits_round=waits_round,
    )
    try:
        now = time.monotonic()
        request = Request(prompt=None, stream=FakeState("a", 2, first=True, tokens=[1] * 13), output=asyncio.Queue(),
                          status=RequestStatus.INPUT_ENDED)
        request.first_token_at = now - 12 * 0.004
        with scheduler.lock:
            scheduler._recent_call_s, scheduler._recent_batch_s, scheduler._recent_call_requests = 0.05, 0.4, 1.0
            scheduler.running, scheduler._engine_round = 1, engine_round
            job = scheduler._job(request, now)
            scheduler.running, scheduler._engine_round = 0, False
        assert fake.lengthened == (["a"] if lengthened else [])
        assert (job is None) == lengthened
    finally:
        await asyncio.to_thread(scheduler.stop)


async def test_the_engine_thread_s_round_is_marked_while_it_runs_and_only_then():
    fake, seen = FakeToken2Wav(), []
    scheduler = Scheduler(fake, max_batch=1, loop=asyncio.get_running_loop())
    launch = fake.launch

    def launch_seeing_the_round(jobs, lane=None):
        seen.append(scheduler._engine_round)  # the worker holds no lock here; the flag is its own
        return launch(jobs, lane)

    fake.launch = launch_seeing_the_round
    try:
        assert not scheduler._engine_round
        queue = asyncio.Queue()
        add(scheduler, FakeState("a", 2), queue)
        with scheduler.lock:
            scheduler.wake.notify_all()
        for _ in range(2):
            await until(queue.get())
        await eventually(lambda: not scheduler._engine_round)
        assert seen == [True, True]
    finally:
        await asyncio.to_thread(scheduler.stop)


async def test_no_early_chunks_when_turned_off():
    fake = EarlyToken2Wav()
    scheduler = Scheduler(fake, max_batch=4, loop=asyncio.get_running_loop(), early_chunks=False)
    try:
        queue = asyncio.Queue()
        request = add(scheduler, FakeState("a", 0, tokens=[1, 2, 3]), queue)
        with scheduler.lock:
            request.clock.produced(0.2, time.monotonic() - 0.5)  # already dry
            scheduler.wake.notify_all()
        await asyncio.sleep(0.3)
        assert fake.batches == [] and queue.empty()
    finally:
        await asyncio.to_thread(scheduler.stop)


def brute_force_cost(widths: list[int], cost) -> int:
    """The least total cost over every split of the rows into calls (any sets, not just runs)."""
    def splits(rows: list[int]):
        if not rows:
            yield []
            return
        first, rest = rows[0], rows[1:]
        for split in splits(rest):
            for i in range(len(split)):
                yield split[:i] + [[first, *split[i]]] + split[i + 1 :]
            yield [[first], *split]

    return min(sum(cost(len(g), max(widths[i] for i in g)) for g in split) for split in splits(list(range(len(widths)))))


def test_cheapest_groups_is_the_least_cost_split():
    rng = np.random.default_rng(7)
    for fixed, floor in ((0, 0), (300, 0), (1400, 0), (100, 2000)):
        def cost(rows, width, fixed=fixed, floor=floor):
            return max(floor, fixed + rows * width)

        for _ in range(30):
            widths = [int(w) for w in rng.integers(20, 1500, size=int(rng.integers(1, 7)))]
            groups = cheapest_groups(widths, cost)
            assert sorted(i for g in groups for i in g) == list(range(len(widths)))
            total = sum(cost(len(g), max(widths[i] for i in g)) for g in groups)
            assert total == brute_force_cost(widths, cost)
            tops = [max(widths[i] for i in g) for g in groups]
            assert tops == sorted(tops)  # narrowest call first


def test_cheapest_groups_at_the_extremes():
    widths = [100, 800, 100, 120]
    # Calls cost nothing beyond their rows: each width alone, narrowest first.
    assert cheapest_groups(widths, lambda rows, width: rows * width) == [[0, 2], [3], [1]]
    # A call costs more than any padding: one call.
    assert cheapest_groups(widths, lambda rows, width: 10_000 + rows * width) == [[0, 2, 3, 1]]
    assert cheapest_groups([], lambda rows, width: rows * width) == []


async def test_an_lm_stage_that_ends_the_reply_before_the_text_ends_it():
    """The LM stage may end a reply itself (a length limit, say) while text could still come:
    the request then takes no more text, and its last chunk is spoken."""
    fake = FakeToken2Wav()
    scheduler = Scheduler(fake, max_batch=1, loop=asyncio.get_running_loop())
    try:
        queue: asyncio.Queue = asyncio.Queue()
        request = Request(prompt=None, stream=FakeState("a", 1), output=queue)
        scheduler.add(request)
        scheduler.tokens_done(request)
        assert request.status is RequestStatus.TOKENS_DONE
        await until(queue.get())
        assert await until(queue.get()) is END
        assert request.status is RequestStatus.FINISHED
    finally:
        await asyncio.to_thread(scheduler.stop)


class GatedToken2Wav(FakeToken2Wav):
    """Runs a chunk only once ``gate`` is set, saying when it has started."""

    def __init__(self) -> None:
        super().__init__()
        self.started = threading.Event()
        self.gate = threading.Event()

    def run(self, jobs, lane=None):
        self.started.set()
        self.gate.wait(10)
        return super().run(jobs, lane)


async def test_cancel_frees_an_utterances_state_at_once_or_when_its_chunk_is_done():
    """A cancelled utterance's token2wav state (its stored decoder state) is freed at once;
    one whose chunk is running is freed when that call ends, not while it runs."""
    fake = GatedToken2Wav()
    scheduler = Scheduler(fake, max_batch=1, loop=asyncio.get_running_loop())
    try:
        waiting = add(scheduler, FakeState("waiting", 3), asyncio.Queue())
        scheduler.cancel(waiting)
        assert fake.released == ["waiting"]
        running = add(scheduler, FakeState("running", 3), asyncio.Queue())
        with scheduler.lock:
            scheduler.wake.notify_all()
        await asyncio.to_thread(fake.started.wait, 10)
        scheduler.cancel(running)
        assert fake.released == ["waiting"]  # its call is still running
        fake.gate.set()
        await eventually(lambda: fake.released == ["waiting", "running"])
    finally:
        fake.gate.set()
        await asyncio.to_thread(scheduler.stop)
