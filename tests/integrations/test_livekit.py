"""The LiveKit Agents TTS against a Piper gateway, through the framework's own stream classes.

A ``SynthesizeStream`` gets an LLM-like reply pushed delta by delta: audio comes before the
input ends, and the aligned transcript has the agent's words, in order, inside the audio.
Closing the stream mid-reply cancels the gateway's context. ``synthesize()`` speaks a text.
"""

from __future__ import annotations

import asyncio
import time

from livekit.agents.types import USERDATA_TIMED_TRANSCRIPT

from tts_gateway.integrations.livekit import GatewayTTS

from tests.conftest import eventually, until, ws_url

REPLY = (
    "Sure! The total comes to $3.50, and your order ships today. "
    "Is there anything else I can help you with this afternoon?"
)


async def push_deltas(stream, text: str, pause_s: float, size: int = 6) -> float:
    """Push the reply like an LLM; returns when the input ended."""
    for at in range(0, len(text), size):
        stream.push_text(text[at : at + size])
        await asyncio.sleep(pause_s)
    stream.end_input()
    return time.monotonic()


async def test_a_pushed_reply_streams_audio_with_an_aligned_transcript(gateway):
    speech = GatewayTTS(url=ws_url(gateway), sample_rate=16000)
    try:
        stream = speech.stream()
        pushing = asyncio.create_task(push_deltas(stream, REPLY, pause_s=0.05))
        first_audio_at, seconds, words = None, 0.0, []

        async def consume():
            nonlocal first_audio_at, seconds
            async for event in stream:
                first_audio_at = first_audio_at or time.monotonic()
                seconds += event.frame.duration
                words.extend(event.frame.userdata.get(USERDATA_TIMED_TRANSCRIPT, []))

        await until(consume(), 30)
        input_ended_at = await pushing
        await stream.aclose()
    finally:
        await speech.aclose()
    assert first_audio_at is not None and first_audio_at < input_ended_at
    assert "".join(words).split() == REPLY.split()
    starts = [word.start_time for word in words]
    assert starts == sorted(starts)
    assert all(0 <= word.start_time < word.end_time <= seconds + 0.01 for word in words)


async def test_closing_a_stream_mid_reply_cancels_it_at_the_gateway(gateway):
    speech = GatewayTTS(url=ws_url(gateway), sample_rate=16000)
    try:
        stream = speech.stream()
        for sentence in [REPLY] * 4:
            stream.push_text(sentence + " ")
        first = await until(anext(aiter(stream)), 30)
        assert first.frame.duration > 0
        await stream.aclose()  # the user barged in

        def cancelled() -> bool:
            return 'tts_contexts_total{outcome="cancelled"} 1.0' in gateway.metrics.render().decode()

        await eventually(cancelled, timeout=5)
    finally:
        await speech.aclose()


async def test_synthesize_speaks_a_whole_text(gateway):
    speech = GatewayTTS(url=ws_url(gateway), sample_rate=16000)
    try:
        async with speech.synthesize("Hello there, this is the gateway speaking.") as chunked:
            frame = await until(chunked.collect(), 30)
    finally:
        await speech.aclose()
    assert frame.sample_rate == 16000 and 1.0 < frame.duration < 6.0
