"""tts_gateway.engine.base.drive: the one loop that runs an utterance to its end for the gateway's
WebSocket sessions, the speech route, `tts-gateway say` and the benchmarks. Whatever ends it,
the engine is told to drop the utterance's work at once."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tts_gateway.engine.base import AudioChunk, EngineError, Utterance, drive


class ScriptedUtterance(Utterance):
    """Yields the chunks put on ``chunks`` (an EngineError put there is raised); logs every call."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.chunks: asyncio.Queue = asyncio.Queue()

    def push_text(self, text: str) -> None:
        self.calls.append(f"push_text {text}")

    def flush(self) -> None:
        self.calls.append("flush")

    def end_input(self) -> None:
        self.calls.append("end_input")

    def cancel(self) -> None:
        self.calls.append("cancel")

    async def __aiter__(self):
        while (item := await self.chunks.get()) is not None:
            if isinstance(item, EngineError):
                raise item
            yield item


def chunk(n: int) -> AudioChunk:
    return AudioChunk(np.zeros(n, np.float32))


async def test_text_is_pushed_and_ended_then_each_chunk_reaches_the_sink_in_order():
    utterance = ScriptedUtterance()
    for item in (chunk(1), chunk(2), None):
        utterance.chunks.put_nowait(item)
    received = []

    async def start():
        utterance.calls.append("start")

    async def sink(audio: AudioChunk):
        received.append(len(audio.samples))

    await drive(utterance, sink, text="Hello.", start=start)
    assert received == [1, 2]
    assert utterance.calls == ["push_text Hello.", "end_input", "start", "cancel"]


async def test_without_text_the_caller_feeds_the_input():
    utterance = ScriptedUtterance()
    utterance.chunks.put_nowait(None)

    async def sink(audio: AudioChunk):
        raise AssertionError("no audio was scripted")

    await drive(utterance, sink)
    assert utterance.calls == ["cancel"]


async def test_an_engine_failure_cancels_and_reaches_the_caller():
    utterance = ScriptedUtterance()
    utterance.chunks.put_nowait(EngineError("the model crashed"))

    async def sink(audio: AudioChunk):
        pass

    with pytest.raises(EngineError, match="the model crashed"):
        await drive(utterance, sink, text="Hi")
    assert utterance.calls[-1] == "cancel"


async def test_a_failing_sink_cancels_and_reaches_the_caller():
    utterance = ScriptedUtterance()
    utterance.chunks.put_nowait(chunk(1))

    async def gone(audio: AudioChunk):
        raise ConnectionResetError("the client went away")

    with pytest.raises(ConnectionResetError):
        await drive(utterance, gone, text="Hi")
    assert utterance.calls[-1] == "cancel"


async def test_a_cancelled_task_cancels_the_utterance():
    utterance = ScriptedUtterance()

    async def sink(audio: AudioChunk):
        pass

    task = asyncio.create_task(drive(utterance, sink, text="Hi"))
    await asyncio.sleep(0.01)  # waiting for audio that never comes
    assert "cancel" not in utterance.calls
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert utterance.calls == ["push_text Hi", "end_input", "cancel"]
