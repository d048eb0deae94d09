"""The gateway facing hostile or unlucky input: clients that never read their errors, and
engines that refuse an utterance."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import orjson
import pytest
from websockets.asyncio.client import connect

from engine.base import AudioChunk, Engine, EngineError, Utterance, UtteranceOptions, Voice
from gateway.server import SessionRunner

from tests.conftest import make_config, running_gateway, ws_url
from tests.gateway.test_server import read_context, recv_json


class ScriptedEngine(Engine):
    """Voice ``ok`` speaks a short tone per utterance; ``refused`` fails to open with an
    EngineError (as CosyVoice2 does for a voice it cannot load), ``broken`` with a bug."""

    name = "scripted"
    sample_rate = 16000

    async def start(self):
        pass

    async def close(self):
        pass

    def voices(self):
        return [Voice(v, v, "en", self.name) for v in ("ok", "refused", "broken")]

    @property
    def default_voice(self):
        return "ok"

    def open_utterance(self, options: UtteranceOptions) -> Utterance:
        if options.voice == "refused":
            raise EngineError("cannot load voice 'refused'")
        if options.voice == "broken":
            raise RuntimeError("a bug in the engine")
        return ToneUtterance()


class ToneUtterance(Utterance):
    def __init__(self):
        self._ended = asyncio.Event()

    def push_text(self, text):
        pass

    def flush(self):
        pass

    def end_input(self):
        self._ended.set()

    def cancel(self):
        self._ended.set()

    async def __aiter__(self):
        await self._ended.wait()
        yield AudioChunk(np.full(1600, 0.1, np.float32))


def text(context_id: str, body: str, **options) -> str:
    return orjson.dumps({"type": "text", "context_id": context_id, "text": body, **options}).decode()


def end(context_id: str) -> str:
    return orjson.dumps({"type": "end", "context_id": context_id}).decode()


# ------------------------------------------------------------------ the send buffer


class NeverReadingConnection:
    """A client that reads nothing: nothing drains the session's outbox."""

    def __init__(self) -> None:
        self.transport = SimpleNamespace(abort=lambda: None)
        self.request = SimpleNamespace(path="/v1/stream")


async def test_error_frames_count_against_the_send_buffer():
    """1,500 hostile frames from a client that reads nothing: what waits for it stays within
    send_buffer_bytes, and it is cut off as a client not reading."""
    limit = 65536
    async with running_gateway(make_config(limits={"send_buffer_bytes": limit}), ScriptedEngine()) as gw:
        runner = SessionRunner(gw, NeverReadingConnection())
        runner.apply(runner.session.open({}))
        hostile = orjson.dumps({"type": "x" * 60_000}).decode()
        peak = 0
        for _ in range(1500):
            runner.apply(runner.session.receive_message(hostile, 0.0))
            peak = max(peak, runner.outbox.queued_bytes)
        assert peak <= limit
        assert runner.session.closed
        assert 'tts_errors_total{code="overloaded"} 1.0' in gw.metrics.render().decode()


# ------------------------------------------------------------------ utterances that fail to open


@pytest.mark.parametrize("voice", ["refused", "broken"])
async def test_an_utterance_that_fails_to_open_ends_its_context_only(voice):
    async with running_gateway(make_config(), ScriptedEngine()) as gw:
        for _ in range(5):
            async with connect(ws_url(gw)) as ws:
                await recv_json(ws)
                await ws.send(text("bad", "Hello there.", voice=voice))
                await ws.send(text("bad", " More text."))
                await ws.send(end("bad"))
                error = await recv_json(ws)
                assert error["type"] == "error" and error["code"] == "internal" and error["context_id"] == "bad"
                # The session carries on: the next context is spoken in full.
                await ws.send(text("good", "Hello there."))
                await ws.send(end("good"))
                while (frame := (await read_context(ws))[2])["context_id"] != "good":
                    pass
                assert frame["type"] == "done"
        metrics = gw.metrics.render().decode()
        assert "tts_active_contexts 0.0" in metrics
        assert 'tts_contexts_total{outcome="error"} 5.0' in metrics
