"""POST /v1/audio/speech (OpenAI-compatible) on the real Piper gateway's HTTP port."""

from __future__ import annotations

import struct
import time

import aiohttp
import numpy as np
import orjson
import pytest

from tests.conftest import eventually, make_config, running_gateway
from tests.gateway.test_server import LONG_TEXT, SENTENCE, rms

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


async def test_audio_streams_before_synthesis_ends(gateway):
    async with aiohttp.ClientSession() as http:
        started = time.monotonic()
        async with http.post(speech_url(gateway), json={"input": LONG_TEXT, "response_format": "pcm"}) as response:
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
        ({"input": "x" * 20_001}, "text_too_long"),
        ({"input": "Hi.", "voice": "nobody"}, "unknown_voice"),
        ({"input": "Hi.", "voice": ["joe"]}, "unknown_voice"),
        ({"input": "Hi.", "response_format": "mp3"}, "unsupported_format"),
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
    assert gateway.metrics.stats(60)["current"]["errors_by_code"] == {code: 1}


async def test_speech_needs_the_api_key(piper_engine):
    async with running_gateway(make_config(auth={"api_keys": ("k-secret",)}), piper_engine) as gw:
        assert (await post(gw, {"input": "Hi."}))[0] == 401
        assert (await post(gw, {"input": "Hi."}, {"Authorization": "Bearer wrong"}))[0] == 401
        hi = {"input": "Hi.", "response_format": "pcm"}
        status, data, _ = await post(gw, hi, {"Authorization": "Bearer k-secret"})
        assert status == 200 and data
        assert (await post(gw, hi, query="api_key=k-secret"))[0] == 200
