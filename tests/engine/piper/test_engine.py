"""The Piper engine on its own: scheduling by playback deadline, cancel, speed."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio

from tts_gateway.engine.base import UnknownVoice, UtteranceOptions
from tts_gateway.engine.piper.engine import PiperEngine
from tts_gateway.engine.piper.settings import PiperSettings

from tests.conftest import eventually, until


SENTENCES = [f"This is sentence number {n}, spoken to fill the listener's buffer." for n in range(1, 9)]


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def one_worker():
    engine = PiperEngine(PiperSettings(workers=1))
    await engine.start()
    yield engine
    await engine.close()


async def test_the_listener_closest_to_running_dry_goes_first(one_worker):
    """One worker, two utterances. A has seconds of audio buffered; B has none.

    First-come-first-served would speak A's remaining sentences before B's first.
    The playback-deadline scheduler starts B as soon as the worker is free.
    """
    events: list[str] = []
    a = one_worker.open_utterance(UtteranceOptions("joe"))
    a.push_text(" ".join(SENTENCES))
    a.end_input()

    async def consume(name, utterance):
        async for _chunk in utterance:
            events.append(name)

    a_task = asyncio.create_task(consume("a", a))
    await eventually(lambda: events.count("a") >= 2, timeout=20)  # A is now well ahead of its listener
    a_before = events.count("a")
    b = one_worker.open_utterance(UtteranceOptions("joe"))
    b.push_text("Quick answer.")
    b.end_input()
    b_task = asyncio.create_task(consume("b", b))
    await until(asyncio.gather(a_task, b_task), 60)
    # At most the fragment of A already running when B arrived comes before B's.
    assert events.index("b") <= a_before + 1, events
    assert events.count("a") >= a_before + 4  # A had plenty still queued: FIFO would have made B wait


async def test_cancel_frees_the_worker_at_once(one_worker):
    long = one_worker.open_utterance(UtteranceOptions("joe"))
    long.push_text(" ".join(SENTENCES) + " " + " ".join(SENTENCES))
    long.end_input()
    await eventually(lambda: one_worker.stats().running == 1)
    long.cancel()
    chunks = [c async for c in long]
    assert chunks == []
    await eventually(lambda: one_worker.stats().running == 0, timeout=1.0)
    stats = one_worker.stats()
    assert (stats.utterances, stats.queued) == (0, 0)


async def test_speed_changes_duration(piper_engine):
    async def seconds(speed: float) -> float:
        utterance = piper_engine.open_utterance(UtteranceOptions("joe", speed=speed))
        utterance.push_text("The quick brown fox jumps over the lazy dog.")
        utterance.end_input()
        return sum([len(c.samples) async for c in utterance]) / piper_engine.sample_rate

    # Piper draws its phoneme durations with noise, and the silences around a sentence do not
    # scale with speed: twice the speed gives 0.59-0.65 of the duration, not 0.5. Three
    # replies of each keep a draw from the tail from deciding the test.
    normal = sum([await seconds(1.0) for _ in range(3)])
    fast = sum([await seconds(2.0) for _ in range(3)])
    assert 0.45 < fast / normal < 0.72


async def test_unknown_voice_is_refused(piper_engine):
    with pytest.raises(UnknownVoice):
        piper_engine.open_utterance(UtteranceOptions("nobody"))


async def test_flush_speaks_without_end(piper_engine):
    utterance = piper_engine.open_utterance(UtteranceOptions("joe"))
    utterance.push_text("No full stop here but speak it anyway")
    utterance.flush()
    iterator = aiter(utterance)
    first = await until(anext(iterator), 10)  # audio comes without end_input
    utterance.end_input()
    rest = [c async for c in iterator]
    seconds = (len(first.samples) + sum(len(c.samples) for c in rest)) / piper_engine.sample_rate
    assert seconds > 1.5  # the whole phrase, nothing held back
