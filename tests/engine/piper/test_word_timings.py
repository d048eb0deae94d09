"""Piper's word timings: the model's own phoneme durations, mapped to the agent's words.

The acceptance check compares them with an offline recogniser's (pocketsphinx) word times
on the same audio: the median distance between the starts of the words both agree on must
be within 150 ms. The gateway test checks what an agent receives: every spoken word of its
text, as it wrote it, in order, inside the audio.
"""

from __future__ import annotations

import difflib
import re
import statistics

import numpy as np
import soxr
from pocketsphinx import Decoder

from tts_gateway.engine.base import UtteranceOptions, WordTiming
from tts_gateway.gateway.client import TTSClient

from tests.conftest import until, ws_url

ACCEPTANCE = (
    "The weather today is sunny and warm, with a light breeze from the north. "
    "Please remember to bring your umbrella tomorrow morning."
)


async def speak(engine, text: str, deltas: int = 5) -> tuple[np.ndarray, list[WordTiming]]:
    """The utterance's audio and its words on the utterance's timeline."""
    utterance = engine.open_utterance(UtteranceOptions(engine.default_voice))
    for at in range(0, len(text), deltas):
        utterance.push_text(text[at : at + deltas])
    utterance.end_input()
    audio, words, offset = [], [], 0.0
    async for chunk in utterance:
        words += [WordTiming(w.text, offset + w.start_s, offset + w.end_s) for w in chunk.words]
        offset += len(chunk.samples) / engine.sample_rate
        audio.append(chunk.samples)
    return np.concatenate(audio), words


def recognised_words(audio: np.ndarray, rate: int) -> list[tuple[str, float]]:
    """pocketsphinx's words and their start times (seconds)."""
    pcm = (soxr.resample(audio, rate, 16000) * 32767).astype(np.int16).tobytes()
    decoder = Decoder(samprate=16000)
    decoder.start_utt()
    decoder.process_raw(pcm, full_utt=True)
    decoder.end_utt()
    words = [(re.sub(r"\(\d+\)$", "", s.word), s.start_frame / 100) for s in decoder.seg()]
    return [(word, start) for word, start in words if not word.startswith("<")]


def bare(word: str) -> str:
    return re.sub(r"[^\w']", "", word).lower()


async def test_word_starts_agree_with_a_recogniser(piper_engine, monkeypatch):
    # Without the voice's noise the audio is the same on every run, so the recogniser hears the
    # same words every time (with it, a run now and then misheard too many words to compare).
    # The durations the timings come from are the model's either way.
    monkeypatch.setattr(piper_engine._voice.config, "noise_scale", 0.0)
    monkeypatch.setattr(piper_engine._voice.config, "noise_w_scale", 0.0)
    audio, words = await speak(piper_engine, ACCEPTANCE)
    heard = recognised_words(audio, piper_engine.sample_rate)
    ours = [bare(w.text) for w in words]
    matcher = difflib.SequenceMatcher(None, ours, [word for word, _ in heard], autojunk=False)
    pairs = [(words[a + k].start_s, heard[b + k][1]) for a, b, n in matcher.get_matching_blocks() for k in range(n)]
    assert len(pairs) >= 0.7 * len(words), (ours, heard)
    errors = [abs(ours_s - heard_s) for ours_s, heard_s in pairs]
    assert statistics.median(errors) <= 0.150, errors


async def test_every_spoken_word_is_timed_in_order_inside_the_audio(piper_engine):
    text = "Sure! I put it in the box of the cat. The total is $3.50, due May 5th."
    audio, words = await speak(piper_engine, text, deltas=3)
    assert [w.text for w in words] == text.split()
    seconds = len(audio) / piper_engine.sample_rate
    for before, after in zip(words, words[1:]):
        assert before.end_s <= after.start_s
    assert all(0.0 <= w.start_s < w.end_s <= seconds for w in words)
    money = words[text.split().index("$3.50,")]
    # "three dollars and fifty cents" lasts much longer than any one-syllable word.
    assert money.end_s - money.start_s > 3 * (words[1].end_s - words[1].start_s)


async def test_the_client_gets_alignments_on_the_context_timeline(gateway):
    text = "Hello there! The total is $3.50, due May 5th. Thanks for waiting."
    async with TTSClient.connect(ws_url(gateway), sample_rate=16000, encoding="pcm_s16le") as tts:
        reply = tts.context()
        audio = await until(reply.speak([text[i : i + 4] for i in range(0, len(text), 4)]), 30)
    assert [w.text for w in reply.alignments] == text.split()
    audio_ms = len(audio) / 2 / 16000 * 1000
    for before, after in zip(reply.alignments, reply.alignments[1:]):
        assert before.end_ms <= after.start_ms
    assert reply.alignments[-1].end_ms <= audio_ms + 1
