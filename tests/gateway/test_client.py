"""The agent client (gateway/client/) against a throwaway fake gateway.

The fake speaks just enough of protocol v1 to exercise the client: scripted
handlers send exact frame sequences; ``echo_gateway`` answers every `text` with
one audio chunk holding the text's UTF-8 bytes, so audio is easy to check.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import time
import wave
from collections.abc import AsyncIterator, Awaitable, Callable

import orjson
import pytest
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import InvalidStatus

from tts_gateway.gateway.client import Alignment, AudioChunk, Context, GatewayError, TTSClient, Word, write_wav
from tts_gateway.gateway.wire import CONTEXT_SURVIVING_CODES, SESSION_ENDING_CODES, ErrorCode
from tests.paths import ROOT


READY = {
    "type": "ready",
    "protocol": 1,
    "session_id": "s-1",
    "voice": "joe",
    "sample_rate": 24000,
    "encoding": "pcm_s16le",
    "voices": [{"id": "joe", "name": "Joe", "language": "en-US", "engine": "piper"}],
}

Handler = Callable[[ServerConnection], Awaitable[None]]


@contextlib.asynccontextmanager
async def fake_gateway(handler: Handler, process_request=None) -> AsyncIterator[str]:
    """Serve ``handler`` on a free local port; yields the stream URL."""
    async with serve(handler, "127.0.0.1", 0, process_request=process_request, compression=None) as server:
        port = server.sockets[0].getsockname()[1]
        yield f"ws://127.0.0.1:{port}/v1/stream"


async def send_json(ws: ServerConnection, **frame) -> None:
    await ws.send(orjson.dumps(frame).decode())


async def send_audio(ws: ServerConnection, context_id: str, seq: int, data: bytes) -> None:
    await send_json(
        ws, type="audio", context_id=context_id, seq=seq, offset_ms=seq * 10.0, duration_ms=10.0, bytes=len(data)
    )
    await ws.send(data)


async def receive_json(ws: ServerConnection) -> dict:
    return orjson.loads(await ws.recv())


async def echo_gateway(ws: ServerConnection, received: list[dict] | None = None, cancel_delay: float = 0.0) -> None:
    """One audio chunk per `text` (the text's bytes); `done` on end; `cancelled` on cancel.

    ``cancel_delay`` holds back the `cancelled` answer, as a distant gateway would.
    """
    await send_json(ws, **READY)
    seqs: dict[str, int] = {}
    async for raw in ws:
        message = orjson.loads(raw)
        if received is not None:
            received.append(message)
        context_id = message.get("context_id", "default")
        if message["type"] == "text":
            seq = seqs.setdefault(context_id, 0)
            seqs[context_id] += 1
            await send_audio(ws, context_id, seq, message["text"].encode())
        elif message["type"] == "end":
            await send_json(ws, type="done", context_id=context_id, audio_ms=seqs.pop(context_id) * 10.0, ttfa_ms=5.0)
        elif message["type"] == "cancel":
            seqs.pop(context_id, None)
            await asyncio.sleep(cancel_delay)
            await send_json(ws, type="cancelled", context_id=context_id)


async def collect(ctx) -> list[AudioChunk]:
    return [chunk async for chunk in ctx]


# ---------------------------------------------------------------- connecting


@pytest.mark.asyncio
async def test_connect_waits_for_ready_and_sends_defaults_and_bearer_key():
    requests = []

    async def handler(ws):
        requests.append(ws.request)
        await echo_gateway(ws)

    async with fake_gateway(handler) as url:
        async with TTSClient.connect(url, api_key="k1", voice="joe", sample_rate=16000, encoding="mulaw") as tts:
            assert tts.session_id == "s-1"
            assert tts.ready["sample_rate"] == 24000
            assert [v["id"] for v in tts.voices] == ["joe"]
    request = requests[0]
    assert request.path == "/v1/stream?voice=joe&sample_rate=16000&encoding=mulaw"
    assert request.headers["Authorization"] == "Bearer k1"


@pytest.mark.asyncio
async def test_api_key_goes_in_the_query_when_headers_are_not_used():
    requests = []

    async def handler(ws):
        requests.append(ws.request)
        await echo_gateway(ws)

    async with fake_gateway(handler) as url:
        tts = await TTSClient.connect(url, api_key="k 1", use_header=False)
        await tts.close()
    assert requests[0].path == "/v1/stream?api_key=k+1"
    assert "Authorization" not in requests[0].headers


@pytest.mark.asyncio
async def test_refused_handshake_raises_invalid_status_401():
    def refuse(connection, request):
        return connection.respond(401, "unauthorized\n")

    async with fake_gateway(echo_gateway, process_request=refuse) as url:
        with pytest.raises(InvalidStatus) as refused:
            await TTSClient.connect(url, api_key="wrong")
    assert refused.value.response.status_code == 401


@pytest.mark.asyncio
async def test_session_refused_with_an_error_frame_raises_gateway_error():
    async def overloaded(ws):
        await send_json(ws, type="error", code="overloaded", message="at session cap", context_id=None)
        await ws.close(1013, "overloaded")

    async with fake_gateway(overloaded) as url:
        with pytest.raises(GatewayError) as refused:
            await TTSClient.connect(url)
    assert refused.value.code == "overloaded"
    assert refused.value.context_id is None


@pytest.mark.asyncio
async def test_a_gateway_speaking_another_protocol_version_is_refused():
    async def v2(ws):
        await send_json(ws, **{**READY, "protocol": 2})
        await ws.wait_closed()

    async with fake_gateway(v2) as url:
        with pytest.raises(GatewayError) as refused:
            await TTSClient.connect(url)
    assert refused.value.code == "protocol_error"


# ---------------------------------------------------------------- demultiplexing


@pytest.mark.asyncio
async def test_two_interleaved_contexts_are_demultiplexed():
    received = []

    async def interleaving(ws):
        await send_json(ws, **READY)
        while sum(m["type"] == "end" for m in received) < 2:  # both contexts fully sent
            received.append(await receive_json(ws))
        await send_audio(ws, "a", 0, b"a0")
        await send_audio(ws, "b", 0, b"b0")
        await send_json(ws, type="alignment", context_id="a", words=[{"text": "Hi", "start_ms": 0, "end_ms": 9.5}])
        await send_audio(ws, "a", 1, b"a1")
        await send_audio(ws, "b", 1, b"b1")
        await send_json(ws, type="done", context_id="a", audio_ms=20.0, ttfa_ms=12.5)
        await send_audio(ws, "b", 2, b"b2")
        await send_json(ws, type="done", context_id="b", audio_ms=30.0, ttfa_ms=None)
        await ws.wait_closed()

    async with fake_gateway(interleaving) as url:
        async with TTSClient.connect(url) as tts:
            a = tts.context("a", voice="joe", speed=1.25)
            b = tts.context("b", sample_rate=8000)
            for ctx in (a, b):
                await ctx.send_text("Hi ")
                await ctx.send_text("there")
                await ctx.end()
            chunks_a, chunks_b = await asyncio.gather(collect(a), collect(b))

    assert [(c.context_id, c.seq, c.data) for c in chunks_a] == [("a", 0, b"a0"), ("a", 1, b"a1")]
    assert [(c.seq, c.data, c.offset_ms) for c in chunks_b] == [(0, b"b0", 0.0), (1, b"b1", 10.0), (2, b"b2", 20.0)]
    assert a.done.audio_ms == 20.0 and a.done.ttfa_ms == 12.5
    assert b.done.ttfa_ms is None
    assert a.alignments == [Word("Hi", 0, 9.5)] and b.alignments == []
    assert not a.cancelled and not b.cancelled
    assert b.sample_rate == 8000 and a.sample_rate == 24000
    # Per-context options ride on the first text only.
    texts = [m for m in received if m["type"] == "text"]
    assert texts[0] == {"type": "text", "context_id": "a", "text": "Hi ", "voice": "joe", "speed": 1.25}
    assert texts[1] == {"type": "text", "context_id": "a", "text": "there"}
    assert texts[2] == {"type": "text", "context_id": "b", "text": "Hi ", "sample_rate": 8000}


@pytest.mark.asyncio
async def test_events_yield_word_timings_among_the_audio_in_wire_order():
    async def timed(ws):
        await send_json(ws, **READY)
        while (await receive_json(ws))["type"] != "end":
            pass
        await send_audio(ws, "a", 0, b"a0")
        await send_json(ws, type="alignment", context_id="a", words=[{"text": "Hi", "start_ms": 0, "end_ms": 9.5}])
        await send_audio(ws, "a", 1, b"a1")
        await send_json(ws, type="done", context_id="a", audio_ms=20.0, ttfa_ms=1.0)
        await ws.wait_closed()

    async with fake_gateway(timed) as url:
        async with TTSClient.connect(url) as tts:
            reply = tts.context("a")
            await reply.send_text("Hi")
            await reply.end()
            events = [event async for event in reply.events()]
    assert [type(e).__name__ for e in events] == ["AudioChunk", "Alignment", "AudioChunk"]
    assert events[1] == Alignment("a", (Word("Hi", 0, 9.5),))


@pytest.mark.asyncio
async def test_finished_context_id_can_be_reused_but_an_open_one_cannot():
    async with fake_gateway(echo_gateway) as url:
        async with TTSClient.connect(url) as tts:
            first = tts.context("c1")
            with pytest.raises(ValueError):
                tts.context("c1")
            assert await first.speak("one") == b"one"
            again = tts.context("c1")
            assert await again.speak(["tw", "o"]) == b"two"
            assert tts.context().context_id != tts.context().context_id  # automatic ids are unique


# ---------------------------------------------------------------- errors


@pytest.mark.asyncio
async def test_error_frame_raises_gateway_error_for_its_context_only():
    async def refuses_c2(ws):
        await send_json(ws, **READY)
        async for raw in ws:
            message = orjson.loads(raw)
            if message["type"] == "text" and message["context_id"] == "c2":
                await send_json(ws, type="error", code="unknown_voice", message="no voice 'x'", context_id="c2")
            elif message["type"] == "text":
                await send_audio(ws, "c1", 0, b"ok")
            elif message["type"] == "end" and message["context_id"] == "c1":
                await send_json(ws, type="done", context_id="c1", audio_ms=10.0, ttfa_ms=1.0)

    async with fake_gateway(refuses_c2) as url:
        async with TTSClient.connect(url) as tts:
            c1, c2 = tts.context("c1"), tts.context("c2", voice="x")
            await c2.send_text("Hello")
            await c1.send_text("Hello")
            await c1.end()
            with pytest.raises(GatewayError) as raised:
                await collect(c2)
            assert [c.data for c in await collect(c1)] == [b"ok"]

            assert (raised.value.code, raised.value.context_id) == ("unknown_voice", "c2")
            assert c2.finished and c2.error is raised.value
            assert await collect(c2) == []  # a refused context stays ended
            with pytest.raises(GatewayError):
                await c2.send_text("more")
            assert c1.done is not None


@pytest.mark.asyncio
async def test_text_too_long_raises_but_the_context_stays_usable():
    async def limited(ws):
        await send_json(ws, **READY)
        async for raw in ws:
            message = orjson.loads(raw)
            if message["type"] == "text" and len(message["text"]) > 5:
                await send_json(ws, type="error", code="text_too_long", message="max 5", context_id="c")
            elif message["type"] == "text":
                await send_audio(ws, "c", 0, b"short")
            elif message["type"] == "end":
                await send_json(ws, type="done", context_id="c", audio_ms=10.0, ttfa_ms=1.0)

    async with fake_gateway(limited) as url:
        async with TTSClient.connect(url) as tts:
            ctx = tts.context("c")
            await ctx.send_text("far too long")
            with pytest.raises(GatewayError) as raised:
                await collect(ctx)
            assert raised.value.code == "text_too_long" and not ctx.finished
            await ctx.send_text("short")
            await ctx.end()
            assert [c.data for c in await collect(ctx)] == [b"short"]
            assert ctx.done is not None


@pytest.mark.asyncio
async def test_a_rejected_first_text_leaves_the_options_for_the_next_one():
    received = []

    async def limited(ws):
        await send_json(ws, **READY)
        async for raw in ws:
            message = orjson.loads(raw)
            received.append(message)
            if message["type"] == "text" and len(message["text"]) > 5:  # the gateway opens no context
                await send_json(ws, type="error", code="text_too_long", message="max 5", context_id="c")
            elif message["type"] == "text":
                await send_audio(ws, "c", 0, message["text"].encode())
            elif message["type"] == "end":
                await send_json(ws, type="done", context_id="c", audio_ms=10.0, ttfa_ms=1.0)

    async with fake_gateway(limited) as url:
        async with TTSClient.connect(url) as tts:
            ctx = tts.context("c", voice="joe")
            await ctx.send_text("far too long")
            with pytest.raises(GatewayError):
                await collect(ctx)
            await ctx.send_text("ok")
            await ctx.end()
            assert [c.data for c in await collect(ctx)] == [b"ok"]
    texts = [m for m in received if m["type"] == "text"]
    assert [m.get("voice") for m in texts] == ["joe", "joe"]  # the options opened the real context


@pytest.mark.asyncio
async def test_binary_frame_without_header_raises_protocol_error():
    async def broken(ws):
        await send_json(ws, **READY)
        await receive_json(ws)
        await ws.send(b"\x00\x01")
        await ws.wait_closed()

    async with fake_gateway(broken) as url:
        async with TTSClient.connect(url) as tts:
            ctx = tts.context("c")
            await ctx.send_text("Hello")
            with pytest.raises(GatewayError) as raised:
                await collect(ctx)
    assert raised.value.code == "protocol_error"
    assert "without a preceding audio header" in raised.value.message


@pytest.mark.asyncio
async def test_audio_header_with_wrong_byte_count_raises_protocol_error():
    async def broken(ws):
        await send_json(ws, **READY)
        await receive_json(ws)
        await send_json(ws, type="audio", context_id="c", seq=0, offset_ms=0.0, duration_ms=1.0, bytes=4)
        await ws.send(b"\x00\x01")
        await ws.wait_closed()

    async with fake_gateway(broken) as url:
        async with TTSClient.connect(url) as tts:
            ctx = tts.context("c")
            await ctx.send_text("Hello")
            with pytest.raises(GatewayError) as raised:
                await collect(ctx)
    assert raised.value.code == "protocol_error"


@contextlib.asynccontextmanager
async def context_c_answered_with(*frames: dict) -> AsyncIterator[tuple[TTSClient, Context]]:
    """A session whose context "c" sent "Hello" and got ``frames`` back (an audio frame's
    ``data`` goes as its binary frame); yields the client and the context."""

    async def answers(ws):
        await send_json(ws, **READY)
        await receive_json(ws)  # the context's first text
        for frame in frames:
            if frame["type"] == "audio":
                await send_audio(ws, frame["context_id"], frame["seq"], frame["data"])
            else:
                await send_json(ws, **frame)
        await ws.wait_closed()

    async with fake_gateway(answers) as url:
        async with TTSClient.connect(url) as tts:
            ctx = tts.context("c")
            await ctx.send_text("Hello")
            yield tts, ctx


@pytest.mark.asyncio
@pytest.mark.parametrize("code", list(ErrorCode))
async def test_a_context_error_ends_the_context_exactly_when_the_wire_says(code):
    """The client reads the rule the gateway's protocol follows (gateway/wire.py, tests/gateway/test_wire.py)."""
    async with context_c_answered_with(dict(type="error", code=code, message="no", context_id="c")) as (_, ctx):
        with pytest.raises(GatewayError) as raised:
            await collect(ctx)
        assert raised.value.code == code
        assert ctx.finished == (code not in CONTEXT_SURVIVING_CODES)


@pytest.mark.asyncio
@pytest.mark.parametrize("code", list(ErrorCode))
async def test_a_session_error_ends_the_session_exactly_when_the_wire_says(code):
    async with context_c_answered_with(
        dict(type="error", code=code, message="no", context_id=None),
        dict(type="audio", context_id="c", seq=0, data=b"after"),
        dict(type="done", context_id="c", audio_ms=10.0, ttfa_ms=1.0),
    ) as (tts, ctx):
        if code in SESSION_ENDING_CODES:
            with pytest.raises(GatewayError) as raised:
                await collect(ctx)
            assert (raised.value.code, raised.value.context_id) == (code, None)
            with pytest.raises(GatewayError):
                tts.context("d")
        else:
            assert [chunk.data for chunk in await collect(ctx)] == [b"after"]
            assert tts.last_session_error.code == code


@pytest.mark.asyncio
async def test_fatal_session_error_wakes_every_context():
    async def idles_out(ws):
        await send_json(ws, **READY)
        await receive_json(ws)
        await receive_json(ws)
        await send_audio(ws, "a", 0, b"a0")
        await send_json(ws, type="error", code="idle_timeout", message="idle", context_id=None)
        await ws.close(1000, "idle timeout")

    async with fake_gateway(idles_out) as url:
        tts = await TTSClient.connect(url)
        a, b = tts.context("a"), tts.context("b")
        await a.send_text("x")
        await b.send_text("y")
        results = await asyncio.gather(collect(a), collect(b), return_exceptions=True)
        await asyncio.sleep(0.1)  # contexts wake on the error frame; the close code follows
        await tts.close()

    for result in results:
        assert isinstance(result, GatewayError)
        assert (result.code, result.context_id, result.close_code) == ("idle_timeout", None, 1000)
    with pytest.raises(GatewayError):
        tts.context("c")


@pytest.mark.asyncio
async def test_close_without_error_frame_ends_contexts_with_connection_closed():
    async def shuts_down(ws):
        await send_json(ws, **READY)
        await receive_json(ws)
        await ws.close(1001, "server shutting down")

    async with fake_gateway(shuts_down) as url:
        async with TTSClient.connect(url) as tts:
            ctx = tts.context()
            await ctx.send_text("Hello")
            with pytest.raises(GatewayError) as raised:
                await collect(ctx)
            with pytest.raises(GatewayError):
                await ctx.send_text("more")
    assert (raised.value.code, raised.value.close_code) == ("connection_closed", 1001)


# ---------------------------------------------------------------- cancel, end, speak


@pytest.mark.asyncio
async def test_cancel_ends_iteration_with_cancelled_and_drops_late_audio():
    async def talks_until_cancelled(ws):
        await send_json(ws, **READY)
        await receive_json(ws)  # the text
        for seq in range(3):
            await send_audio(ws, "c", seq, b"early")
        cancel = await receive_json(ws)
        assert cancel == {"type": "cancel", "context_id": "c"}
        await send_audio(ws, "c", 3, b"in flight")  # sent before the gateway saw the cancel
        await send_json(ws, type="cancelled", context_id="c")
        await ws.wait_closed()

    async with fake_gateway(talks_until_cancelled) as url:
        async with TTSClient.connect(url) as tts:
            ctx = tts.context("c")
            await ctx.send_text("A long answer")
            received = []
            async for chunk in ctx:
                received.append(chunk.data)
                await ctx.cancel()  # barge-in after the first chunk
    assert received == [b"early"]  # queued and in-flight audio were discarded
    assert ctx.cancelled and ctx.done is None and ctx.finished


@pytest.mark.asyncio
async def test_end_or_cancel_before_any_text_finish_locally():
    received = []

    async def recording(ws):
        await echo_gateway(ws, received)

    async with fake_gateway(recording) as url:
        async with TTSClient.connect(url) as tts:
            empty = tts.context()
            await empty.flush()
            await empty.send_text("")
            await empty.end()
            assert await collect(empty) == []
            assert empty.done.audio_ms == 0.0 and empty.done.ttfa_ms is None
            unused = tts.context()
            await unused.cancel()
            assert await collect(unused) == [] and unused.cancelled
            with pytest.raises(RuntimeError):
                await unused.send_text("late")
    assert received == []


@pytest.mark.asyncio
async def test_speak_streams_async_deltas_while_audio_comes_back():
    received = []

    async def recording(ws):
        await echo_gateway(ws, received)

    async def llm():
        for delta in ["Hel", "lo, w", "orld", "!"]:
            await asyncio.sleep(0.01)
            yield delta

    async with fake_gateway(recording) as url:
        async with TTSClient.connect(url) as tts:
            ctx = tts.context(speed=0.8)
            assert await ctx.speak(llm()) == b"Hello, world!"
            assert ctx.done is not None and ctx.done.ttfa_ms == 5.0
    assert [m["type"] for m in received] == ["text"] * 4 + ["end"]
    assert received[0]["speed"] == 0.8 and "speed" not in received[1]


@pytest.mark.asyncio
async def test_barge_in_during_speak_returns_the_audio_so_far():
    async def endless_llm():
        while True:
            await asyncio.sleep(0.01)
            yield "word "

    async def slow_to_confirm(ws):
        await echo_gateway(ws, cancel_delay=0.1)  # more tokens arrive before `cancelled` does

    async with fake_gateway(slow_to_confirm) as url:
        async with TTSClient.connect(url) as tts:
            ctx = tts.context()
            speaking = asyncio.create_task(ctx.speak(endless_llm()))
            await asyncio.sleep(0.1)
            await ctx.cancel()  # the user started talking
            audio = await asyncio.wait_for(speaking, 2.0)
    assert audio.startswith(b"word ") and ctx.cancelled


@pytest.mark.asyncio
async def test_speak_raises_what_the_delta_source_raises():
    async def failing_llm():
        yield "Hel"
        raise ValueError("model crashed")

    async with fake_gateway(echo_gateway) as url:
        async with TTSClient.connect(url) as tts:
            with pytest.raises(ValueError, match="model crashed"):
                await tts.context().speak(failing_llm())


# ---------------------------------------------------------------- backpressure


@pytest.mark.asyncio
async def test_slow_consumer_gets_everything_in_order_with_a_bounded_queue():
    async def fast_producer(ws):
        await send_json(ws, **READY)
        await receive_json(ws)
        for seq in range(50):
            await send_audio(ws, "c", seq, seq.to_bytes(2, "little"))
        await send_json(ws, type="done", context_id="c", audio_ms=500.0, ttfa_ms=1.0)
        await ws.wait_closed()

    async with fake_gateway(fast_producer) as url:
        async with TTSClient.connect(url, max_queued_chunks=4) as tts:
            ctx = tts.context("c")
            await ctx.send_text("x")
            seqs = []
            async for chunk in ctx:
                assert ctx._queue.qsize() <= 4
                seqs.append(chunk.seq)
                await asyncio.sleep(0.001)
    assert seqs == list(range(50))


@pytest.mark.asyncio
async def test_close_is_prompt_even_when_a_context_is_left_unread():
    async def fast_producer(ws):
        await send_json(ws, **READY)
        await receive_json(ws)
        for seq in range(200):
            await send_audio(ws, "c", seq, b"\x00" * 1000)
        await ws.wait_closed()

    async with fake_gateway(fast_producer) as url:
        tts = await TTSClient.connect(url, max_queued_chunks=2)
        ctx = tts.context("c")
        await ctx.send_text("x")
        await asyncio.sleep(0.2)  # the reader is now parked on the full queue
        started = time.monotonic()
        await tts.close()
        assert time.monotonic() - started < 2.0
    assert len(await collect_until_error(ctx)) == 2  # queued audio is still delivered, then the error


async def collect_until_error(ctx) -> list[AudioChunk]:
    chunks = []
    with pytest.raises(GatewayError) as raised:
        async for chunk in ctx:
            chunks.append(chunk)
    assert raised.value.code == "connection_closed"
    return chunks


# ---------------------------------------------------------------- helpers and example


def test_write_wav_writes_mono_s16(tmp_path):
    path = tmp_path / "x.wav"
    write_wav(str(path), b"\x01\x00\x02\x00", 16000)
    with wave.open(str(path)) as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate(), wav.getnframes()) == (1, 2, 16000, 2)


def load_example():
    spec = importlib.util.spec_from_file_location("simulated_llm_to_wav", ROOT / "examples/simulated_llm_to_wav.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_tokens_split_mid_word_and_keep_the_text():
    example = load_example()
    text = "Streaming speech, quickly!"
    tokens = example.llm_tokens(text)
    assert "".join(tokens) == text
    assert max(map(len, tokens)) <= 4 and "Stre" in tokens


@pytest.mark.asyncio
async def test_example_writes_the_wav_and_reports_ttfa(tmp_path, capsys):
    example = load_example()
    received = []

    async def recording(ws):
        await echo_gateway(ws, received)

    out = tmp_path / "out.wav"
    text = "Hello there, agents."  # an even byte count: whole 16-bit samples
    async with fake_gateway(recording) as url:
        args = example.parse_args(["--url", url, "--text", text, "--tokens-per-second", "200", "-o", str(out)])
        await example.run(args)
    with wave.open(str(out)) as wav:
        assert wav.readframes(wav.getnframes()) == text.encode()
        assert wav.getframerate() == 24000
    assert received[0]["encoding"] == "pcm_s16le"
    printed = capsys.readouterr().out
    assert "TTFA (client" in printed and "audio:" in printed


def test_example_reports_an_unreachable_gateway(capsys):
    example = load_example()
    assert example.main(["--url", "ws://127.0.0.1:9/v1/stream", "-o", "/dev/null"]) == 1
    assert "cannot reach the gateway" in capsys.readouterr().err
