"""Word timings of the CosyVoice2 engine, end to end on the tiny random checkpoint (CPU, the
plain-torch LM stage): every agent word is timed once, in order, inside the chunk that
carries it, and the gateway sends them as alignment frames on the context's timeline.

Random weights never sample eos: replies end at ``max_speech_per_text_token`` speech tokens
per text token, kept small here so that they are short.
"""

from __future__ import annotations

import dataclasses

import pytest
import pytest_asyncio

from tts_gateway.engine.base import UtteranceOptions
from tts_gateway.engine.cosyvoice2.engine import CosyVoice2Engine
from tts_gateway.gateway.client import Alignment, TTSClient
from tests.conftest import make_config, running_gateway, until, ws_url
from tests.engine.cosyvoice2.test_engine import cv2_engine  # noqa: F401 (the engine fixture)

# Agent deltas cut mid-word and mid-number; "$3.50" and "9:30" are read as several words.
DELTAS = ["The pri", "ce is $3.", "50 to", "day, and we ", "open at 9:", "30 sharp."]
AGENT_WORDS = "The price is $3.50 today, and we open at 9:30 sharp.".split()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def short_replies(cv2_engine):  # noqa: F811
    engine = CosyVoice2Engine(dataclasses.replace(cv2_engine.settings, max_speech_per_text_token=4.0))
    await engine.start()
    yield engine
    await engine.close()


@pytest.mark.parametrize("speed", [1.0, 1.5])
async def test_every_agent_word_is_timed_once_inside_its_chunk(short_replies, speed):
    utterance = short_replies.open_utterance(UtteranceOptions(short_replies.default_voice, speed=speed))
    for delta in DELTAS:
        utterance.push_text(delta)
    utterance.end_input()
    chunks = await until(_collect(utterance), 120)
    assert sum(1 for chunk in chunks if chunk.words) >= 2  # words are carried by several chunks
    words, at = [], 0.0
    for chunk in chunks:
        duration = len(chunk.samples) / short_replies.sample_rate
        for word in chunk.words:
            assert 0.0 <= word.start_s <= word.end_s <= duration + 1e-9, (word, duration)
            words.append((word.text, at + word.start_s, at + word.end_s))
        at += duration
    assert [text for text, _, _ in words] == AGENT_WORDS
    assert all(end <= following for (_, _, end), (_, following, _) in zip(words, words[1:]))
    assert words[-1][2] <= at + 1e-9
    assert words[0][1] < words[-1][1]  # the words are spread over the reply, not piled up


async def _collect(utterance):
    return [chunk async for chunk in utterance]


async def test_a_cancelled_reply_sends_no_more_words(short_replies):
    utterance = short_replies.open_utterance(UtteranceOptions(short_replies.default_voice))
    utterance.push_text("This reply is cut off after its first chunk, so most of its words are never heard at all.")
    utterance.end_input()
    first = await until(anext(aiter(utterance)), 120)
    utterance.cancel()
    assert [chunk async for chunk in utterance] == []
    heard = [word.text for word in first.words]
    assert heard == "This reply is cut off".split()[: len(heard)]


async def test_the_gateway_sends_the_words_after_their_audio(short_replies):
    async with running_gateway(make_config(engine={"name": "cosyvoice2"}), short_replies) as gateway:
        async with TTSClient.connect(ws_url(gateway)) as tts:
            reply = tts.context()
            events = await until(_events(reply, DELTAS), 120)
    audio_ms = 0.0
    sent = []
    for event in events:
        if isinstance(event, Alignment):
            assert all(word.end_ms <= audio_ms + 1 for word in event.words)  # after the audio it times
            sent += event.words
        else:
            audio_ms += event.duration_ms
    assert [word.text for word in sent] == AGENT_WORDS
    assert all(a.end_ms <= b.start_ms for a, b in zip(sent, sent[1:]))
    assert reply.done.audio_ms == pytest.approx(audio_ms, abs=1)


async def _events(reply, deltas):
    for delta in deltas:
        await reply.send_text(delta)
    await reply.end()
    return [event async for event in reply.events()]


async def test_a_client_that_wants_no_word_timings_gets_no_alignment_frames(short_replies):
    utterance = short_replies.open_utterance(UtteranceOptions(short_replies.default_voice, word_timings=False))
    for delta in DELTAS:
        utterance.push_text(delta)
    utterance.end_input()
    chunks = await until(_collect(utterance), 120)
    assert chunks and not any(chunk.words for chunk in chunks)  # the engine skipped them
    async with running_gateway(make_config(engine={"name": "cosyvoice2"}), short_replies) as gateway:
        async with TTSClient.connect(ws_url(gateway), word_timings=False) as tts:
            reply = tts.context()
            events = await until(_events(reply, DELTAS), 120)
    assert not [event for event in events if isinstance(event, Alignment)]
    assert reply.done.audio_ms > 0
