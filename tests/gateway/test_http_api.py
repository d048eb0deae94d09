"""The HTTP routes on the one port of the real Piper gateway: POST /v1/audio/speech (OpenAI-compatible,
also through the OpenAI SDK), the port's limits, and HTTP beside WebSocket sessions."""

from __future__ import annotations

import struct
import time

import asyncio
import logging
import socket

import aiohttp
import numpy as np
import openai
import orjson
import pytest
from websockets.asyncio.client import connect

from tests.conftest import eventually, make_config, running_gateway
from tests.conftest import until, ws_url
from tests.gateway.test_server import LONG_TEXT, SENTENCE, read_context, recv_json, rms

RATE = 24000


def speech_url(gw, query: str = "") -> str:
    return f"http://127.0.0.1:{gw.port}/v1/audio/speech" + (f"?{query}" if query else "")


async def post(gw, body, headers: dict | None = None, query: str = ""):
    async with aiohttp.ClientSession() as http:
        kwargs = {"data": body} if isinstance(body, (str, bytes)) else {"json": body}
        async with http.post(speech_url(gw, query), headers=headers, **kwargs) as response:
            return response.status, await response.read(), response.headers


def parse_streaming_wav(data: bytes) -> tuple[int, np.ndarray]:
    """A 16-bit mono WAV whose sizes may say 'unknown': (rate, float samples)."""
    riff, _, wave, fmt, fmt_size, tag, channels, rate, byte_rate, align, bits, data_id, _ = struct.unpack(
        "<4sI4s4sIHHIIHH4sI", data[:44]
    )
    assert (riff, wave, fmt, fmt_size, data_id) == (b"RIFF", b"WAVE", b"fmt ", 16, b"data")
    assert (tag, channels, bits, align, byte_rate) == (1, 1, 16, 2, rate * 2)
    return rate, np.frombuffer(data[44:], dtype="<i2").astype(np.float32) / 32767.0


async def test_wav_of_the_right_length(gateway):
    status, data, headers = await post(gateway, {"model": "tts-1", "input": SENTENCE, "voice": "alloy"})
    assert status == 200 and headers["Content-Type"] == "audio/wav" and headers["X-Model"] == "tts-1"
    assert headers.get("Transfer-Encoding") == "chunked"
    assert struct.unpack("<I", data[4:8])[0] == struct.unpack("<I", data[40:44])[0] == 0xFFFFFFFF
    rate, samples = parse_streaming_wav(data)
    assert rate == RATE and (len(data) - 44) % 2 == 0
    assert 2.5 < len(samples) / RATE < 7.0
    assert 0.03 < rms(samples) < 0.5
    current = gateway.metrics.stats(60)["current"]
    assert current["contexts_by_outcome"] == {"done": 1} and current["ttfa_count"] == 1
    assert current["audio_s"] == pytest.approx(len(samples) / RATE, abs=0.01)
    assert gateway.metrics.registry.get_sample_value("tts_active_contexts") == 0


async def test_pcm_format_and_voice_choices(gateway):
    results = {}
    for voice, speed in (("joe", 1.0), ("default", 1.0), (None, 2.0)):
        body = {"input": "Hello there!", "response_format": "pcm", "speed": speed}
        if voice:
            body["voice"] = voice
        status, data, headers = await post(gateway, body)
        assert status == 200 and headers["Content-Type"] == "audio/pcm" and not data.startswith(b"RIFF")
        results[voice, speed] = len(data) / 2 / RATE
    assert 0.5 < results["joe", 1.0] < 3.0
    assert results["default", 1.0] == pytest.approx(results["joe", 1.0], rel=0.3)  # Piper durations vary a little
    assert results[None, 2.0] < 0.75 * results["joe", 1.0]  # speed reaches the engine


@pytest.mark.parametrize("fmt", ["pcm", "mp3", "opus", "flac", "aac"])  # compressed ones as they are encoded
async def test_audio_streams_before_synthesis_ends(gateway, fmt):
    async with aiohttp.ClientSession() as http:
        started = time.monotonic()
        async with http.post(speech_url(gateway), json={"input": LONG_TEXT, "response_format": fmt}) as response:
            assert response.status == 200
            first = await response.content.readany()
            first_at = time.monotonic() - started
            assert first and gateway.engine.stats().utterances == 1  # still speaking
            rest = await response.read()
            total_at = time.monotonic() - started
    assert len(rest) > 10 * len(first)
    assert first_at < 0.5 * total_at


async def test_disconnect_cancels_the_utterance(gateway):
    engine = gateway.engine
    async with aiohttp.ClientSession() as http:
        response = await http.post(speech_url(gateway), json={"input": LONG_TEXT})
        assert response.status == 200 and await response.content.readany()
        assert engine.stats().utterances == 1
        response.close()  # drop the connection mid-stream
    await eventually(lambda: engine.stats().utterances == 0 and engine.stats().running == 0, timeout=2)
    assert engine.stats().queued == 0
    await eventually(lambda: gateway.metrics.stats(60)["current"]["contexts_by_outcome"] == {"cancelled": 1})


@pytest.mark.parametrize(
    "body, code",
    [
        ("{oops", "bad_message"),
        ("[1, 2]", "bad_message"),
        ({"voice": "joe"}, "bad_message"),
        ({"input": ""}, "bad_message"),
        ({"input": 5}, "bad_message"),
        ({"input": "Hello \u0000 world."}, "bad_message"),
        ({"input": "Hi.", "model": "a\r\nX-Evil: 1"}, "bad_message"),
        ({"input": "Hi.", "model": 5}, "bad_message"),
        ({"input": "x" * 20_001}, "text_too_long"),
        ({"input": "Hi.", "voice": "nobody"}, "unknown_voice"),
        ({"input": "Hi.", "voice": ["joe"]}, "unknown_voice"),
        ({"input": "Hi.", "voice": "v" * 100_000}, "unknown_voice"),
        ({"input": "Hi.", "response_format": "ogg"}, "unsupported_format"),
        ({"input": "Hi.", "response_format": ["mp3"]}, "unsupported_format"),
        ({"input": "Hi.", "stream_format": "chunks"}, "unsupported_format"),
        ({"input": "Hi.", "stream_format": {"sse": True}}, "unsupported_format"),
        ({"input": "Hi.", "instructions": "Whisper."}, "unsupported_parameter"),
        ({"input": "Hi.", "speed": 0.2}, "bad_message"),
        ({"input": "Hi.", "speed": 4.5}, "bad_message"),
        ({"input": "Hi.", "speed": "fast"}, "bad_message"),
    ],
)
async def test_bad_requests_are_400(gateway, body, code):
    status, data, headers = await post(gateway, body)
    assert status == 400 and headers["Content-Type"].startswith("application/json")
    error = orjson.loads(data)["error"]
    assert error["code"] == code and error["message"]
    assert len(error["message"]) < 300  # what the client sent is quoted, cut short
    assert gateway.metrics.stats(60)["current"]["errors_by_code"] == {code: 1}


async def test_speech_needs_the_api_key(piper_engine):
    async with running_gateway(make_config(auth={"api_keys": ("k-secret",)}), piper_engine) as gw:
        assert (await post(gw, {"input": "Hi."}))[0] == 401
        assert (await post(gw, {"input": "Hi."}, {"Authorization": "Bearer wrong"}))[0] == 401
        hi = {"input": "Hi.", "response_format": "pcm"}
        status, data, _ = await post(gw, hi, {"Authorization": "Bearer k-secret"})
        assert status == 200 and data
        assert (await post(gw, hi, query="api_key=k-secret"))[0] == 200


# ------------------------------------------------------------------ the OpenAI SDK


def openai_client(gw, api_key: str = "unused") -> openai.AsyncOpenAI:
    """The SDK as users point it at the gateway: the one port's base URL."""
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gw.port}/v1", api_key=api_key, max_retries=0)


@pytest.mark.parametrize("fmt", ["wav", "pcm"])
async def test_the_openai_sdk_speaks_through_the_one_port(piper_engine, fmt):
    async with running_gateway(make_config(auth={"api_keys": ("k-secret",)}), piper_engine) as gw:
        async with openai_client(gw, "k-secret") as client:
            whole = await client.audio.speech.create(
                model="tts-1", voice="alloy", input=SENTENCE, response_format=fmt
            )
            data = whole.content
            async with client.audio.speech.with_streaming_response.create(
                model="gpt-4o-mini-tts", voice="nova", input=SENTENCE, response_format=fmt
            ) as response:
                assert response.headers["X-Model"] == "gpt-4o-mini-tts"
                parts = [part async for part in response.iter_bytes()]
        with pytest.raises(openai.AuthenticationError):
            async with openai_client(gw, "wrong") as client:
                await client.audio.speech.create(model="tts-1", voice="alloy", input="Hi.", response_format=fmt)
    streamed = b"".join(parts)
    samples = parse_streaming_wav(data)[1] if fmt == "wav" else np.frombuffer(data, "<i2") / 32767.0
    assert 2.5 < len(samples) / RATE < 7.0 and rms(samples) > 0.03
    assert data.startswith(b"RIFF") == streamed.startswith(b"RIFF") == (fmt == "wav")
    assert len(streamed) == pytest.approx(len(data), rel=0.3)  # Piper durations vary a little


async def test_the_openai_sdk_reads_a_refusal_as_its_error(gateway):
    async with openai_client(gateway) as client:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.audio.speech.create(model="tts-1", voice="alloy", input="Hi.", response_format="ogg")
    assert refused.value.body["code"] == "unsupported_format"


# ------------------------------------------------------------------ one port


async def test_speech_and_a_websocket_session_share_the_port_and_its_session_limit(piper_engine):
    async with running_gateway(make_config(limits={"max_sessions": 2}), piper_engine) as gw:
        base = f"http://127.0.0.1:{gw.port}"
        async with connect(ws_url(gw)) as ws, aiohttp.ClientSession() as http:
            await recv_json(ws)
            async with http.post(speech_url(gw), json={"input": LONG_TEXT, "response_format": "pcm"}) as speaking:
                assert speaking.status == 200 and await speaking.content.readany()
                # The session and the download take both places: no room for a third of either.
                async with http.get(base + "/readyz") as ready:
                    assert ready.status == 503 and await ready.text() == "at capacity\n"
                status, body, _ = await post(gw, {"input": "Hi."})
                assert status == 503 and orjson.loads(body)["error"]["code"] == "overloaded"
                async with connect(ws_url(gw)) as third:
                    assert (await recv_json(third))["code"] == "overloaded"
                # The WebSocket session speaks meanwhile, on the same port.
                await ws.send('{"type":"text","text":"Both at once."}')
                await ws.send('{"type":"end"}')
                _, audio, done = await read_context(ws)
                assert done["type"] == "done" and audio
            await eventually(lambda: not gw.http.speeches)
            assert (await post(gw, {"input": "Hi.", "response_format": "pcm"}))[0] == 200


async def test_every_http_answer_is_a_clear_one(gateway):
    async with aiohttp.ClientSession() as http:
        base = f"http://127.0.0.1:{gateway.port}"
        async with http.post(base + "/v1/stream", json={}) as response:  # neither empty nor silent
            assert response.status == 405 and response.headers["Connection"] == "close"
            assert "POST /v1/stream" in (await response.json())["error"]["message"]
        async with http.get(base + "/v1/nothing") as response:
            assert response.status == 404
            assert (await response.json())["error"]["code"] == "not_found"
        async with http.post(base + "/v1/nothing", json={}) as response:
            assert response.status == 405
        async with http.put(base + "/v1/audio/speech", json={}) as response:
            assert response.status == 405
            assert (await response.json())["error"]["code"] == "bad_request"


async def test_each_request_is_one_info_line_with_method_path_and_status(gateway, caplog):
    """Whichever library serves the path; the query (it may hold an API key) is left out."""
    base = f"http://127.0.0.1:{gateway.port}"
    with caplog.at_level(logging.INFO):
        async with aiohttp.ClientSession() as http:
            for path, status in (("/dashboard", 200), ("/v1/nothing", 404), ("/v1/stream?api_key=secret", 426)):
                async with http.get(base + path) as response:
                    assert response.status == status
        async with connect(ws_url(gateway, "api_key=secret")) as ws:
            await recv_json(ws)  # ready
    lines = [(record.name, record.levelname, record.getMessage()) for record in caplog.records
             if record.name.startswith(("tts_gateway.http", "websockets")) and record.levelno >= logging.INFO]
    assert lines == [("tts_gateway.http", "INFO", "GET /dashboard 200"), ("tts_gateway.http", "INFO", "GET /v1/nothing 404"),
                     ("tts_gateway.http", "INFO", "GET /v1/stream 426"), ("tts_gateway.http", "INFO", "GET /v1/stream 101")]
    assert "secret" not in caplog.text


async def _raw_exchange(gw, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    writer.write(data)
    answer = await until(reader.read(), 5)  # to the end: the gateway closes the connection
    writer.close()
    return answer


async def test_silent_trickling_or_huge_requests_are_refused(piper_engine):
    config = make_config(server={"request_timeout_s": 0.3})
    async with running_gateway(config, piper_engine) as gw:
        silent = await _raw_exchange(gw, b"")
        trickling = await _raw_exchange(gw, b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        for answer in (silent, trickling):
            assert answer.startswith(b"HTTP/1.1 408 ") and b'"code":"bad_request"' in answer
        huge = await _raw_exchange(gw, b"GET /healthz HTTP/1.1\r\nX-Big: " + b"x" * 70_000 + b"\r\n\r\n")
        assert huge.startswith(b"HTTP/1.1 431 ")
        # A body that never arrives in full.
        body_missing = await _raw_exchange(
            gw, b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n{\"input\""
        )
        assert body_missing.startswith(b"HTTP/1.1 408 ") and b"did not arrive" in body_missing
        assert (await _raw_exchange(gw, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")).endswith(b"\r\n\r\nok\n")


async def test_drain_waits_for_a_download_then_cuts_it(piper_engine):
    async with running_gateway(make_config(), piper_engine) as gw:
        async with aiohttp.ClientSession() as http:
            async with http.post(speech_url(gw), json={"input": LONG_TEXT, "response_format": "pcm"}) as response:
                assert response.status == 200 and await response.content.readany()
                drain = asyncio.create_task(gw.drain(timeout=0.5))
                assert (await post(gw, {"input": "Hi."}))[0] == 503  # no new download meanwhile
                with pytest.raises(aiohttp.ClientPayloadError):  # the body is cut short
                    await until(response.read())
                await until(drain)
        await eventually(lambda: piper_engine.stats().utterances == 0)


async def test_an_oversized_voice_upload_gets_a_json_413(gateway):
    """An hour of WAV is refused before it is read in full, with the documented JSON error."""
    form = aiohttp.FormData()
    form.add_field("name", "long")
    form.add_field("text", "words")
    form.add_field("audio", b"\0" * (17 * 2**20), filename="long.wav", content_type="audio/wav")
    async with aiohttp.ClientSession() as http:
        async with http.post(f"http://127.0.0.1:{gateway.port}/v1/voices", data=form) as response:
            assert response.status == 413
            assert (await response.json())["error"]["code"] == "too_large"
