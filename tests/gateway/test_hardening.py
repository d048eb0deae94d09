"""The gateway facing hostile or unlucky input: clients that never read their errors, and
engines that refuse an utterance."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
from types import SimpleNamespace

import numpy as np
import orjson
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from tts_gateway.engine.base import AudioChunk, EngineError, Utterance, UtteranceOptions
from tts_gateway.gateway.auth import ANONYMOUS, Caller
from tts_gateway.gateway.server import SessionRunner

from tests.conftest import StubEngine, make_config, running_gateway, until, ws_url
from tests.gateway.test_http_api import post
from tests.gateway.test_server import http_get, read_context, recv_json


class ScriptedEngine(StubEngine):
    """Voice ``ok`` speaks a short tone per utterance; ``refused`` fails to open with an
    EngineError (as CosyVoice2 does for a voice it cannot load), ``broken`` with a bug."""

    name = "scripted"
    voice_ids = ("ok", "refused", "broken", "fails-mid-reply", "fails-at-once")

    def open_utterance(self, options: UtteranceOptions) -> Utterance:
        if options.voice == "refused":
            raise EngineError("cannot load voice 'refused'")
        if options.voice == "broken":
            raise RuntimeError("a bug in the engine")
        failing = {"fails-mid-reply": 1, "fails-at-once": 0}.get(options.voice)
        return ToneUtterance() if failing is None else FailingUtterance(failing)


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


class FailingUtterance(ToneUtterance):
    """Speaks ``chunks`` tone chunks, then its engine fails."""

    def __init__(self, chunks: int):
        super().__init__()
        self.chunks = chunks

    async def __aiter__(self):
        await self._ended.wait()
        for _ in range(self.chunks):
            yield AudioChunk(np.full(1600, 0.1, np.float32))
        raise EngineError("the engine failed mid-reply")


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
        self.caller = Caller(ANONYMOUS)


async def test_error_frames_count_against_the_send_buffer():
    """1,500 hostile frames from a client that reads nothing: what waits for it stays within
    send_buffer_bytes, and it is cut off as a client not reading."""
    limit = 65536
    async with running_gateway(make_config(limits={"send_buffer_bytes": limit}), ScriptedEngine()) as gw:
        runner = SessionRunner(gw, NeverReadingConnection())
        runner.apply(runner.session.open({}, 0.0))
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


# ------------------------------------------------------------------ an engine that can serve no more


class FailingScriptedEngine(ScriptedEngine):
    """A ScriptedEngine whose backend dies when the test says: its utterances then hang, as
    they do behind a dead or stuck stage, and ``failure()`` says why."""

    def __init__(self) -> None:
        self.dead: str | None = None

    def failure(self) -> str | None:
        return self.dead

    def open_utterance(self, options: UtteranceOptions) -> Utterance:
        return HangingUtterance()


class HangingUtterance(ToneUtterance):
    async def __aiter__(self):
        await asyncio.Event().wait()
        yield  # pragma: no cover


async def test_a_failed_engine_ends_every_context_and_session_and_refuses_new_ones():
    engine = FailingScriptedEngine()
    async with running_gateway(make_config(), engine) as gw:
        first, second = await connect(ws_url(gw)), await connect(ws_url(gw))
        for ws, contexts in ((first, ("a", "b")), (second, ("c",))):
            await recv_json(ws)
            for context_id in contexts:
                await ws.send(text(context_id, "Hello there."))
        await asyncio.sleep(0.1)
        engine.dead = "the backend process has died"
        for ws, contexts in ((first, ("a", "b")), (second, ("c",))):
            errors = [await recv_json(ws, timeout=2) for _ in range(len(contexts) + 1)]
            assert {e["code"] for e in errors} == {"engine_failed"}
            assert [e["context_id"] for e in errors] == [*contexts, None]
            assert "the backend process has died" in errors[-1]["message"]
            with pytest.raises(ConnectionClosed) as closed:
                await until(ws.recv(), 2)
            assert closed.value.rcvd.code == 1011
        status, body, _ = await http_get(f"http://127.0.0.1:{gw.port}/readyz")
        assert status == 503 and b"the backend process has died" in body
        status, body, _ = await post(gw, {"model": "tts-1", "input": "Hello there.", "voice": "ok"})
        assert status == 503 and orjson.loads(body)["error"]["code"] == "engine_failed"
        async with connect(ws_url(gw)) as late:
            refusal = await recv_json(late)
            assert refusal["code"] == "engine_failed" and refusal["context_id"] is None
            with pytest.raises(ConnectionClosed) as closed:
                await until(late.recv(), 2)
            assert closed.value.rcvd.code == 1011
        metrics = gw.metrics.render().decode()
        assert "tts_active_contexts 0.0" in metrics and "tts_engine_ready 0.0" in metrics


class DyingBackendEngine(ScriptedEngine):
    """Its backend dies as a process does: every open utterance raises at once, and
    ``failure()`` already says so when they do."""

    def __init__(self) -> None:
        self.dead: str | None = None
        self.died = asyncio.Event()

    def failure(self) -> str | None:
        return self.dead

    def open_utterance(self, options: UtteranceOptions) -> Utterance:
        return DyingUtterance(self)


class DyingUtterance(ToneUtterance):
    def __init__(self, engine: DyingBackendEngine):
        super().__init__()
        self.engine = engine

    async def __aiter__(self):
        await self.engine.died.wait()
        raise EngineError("the backend process has died")
        yield  # pragma: no cover


async def test_replies_failing_because_the_backend_died_end_with_engine_failed_not_internal():
    """The failed streams reach the sessions before the engine watcher looks again; each
    session's error still says the engine failed, so that its client reconnects elsewhere."""
    engine = DyingBackendEngine()
    async with running_gateway(make_config(), engine) as gw:
        sockets = [await connect(ws_url(gw)) for _ in range(3)]
        for index, ws in enumerate(sockets):
            await recv_json(ws)
            await ws.send(text(f"c{index}", "Hello there."))
        await asyncio.sleep(0.1)
        engine.dead = "the backend process has died"
        engine.died.set()
        for index, ws in enumerate(sockets):
            errors = [await recv_json(ws, timeout=2) for _ in range(2)]
            assert [(e["code"], e["context_id"]) for e in errors] == [("engine_failed", f"c{index}"),
                                                                      ("engine_failed", None)]
            with pytest.raises(ConnectionClosed) as closed:
                await until(ws.recv(), 2)
            assert closed.value.rcvd.code == 1011


def test_serve_exits_non_zero_after_the_engine_fails(monkeypatch, tmp_path, capsys):
    """`tts-gateway serve` on an engine that fails: it drains, stops and exits 1, so that its
    supervisor restarts it."""
    from tts_gateway.engine import registry
    from tts_gateway.gateway import cli

    class DyingEngine(FailingScriptedEngine):
        async def start(self):
            loop = asyncio.get_running_loop()
            loop.call_later(0.3, setattr, self, "dead", "the backend process has died")
            # A gateway that did not notice is stopped as an operator would stop it (exit 0).
            loop.call_later(10, os.kill, os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(registry, "create_engine", lambda name, settings: DyingEngine())
    config = tmp_path / "config.toml"
    config.write_text('[server]\nport = 0\n')
    assert cli.main(["serve", "--config", str(config)]) == 1
    assert "the backend process has died" in capsys.readouterr().err


async def test_a_client_cut_off_as_its_context_finishes_leaves_no_context_counted():
    """The cut-off comes from the frames that finish a context (its last audio, its done):
    the context is still counted out (found by bench/soak.py as tts_active_contexts > 0 after
    the traffic stopped)."""
    async with running_gateway(make_config(), ScriptedEngine()) as gw:
        runner = SessionRunner(gw, NeverReadingConnection())
        runner.apply(runner.session.open({}, 0.0))
        runner.apply(runner.session.receive_message(text("c", "Hello there."), 0.0))
        (context,) = runner.session.contexts.values()
        runner.apply(runner.session.audio_ready(context.key, np.full(1600, 0.1, np.float32), (), 0.0, 0.0))
        runner.outbox._limit = runner.outbox.queued_bytes  # the send buffer is full to the byte
        runner.apply(runner.session.utterance_finished(context.key, 0.0))
        assert runner.session.closed  # cut off
        assert "tts_active_contexts 0.0" in gw.metrics.render().decode()


async def test_hostile_frames_from_a_socket_that_never_reads_stay_within_the_send_buffer():
    """The issue's reproduction over a real socket, shortened: a client that never reads sends
    frames of an unknown 60,000-character type. The gateway never holds more than its send
    buffer for it (before: every error echoed the type; 1,500 frames grew the gateway by 120 MB)."""
    limit = 65536
    async with running_gateway(make_config(limits={"send_buffer_bytes": limit}), ScriptedEngine()) as gw:
        stuck = await connect(ws_url(gw), max_queue=1)
        stuck.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        hostile = orjson.dumps({"type": "x" * 60_000}).decode()
        peak = 0
        with contextlib.suppress(ConnectionClosed):
            for _ in range(100):
                await stuck.send(hostile)
                peak = max([peak, *(runner.outbox.queued_bytes for runner in gw.sessions)])
        assert peak <= limit
        stuck.transport.abort()


# ------------------------------------------------------------------ the speech route


async def test_a_speech_request_that_fails_never_looks_complete():
    """Before any audio a failure is a 500 with the JSON error; after audio has gone out, the
    body is cut before its last chunk, so the client reads an error, not a short success."""
    import aiohttp

    async with running_gateway(make_config(), ScriptedEngine()) as gw:
        url = f"http://127.0.0.1:{gw.port}/v1/audio/speech"
        async with aiohttp.ClientSession() as http:
            body = {"input": "Hello.", "voice": "fails-at-once", "response_format": "pcm"}
            async with http.post(url, json=body) as response:
                assert response.status == 500
                assert (await response.json())["error"]["code"] == "internal"
            body = {"input": "Hello.", "voice": "fails-mid-reply", "response_format": "pcm"}
            async with http.post(url, json=body) as response:
                assert response.status == 200
                with pytest.raises(aiohttp.ClientPayloadError):
                    await response.read()
            body = {"input": "Hello.", "voice": "ok", "response_format": "pcm"}
            async with http.post(url, json=body) as response:  # the gateway serves on
                assert response.status == 200 and len(await response.read()) > 0
