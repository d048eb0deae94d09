"""The token2wav worker: most urgent listener first, batches, bounded output, cancel."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import numpy as np

from engine.cosyvoice2.engine import _END, Token2WavWorker

from .conftest import eventually, until


@dataclass
class FakeState:
    name: str
    chunks: int  # chunks it can still run
    finished: bool = False
    tokens: list = field(default_factory=list)
    frames: int = 300  # context of its chunks, in mel frames


@dataclass(frozen=True)
class FakeJob:
    state: FakeState
    finalize: bool


class FakeToken2Wav:
    """Runs 'chunks' of one second each and records which utterances ran, in which batches."""

    class hift:  # noqa: N801 - mirrors token2wav.hift.config.sampling_rate
        class config:  # noqa: N801
            sampling_rate = 100

    def __init__(self) -> None:
        self.batches: list[list[str]] = []

    def job_frames(self, job: FakeJob) -> int:
        return job.state.frames

    def next_job(self, state: FakeState):
        if state.chunks == 0:
            return None
        return FakeJob(state, finalize=state.chunks == 1)

    def run(self, jobs):
        self.batches.append([job.state.name for job in jobs])
        for job in jobs:
            job.state.chunks -= 1
            job.state.finished = job.finalize
        time.sleep(0.01)
        return [np.zeros(100, np.float32) for _ in jobs]


async def test_the_listener_closest_to_running_dry_goes_first():
    fake = FakeToken2Wav()
    worker = Token2WavWorker(fake, max_batch=1, loop=asyncio.get_running_loop())
    try:
        queues = {name: asyncio.Queue() for name in "abc"}
        # add() does not wake the worker, so all three are in place before it looks.
        handles = {name: worker.add(FakeState(name, 1), queues[name]) for name in "abc"}
        with worker.lock:
            # a: has been playing for 1 s with 30 s of audio buffered; b: 2 s buffered;
            # c: no audio yet. Most urgent first: c (due now), then b, then a.
            now = time.monotonic()
            handles["a"].clock.produced(30.0, now - 1)
            handles["b"].clock.produced(2.0, now - 1)
            worker.wake.notify()
        for name in "abc":
            await until(queues[name].get())
            assert await until(queues[name].get()) is _END
        assert fake.batches == [["c"], ["b"], ["a"]]
    finally:
        await asyncio.to_thread(worker.stop)


async def test_ready_chunks_of_many_utterances_run_as_one_batch():
    fake = FakeToken2Wav()
    worker = Token2WavWorker(fake, max_batch=8, loop=asyncio.get_running_loop())
    try:
        queues = [asyncio.Queue() for _ in range(5)]
        for i, queue in enumerate(queues):
            worker.add(FakeState(str(i), 1), queue)
        with worker.lock:
            worker.wake.notify()
        for queue in queues:
            await until(queue.get())
        assert sorted(fake.batches[0]) == ["0", "1", "2", "3", "4"]
    finally:
        await asyncio.to_thread(worker.stop)


async def test_an_utterance_whose_consumer_lags_is_not_scheduled():
    fake = FakeToken2Wav()
    worker = Token2WavWorker(fake, max_batch=1, loop=asyncio.get_running_loop())
    try:
        queue: asyncio.Queue = asyncio.Queue()
        handle = worker.add(FakeState("slow", 20), queue)
        with worker.lock:
            worker.wake.notify()
        await eventually(lambda: queue.qsize() == 4)  # the output bound
        await asyncio.sleep(0.1)
        assert queue.qsize() == 4 and len(fake.batches) == 4
        await queue.get()
        handle.taken()  # the consumer takes one: one more is made
        await eventually(lambda: len(fake.batches) == 5)
        worker.remove(handle)  # cancel: nothing more runs
        await asyncio.sleep(0.1)
        assert len(fake.batches) == 5
    finally:
        await asyncio.to_thread(worker.stop)


async def test_a_much_longer_context_waits_for_a_batch_of_its_size():
    """Rows are padded to the longest: a long context joins short ones only when it is due now."""

    async def batches_for(utterances: dict[str, tuple[int, float | None]]) -> list[list[str]]:
        """utterances: name -> (context frames, seconds of buffered audio left, or None for no audio yet)."""
        fake = FakeToken2Wav()
        worker = Token2WavWorker(fake, max_batch=8, loop=asyncio.get_running_loop())
        try:
            queues = {name: asyncio.Queue() for name in utterances}
            # add() does not wake the worker, so all are in place before it looks.
            handles = {name: worker.add(FakeState(name, 1, frames=frames), queues[name])
                       for name, (frames, _) in utterances.items()}
            with worker.lock:
                now = time.monotonic()
                for name, (_, left) in utterances.items():
                    if left is not None:
                        handles[name].clock.produced(1.0 + left, now - 1.0)
                worker.wake.notify()
            for queue in queues.values():
                await until(queue.get())
            return [sorted(batch) for batch in fake.batches]
        finally:
            await asyncio.to_thread(worker.stop)

    assert await batches_for({"short1": (300, None), "short2": (300, 0.5), "long": (1200, 5.0)}) == [
        ["short1", "short2"],
        ["long"],
    ]
    # Due now (no audio yet): it goes in whatever the padding.
    assert await batches_for({"short": (300, None), "long": (1200, None)}) == [["long", "short"]]
