"""The real gateway (Piper voice) over loopback: protocol, limits, errors, cancel, metrics."""

from __future__ import annotations

import asyncio
import socket
import time
import urllib.error
import urllib.request

import numpy as np
import orjson
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from tts_gateway.engine.base import AudioChunk, EngineError, Utterance, UtteranceOptions
from tts_gateway.gateway.audio import decode
from tts_gateway.gateway.client import TTSClient
from tts_gateway.gateway.server import Gateway
from tts_gateway.gateway.wire import BYTES_PER_SAMPLE

from tests.conftest import StubEngine, eventually, make_config, running_gateway, until, ws_url


SENTENCE = "Hello there! The total is $3.50, due May 5th."
LONG_TEXT = " ".join(
    [
        "Here is the plan for the week.",
        "On Monday we review the budget and the open questions from the last meeting.",
        "On Tuesday the design team presents three options for the new landing page.",
        "On Wednesday we pick one, and on Thursday we start building it together.",
        "Friday is for testing, fixing what broke, and writing down what we learned.",
    ]
    * 3
)


def deltas(text: str, size: int = 3) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


async def recv_json(ws, timeout: float = 10.0) -> dict:
    while True:
        message = await until(ws.recv(), timeout)
        if isinstance(message, str):
            return orjson.loads(message)


async def read_context(ws, timeout: float = 30.0) -> tuple[list[dict], bytes, dict]:
    """Read frames until done/cancelled/error; check every audio header's pairing."""
    headers, audio = [], bytearray()
    while True:
        message = await until(ws.recv(), timeout)
        assert isinstance(message, str), "binary frame without an audio header"
        frame = orjson.loads(message)
        if frame["type"] == "audio":
            payload = await until(ws.recv(), timeout)
            assert isinstance(payload, bytes) and len(payload) == frame["bytes"]
            headers.append(frame)
            audio += payload
        elif frame["type"] in ("done", "cancelled", "error"):
            return headers, bytes(audio), frame


def rms(samples: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(samples)))) if samples.size else 0.0


async def http_get(url: str, headers: dict | None = None) -> tuple[int, bytes, str]:
    def fetch():
        request = urllib.request.Request(url, headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, response.read(), response.headers.get("Content-Type", "")
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read(), exc.headers.get("Content-Type", "")

    return await asyncio.to_thread(fetch)


# ------------------------------------------------------------------ speaking


async def test_agent_streams_deltas_and_gets_the_whole_sentence(gateway):
    async with connect(ws_url(gateway)) as ws:
        ready = await recv_json(ws)
        assert ready["type"] == "ready" and ready["protocol"] == 1 and ready["voice"] == "joe"
        assert ready["sample_rate"] == 24000 and ready["encoding"] == "pcm_s16le"
        assert ready["voices"][0]["id"] == "joe"
        for delta in deltas(SENTENCE):
            await ws.send(orjson.dumps({"type": "text", "context_id": "c1", "text": delta}).decode())
        await ws.send('{"type":"end","context_id":"c1"}')
        headers, audio, done = await read_context(ws)
    assert done["type"] == "done" and done["context_id"] == "c1"
    assert [h["seq"] for h in headers] == list(range(len(headers)))
    offset = 0.0
    for header in headers:
        assert header["offset_ms"] == pytest.approx(offset, abs=0.2)
        offset += header["duration_ms"]
    samples = decode(audio, "pcm_s16le")
    seconds = len(samples) / 24000
    assert done["audio_ms"] == pytest.approx(seconds * 1000, abs=1)
    # "Hello there! The total is three dollars and fifty cents, due May fifth." spoken
    # at a normal rate lasts about 3.5-5 s; silence or a truncated reading would not.
    assert 2.5 < seconds < 7.0
    assert rms(samples) > 0.03
    assert 0 < done["ttfa_ms"] < 5000


@pytest.mark.parametrize("encoding", ["pcm_s16le", "pcm_f32le", "mulaw"])
@pytest.mark.parametrize("rate", [8000, 16000, 22050, 24000, 44100, 48000])
async def test_formats_and_rates(gateway, encoding, rate):
    text = "Testing one, two, three."
    async with connect(ws_url(gateway)) as ws:
        await recv_json(ws)
        await ws.send(orjson.dumps({"type": "text", "text": text, "sample_rate": rate, "encoding": encoding}).decode())
        await ws.send('{"type":"end"}')
        headers, audio, done = await read_context(ws)
    assert done["type"] == "done"
    assert len(audio) % BYTES_PER_SAMPLE[encoding] == 0
    samples = decode(audio, encoding)
    seconds = len(samples) / rate
    assert done["audio_ms"] == pytest.approx(seconds * 1000, abs=1)
    assert sum(h["duration_ms"] for h in headers) == pytest.approx(seconds * 1000, abs=1)
    assert 1.0 < seconds < 3.5
    assert 0.03 < rms(samples) < 0.5
    # Speech energy sits below 4 kHz; a broken resampler or encoder shows as noise or silence.
    spectrum = np.abs(np.fft.rfft(samples))
    freqs = np.fft.rfftfreq(len(samples), 1 / rate)
    assert spectrum[(freqs > 80) & (freqs < 4000)].sum() > 0.6 * spectrum.sum()


async def test_client_library_speaks_through_the_gateway(gateway):
    async with TTSClient.connect(ws_url(gateway), sample_rate=16000) as tts:
        reply = tts.context()
        audio = await until(reply.speak(deltas(SENTENCE, 5)), 30)
        assert reply.done is not None and reply.done.audio_ms == pytest.approx(len(audio) / 2 / 16, abs=1)


async def test_contexts_interleave_on_one_socket(gateway):
    async with connect(ws_url(gateway)) as ws:
        await recv_json(ws)
        for cid in ("a", "b"):
            await ws.send(orjson.dumps({"type": "text", "context_id": cid, "text": LONG_TEXT[:400]}).decode())
            await ws.send(orjson.dumps({"type": "end", "context_id": cid}).decode())
        order, seqs, words, done = [], {"a": [], "b": []}, {"a": [], "b": []}, set()
        while done != {"a", "b"}:
            frame = orjson.loads(await until(ws.recv(), 30))
            if frame["type"] == "audio":
                assert isinstance(await until(ws.recv(), 10), bytes)
                order.append(frame["context_id"])
                seqs[frame["context_id"]].append(frame["seq"])
            elif frame["type"] == "done":
                done.add(frame["context_id"])
            elif frame["type"] == "alignment":
                words[frame["context_id"]] += [word["text"] for word in frame["words"]]
            else:
                pytest.fail(f"unexpected frame {frame}")
    assert seqs["a"] == list(range(len(seqs["a"]))) and seqs["b"] == list(range(len(seqs["b"])))
    # Each context's word timings are its own words, whatever the interleaving.
    assert words["a"] == words["b"] == LONG_TEXT[:400].split()
    # Both are spoken at once: b's audio starts before a's has all been sent.
    assert order.index("b") < len(order) - 1 - order[::-1].index("a")


# ------------------------------------------------------------------ cancel and disconnect


async def test_cancel_mid_stream_sends_no_audio_after_cancelled_and_frees_work(gateway):
    engine = gateway.engine
    async with connect(ws_url(gateway)) as ws:
        await recv_json(ws)
        await ws.send(orjson.dumps({"type": "text", "context_id": "c", "text": LONG_TEXT}).decode())
        await ws.send('{"type":"end","context_id":"c"}')
        first = await recv_json(ws)
        assert first["type"] == "audio"
        await ws.send('{"type":"cancel","context_id":"c"}')
        frames = []
        while True:
            message = await until(ws.recv(), 10)
            frames.append(message)
            if isinstance(message, str) and orjson.loads(message)["type"] == "cancelled":
                break
        # Nothing more for this context, however long we listen.
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(ws.recv(), 1.0)
        stats = engine.stats()
        assert (stats.utterances, stats.queued, stats.running) == (0, 0, 0)
        # The context id is free again.
        await ws.send('{"type":"text","context_id":"c","text":"Again."}')
        await ws.send('{"type":"end","context_id":"c"}')
        headers, _, done = await read_context(ws)
        assert done["type"] == "done" and headers[0]["seq"] == 0


async def test_disconnect_mid_stream_frees_engine_work(gateway):
    engine = gateway.engine
    ws = await connect(ws_url(gateway))
    await recv_json(ws)
    await ws.send(orjson.dumps({"type": "text", "text": LONG_TEXT}).decode())
    await ws.send('{"type":"end"}')
    assert (await recv_json(ws))["type"] == "audio"
    assert engine.stats().utterances == 1
    ws.transport.abort()  # the client vanishes without a close handshake
    await eventually(lambda: engine.stats().utterances == 0 and engine.stats().running == 0)
    assert engine.stats().queued == 0
    await eventually(lambda: not gateway.sessions)


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "messages, code",
    [
        (["{oops"], "bad_message"),
        (['{"type":"text","text":"x","voice":"nobody"}'], "unknown_voice"),
        (['{"type":"text","text":"x","encoding":"opus"}'], "unsupported_format"),
        ([orjson.dumps({"type": "text", "text": "x" * 20_001}).decode()], "text_too_long"),
        (['{"type":"end","context_id":"nope"}'], "unknown_context"),
        ([orjson.dumps({"type": "text", "context_id": f"c{i}", "text": "Hi."}).decode() for i in range(9)], "too_many_contexts"),
    ],
)
async def test_error_frames_keep_the_socket_usable(gateway, messages, code):
    async with connect(ws_url(gateway)) as ws:
        await recv_json(ws)
        for message in messages:
            await ws.send(message)
        while (frame := await recv_json(ws))["type"] != "error":
            pass
        assert frame["code"] == code and frame["message"]
        if code == "too_many_contexts":
            await ws.send('{"type":"cancel","context_id":"c0"}')  # make room
        await ws.send('{"type":"text","context_id":"fresh","text":"Still here."}')
        await ws.send('{"type":"end","context_id":"fresh"}')
        while not ((frame := await recv_json(ws))["type"] == "done" and frame["context_id"] == "fresh"):
            pass


async def test_bad_session_defaults_are_refused(gateway):
    async with connect(ws_url(gateway, "sample_rate=12345")) as ws:
        frame = await recv_json(ws)
        assert frame["type"] == "error" and frame["code"] == "unsupported_format"
        with pytest.raises(ConnectionClosed) as closed:
            await until(ws.recv())
        assert closed.value.rcvd.code == 1008


async def test_overloaded_closes_with_1013(piper_engine):
    async with running_gateway(make_config(limits={"max_sessions": 1}), piper_engine) as gw:
        async with connect(ws_url(gw)) as first:
            assert (await recv_json(first))["type"] == "ready"
            async with connect(ws_url(gw)) as second:
                frame = await recv_json(second)
                assert frame["type"] == "error" and frame["code"] == "overloaded"
                with pytest.raises(ConnectionClosed) as closed:
                    await until(second.recv())
                assert closed.value.rcvd.code == 1013


async def test_idle_socket_is_closed(piper_engine):
    async with running_gateway(make_config(limits={"idle_timeout_s": 0.3}), piper_engine) as gw:
        async with connect(ws_url(gw)) as ws:
            await recv_json(ws)
            frame = await recv_json(ws, timeout=5)
            assert frame["type"] == "error" and frame["code"] == "idle_timeout"
            with pytest.raises(ConnectionClosed):
                await until(ws.recv())


async def _keep_alive(ws, how: str, seconds: float) -> None:
    """Nothing but pings, or nothing but `keepalive` messages, every 0.1 s for ``seconds``."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while loop.time() < end:
        if how == "ping":
            await ws.ping()
        else:
            await ws.send('{"type":"keepalive"}')
        await asyncio.sleep(0.1)


@pytest.mark.parametrize("how", ["ping", "keepalive"])
async def test_pings_or_keepalives_alone_keep_a_quiet_session_open(piper_engine, how):
    async with running_gateway(make_config(limits={"idle_timeout_s": 0.4}), piper_engine) as gw:
        async with connect(ws_url(gw), ping_interval=None) as ws:  # no pings of the library's own
            await recv_json(ws)
            keeping = asyncio.create_task(_keep_alive(ws, how, 1.2))  # three idle timeouts
            with pytest.raises(TimeoutError):  # nothing comes: no idle_timeout
                await asyncio.wait_for(ws.recv(), 1.3)
            await keeping
            assert len(gw.sessions) == 1
            # Still a working session.
            await ws.send('{"type":"text","text":"Still here."}')
            await ws.send('{"type":"end"}')
            _, _, done = await read_context(ws)
            assert done["type"] == "done"
            # Once the client falls silent, the timeout closes it.
            frame = await recv_json(ws, timeout=5)
            assert frame["type"] == "error" and frame["code"] == "idle_timeout"
            assert "keepalive" in frame["message"]
            with pytest.raises(ConnectionClosed) as closed:
                await until(ws.recv())
            assert closed.value.rcvd.code == 1000


async def test_the_client_chooses_its_inactivity_timeout_within_the_bound(gateway):
    async with connect(ws_url(gateway, "inactivity_timeout=0.3"), ping_interval=None) as ws:
        await recv_json(ws)
        frame = await recv_json(ws, timeout=5)  # long before the gateway's own 60 s
        assert frame["type"] == "error" and frame["code"] == "idle_timeout"
    async with connect(ws_url(gateway, "inactivity_timeout=181")) as ws:
        frame = await recv_json(ws)
        assert frame["code"] == "bad_message" and "at most 180" in frame["message"]
        with pytest.raises(ConnectionClosed) as closed:
            await until(ws.recv())
        assert closed.value.rcvd.code == 1008


async def test_the_python_client_pings_a_quiet_session_open(gateway):
    async with TTSClient.connect(ws_url(gateway), inactivity_timeout=0.4) as tts:
        await asyncio.sleep(1.2)  # three of its inactivity timeouts, without a message
        audio = await until(tts.context().speak("Still here."), 30)
        assert audio and not tts.closed


class _FailingEngine(StubEngine):
    """Speaks nothing: every utterance fails once text arrives."""

    name = "failing"

    def open_utterance(self, options: UtteranceOptions) -> Utterance:
        return _FailingUtterance()


class _FailingUtterance(Utterance):
    def __init__(self):
        self._text = asyncio.Event()

    def push_text(self, text):
        self._text.set()

    def flush(self):
        pass

    def end_input(self):
        pass

    def cancel(self):
        pass

    async def __aiter__(self):
        await self._text.wait()
        yield AudioChunk(np.zeros(160, np.float32))
        raise EngineError("the model crashed")


async def test_engine_failure_is_reported_as_internal():
    async with running_gateway(make_config(), _FailingEngine()) as gw:
        async with connect(ws_url(gw)) as ws:
            await recv_json(ws)
            await ws.send('{"type":"text","context_id":"c","text":"Hi"}')
            _, _, frame = await read_context(ws)
            assert frame == {
                "type": "error",
                "code": "internal",
                "message": "speech generation failed: the model crashed",
                "context_id": "c",
            }
            await ws.send('{"type":"end","context_id":"c"}')  # the context is gone
            assert (await recv_json(ws))["code"] == "unknown_context"


async def test_oversized_message_closes_with_1009(gateway):
    async with connect(ws_url(gateway), max_size=None) as ws:
        await recv_json(ws)
        await ws.send("x" * 70_000)
        with pytest.raises(ConnectionClosed) as closed:
            await until(ws.recv())
        assert closed.value.rcvd.code == 1009


async def test_slow_reader_is_cut_off_without_slowing_others(piper_engine):
    config = make_config(limits={"send_buffer_bytes": 1_000_000})
    async with running_gateway(config, piper_engine) as gw:
        # A client that stops reading: a one-frame receive queue and tiny TCP buffers.
        stuck = await connect(ws_url(gw, "sample_rate=48000&encoding=pcm_f32le"), max_queue=1)
        stuck.transport.set_write_buffer_limits(high=0)
        sock = stuck.transport.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        await stuck.send(orjson.dumps({"type": "text", "text": LONG_TEXT}).decode())
        await stuck.send('{"type":"end"}')
        # Meanwhile a well-behaved client is served in full.
        async with connect(ws_url(gw)) as good:
            await recv_json(good)
            await good.send('{"type":"text","text":"I am still being served."}')
            await good.send('{"type":"end"}')
            _, _, done = await read_context(good)
            assert done["type"] == "done", done
        await eventually(lambda: len(gw.sessions) == 0, timeout=20)
        assert piper_engine.stats().utterances == 0
        metrics = gw.metrics.render().decode()
        assert 'tts_errors_total{code="overloaded"} 1.0' in metrics
        stuck.transport.abort()


async def test_drain_lets_running_contexts_finish(piper_engine):
    async with running_gateway(make_config(), piper_engine) as gw:
        base = f"http://127.0.0.1:{gw.port}"
        async with connect(ws_url(gw)) as ws, connect(ws_url(gw)) as idle:
            await recv_json(ws)
            await recv_json(idle)
            await ws.send('{"type":"text","text":"Finishing this sentence before shutdown."}')
            await ws.send('{"type":"end"}')
            assert (await recv_json(ws))["type"] == "audio"  # the context is running
            assert isinstance(await until(ws.recv()), bytes)
            drain = asyncio.create_task(gw.drain(timeout=10))
            # A session without a running context goes at once, to reconnect elsewhere.
            with pytest.raises(ConnectionClosed) as closed:
                await until(idle.recv())
            assert closed.value.rcvd.code == 1001
            # Meanwhile a balancer's probe reads 503 and a new session is refused with 503.
            assert (await http_get(base + "/readyz"))[:2] == (503, b"draining\n")
            with pytest.raises(InvalidStatus) as refused:
                await connect(ws_url(gw), open_timeout=2)
            assert refused.value.response.status_code == 503
            _, _, done = await read_context(ws)
            assert done["type"] == "done"
            with pytest.raises(ConnectionClosed) as closed:
                await until(ws.recv())
            assert closed.value.rcvd.code == 1001
            await until(drain)


async def test_readyz_is_503_while_the_gateway_is_full(piper_engine):
    async with running_gateway(make_config(limits={"max_sessions": 2}), piper_engine) as gw:
        base = f"http://127.0.0.1:{gw.port}"
        async with connect(ws_url(gw)) as first:
            await recv_json(first)
            assert (await http_get(base + "/readyz"))[0] == 200
            async with connect(ws_url(gw)) as second:
                await recv_json(second)
                assert (await http_get(base + "/readyz"))[:2] == (503, b"at capacity\n")
            await eventually(lambda: len(gw.sessions) == 1)
            assert (await http_get(base + "/readyz"))[0] == 200


# ------------------------------------------------------------------ auth and HTTP


async def test_auth_accepts_header_or_query_and_refuses_others(piper_engine):
    async with running_gateway(make_config(auth={"api_keys": ("k-secret", "k-other")}), piper_engine) as gw:
        for bad in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic k-secret"}):
            with pytest.raises(InvalidStatus) as refused:
                await connect(ws_url(gw), additional_headers=bad)
            assert refused.value.response.status_code == 401
        with pytest.raises(InvalidStatus):
            await connect(ws_url(gw, "api_key=nope"))
        async with connect(ws_url(gw), additional_headers={"Authorization": "Bearer k-other"}) as ws:
            assert (await recv_json(ws))["type"] == "ready"
        async with TTSClient.connect(ws_url(gw), api_key="k-secret", use_header=False) as tts:
            assert tts.ready["type"] == "ready"
        base = f"http://127.0.0.1:{gw.port}"
        assert (await http_get(base + "/metrics"))[0] == 401
        assert (await http_get(base + "/v1/voices"))[0] == 401
        assert (await http_get(base + "/metrics", {"Authorization": "Bearer k-secret"}))[0] == 200
        assert (await http_get(base + "/healthz"))[0] == 200


async def test_http_routes(gateway):
    base = f"http://127.0.0.1:{gateway.port}"
    assert (await http_get(base + "/healthz"))[:2] == (200, b"ok\n")
    assert (await http_get(base + "/readyz"))[:2] == (200, b"ready\n")
    status, body, content_type = await http_get(base + "/v1/voices")
    assert status == 200 and content_type == "application/json"
    assert orjson.loads(body) == {
        "voices": [{"id": "joe", "name": "joe", "language": "en-US", "engine": "piper"}],
        "default": "joe",
    }
    status, body, content_type = await http_get(base + "/")
    assert status == 200 and content_type.startswith("text/html") and b"/v1/stream" in body + (
        await http_get(base + "/app.js")
    )[1]
    assert (await http_get(base + "/nope.html"))[0] == 404
    assert (await http_get(base + "/../pyproject.toml"))[0] == 404
    assert (await http_get(base + "/%2e%2e/pyproject.toml"))[0] == 404


async def test_readyz_is_503_until_the_engine_is_warm():
    class SlowStart(_FailingEngine):
        def __init__(self):
            self.started, self.release = asyncio.Event(), asyncio.Event()

        async def start(self):
            self.started.set()
            await self.release.wait()

    engine = SlowStart()
    gw = Gateway(make_config(), engine)
    starting = asyncio.create_task(gw.start())
    try:
        await until(engine.started.wait())
        base = f"http://127.0.0.1:{gw.port}"
        assert (await http_get(base + "/healthz"))[0] == 200
        assert (await http_get(base + "/readyz"))[0] == 503
        with pytest.raises(InvalidStatus) as refused:
            await connect(ws_url(gw))
        assert refused.value.response.status_code == 503
        engine.release.set()
        await until(starting)
        assert (await http_get(base + "/readyz"))[0] == 200
    finally:
        await gw.stop()


async def test_readyz_is_503_once_the_engine_has_failed(gateway, monkeypatch):
    """A dead backend (e.g. the vLLM engine process) takes the gateway out of rotation."""
    base = f"http://127.0.0.1:{gateway.port}"
    monkeypatch.setattr(gateway.engine, "failure", lambda: "the backend process has died")
    status, body, _ = await http_get(base + "/readyz")
    assert status == 503 and b"the backend process has died" in body
    monkeypatch.undo()
    assert (await http_get(base + "/readyz"))[0] == 200


async def test_metrics_are_exposed(gateway):
    async with TTSClient.connect(ws_url(gateway)) as tts:
        await until(tts.context().speak("Counting this one."), 30)
    status, body, content_type = await http_get(f"http://127.0.0.1:{gateway.port}/metrics")
    text = body.decode()
    assert status == 200 and content_type.startswith("text/plain")
    for line in (
        "tts_time_to_first_audio_seconds_count 1.0",
        'tts_contexts_total{outcome="done"} 1.0',
        "tts_sessions_total 1.0",
        "tts_active_sessions 0.0",
        "tts_active_contexts 0.0",
        'tts_engine_queue_depth{engine="piper"} 0.0',
        "tts_engine_ready 1.0",
        "tts_real_time_factor_count 1.0",
        "tts_playback_stalls_total",
        "tts_playback_stall_seconds_total",
    ):
        assert line in text, line
    [sent] = [float(line.split()[1]) for line in text.splitlines() if line.startswith("tts_audio_sent_seconds_total ")]
    assert 0.5 < sent < 3.0


async def test_event_loop_lag_is_measured(gateway):
    """A loop blocked for 300 ms shows up in tts_event_loop_lag_seconds (every session waited that long)."""
    registry = gateway.metrics.registry
    before = registry.get_sample_value("tts_event_loop_lag_seconds_sum") or 0.0
    await asyncio.sleep(0.1)
    time.sleep(0.3)  # what a CPU-bound callback on the loop does to everyone

    await eventually(lambda: registry.get_sample_value("tts_event_loop_lag_seconds_sum") - before >= 0.25, 5)
    status, body, _ = await http_get(f"http://127.0.0.1:{gateway.port}/metrics")
    assert b'tts_event_loop_lag_seconds_bucket{le="0.5"}' in body


async def test_fixed_voice_engine_refuses_voice_registration(gateway):
    import aiohttp

    form = aiohttp.FormData()
    form.add_field("name", "x"), form.add_field("text", "words")
    form.add_field("audio", b"RIFF....", filename="p.wav", content_type="audio/wav")
    async with aiohttp.ClientSession() as http:
        async with http.post(f"http://127.0.0.1:{gateway.port}/v1/voices", data=form) as response:
            assert response.status == 501
            assert (await response.json())["error"]["code"] == "not_supported"
