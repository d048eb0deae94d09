"""OpenAI's speech API in full on the real Piper gateway, through the official SDK: every
response format (decoded with PyAV), Server-Sent Events, GET /v1/models and /v1/audio/voices."""

from __future__ import annotations

import base64
import io

import aiohttp
import av
import numpy as np
import openai
import orjson
import pytest

from tests.conftest import make_config, running_gateway
from tests.gateway.test_http_api import RATE, openai_client, parse_streaming_wav
from tests.gateway.test_server import SENTENCE, rms

FORMATS = ["wav", "pcm", "mp3", "opus", "flac", "aac"]
CONTENT_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "mp3": "audio/mpeg", "opus": "audio/opus",
                 "flac": "audio/flac", "aac": "audio/aac"}


def decoded(data: bytes, fmt: str) -> tuple[int, np.ndarray]:
    """(rate, float mono samples) of one response body, as a player would decode it."""
    if fmt == "pcm":
        return RATE, np.frombuffer(data, dtype="<i2").astype(np.float32) / 32767.0
    if fmt == "wav":
        return parse_streaming_wav(data)
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        to_float = av.AudioResampler(format="flt", layout="mono")  # each decoder has its sample format
        frames = [out.to_ndarray() for frame in container.decode(stream) for out in to_float.resample(frame)]
        return stream.rate, np.concatenate(frames, axis=1)[0]


def seconds(data: bytes, fmt: str) -> float:
    rate, samples = decoded(data, fmt)
    return len(samples) / rate


async def sse_events(response) -> list[dict]:
    """The events of a Server-Sent Events body, in order."""
    events = []
    async for line in response.iter_lines():
        if line.startswith("data: "):
            events.append(orjson.loads(line[len("data: "):]))
        else:
            assert line == "", f"not an SSE data line: {line!r}"
    return events


@pytest.mark.parametrize("fmt", FORMATS)
async def test_every_format_as_a_body_and_as_events(gateway, fmt):
    async with openai_client(gateway) as client:
        whole = await client.audio.speech.create(model="tts-1", voice="alloy", input=SENTENCE, response_format=fmt)
        async with client.audio.speech.with_streaming_response.create(
            model="gpt-4o-mini-tts", voice="nova", input=SENTENCE, response_format=fmt, stream_format="sse"
        ) as response:
            assert response.headers["Content-Type"] == "text/event-stream"
            events = await sse_events(response)
    assert whole.response.headers["Content-Type"] == CONTENT_TYPES[fmt]
    rate, samples = decoded(whole.content, fmt)
    assert rate == (48000 if fmt == "opus" else RATE)  # Ogg Opus always decodes at 48 kHz
    assert 2.5 < len(samples) / rate < 7.0 and rms(samples) > 0.03
    # Events: audio deltas, then one done event, last; the deltas make a body of the same format.
    *deltas, done = events
    assert done == {"type": "speech.audio.done"}
    assert len(deltas) > 1 and all(event["type"] == "speech.audio.delta" for event in deltas)
    from_events = b"".join(base64.b64decode(event["audio"]) for event in deltas)
    assert seconds(from_events, fmt) == pytest.approx(len(samples) / rate, rel=0.3)  # Piper durations vary a little
    assert rms(decoded(from_events, fmt)[1]) > 0.03


async def test_the_sdk_streams_a_compressed_body(gateway):
    async with openai_client(gateway) as client:
        async with client.audio.speech.with_streaming_response.create(
            model="tts-1", voice="alloy", input=SENTENCE, response_format="mp3"
        ) as response:
            parts = [part async for part in response.iter_bytes()]
    assert len(parts) > 1
    assert 2.5 < seconds(b"".join(parts), "mp3") < 7.0


async def test_models_and_voices_in_openais_list_shape(piper_engine):
    async with running_gateway(make_config(auth={"api_keys": ("k-secret",)}), piper_engine) as gw:
        async with openai_client(gw, "k-secret") as client:
            models = [model.id async for model in client.models.list()]
            voices = await client.get("/audio/voices", cast_to=object)
        with pytest.raises(openai.AuthenticationError):
            async with openai_client(gw, "wrong") as client:
                await client.models.list()
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{gw.port}/v1/audio/voices") as response:
                assert response.status == 401
    assert models == ["tts-1", "tts-1-hd", "gpt-4o-mini-tts"]
    assert voices["object"] == "list" and voices["default"] == piper_engine.default_voice
    assert [voice["id"] for voice in voices["data"]] == [voice.id for voice in piper_engine.voices()]
    assert all(voice["object"] == "voice" for voice in voices["data"])


async def test_instructions_are_refused(gateway):
    async with openai_client(gateway) as client:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.audio.speech.create(
                model="gpt-4o-mini-tts", voice="alloy", input="Hi.", instructions="Speak like a pirate."
            )
        assert (await client.audio.speech.create(
            model="tts-1", voice="alloy", input="Hi.", response_format="pcm", instructions=""
        )).content  # empty instructions ask for nothing
    assert refused.value.status_code == 400
    assert refused.value.body["code"] == "unsupported_parameter" and "instructions" in refused.value.body["message"]
