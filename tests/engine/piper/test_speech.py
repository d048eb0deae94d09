"""The gateway speaks intelligibly: an offline recogniser (pocketsphinx) hears the words.

The agent streams the acceptance sentence as small deltas, split mid-word and
mid-number; the recogniser must hear the normalised reading ("three dollars and
fifty cents"), which also proves "$3." + "50" stayed one amount.
"""

from __future__ import annotations

import numpy as np
from pocketsphinx import Decoder

from tts_gateway.gateway.audio import decode
from tts_gateway.gateway.client import TTSClient

from tests.conftest import until, ws_url



def transcribe(pcm_s16le_16k: bytes) -> list[str]:
    decoder = Decoder(samprate=16000)
    decoder.start_utt()
    decoder.process_raw(pcm_s16le_16k, full_utt=True)
    decoder.end_utt()
    return decoder.hyp().hypstr.lower().split() if decoder.hyp() else []


async def test_streamed_sentence_is_intelligible(gateway):
    text = "Hello there! The total is $3.50, due May 5th."
    deltas = ["Hel", "lo the", "re! The to", "tal is $3", ".", "50, due Ma", "y 5", "th."]
    async with TTSClient.connect(ws_url(gateway), sample_rate=16000, encoding="pcm_s16le") as tts:
        audio = await until(tts.context().speak(deltas), 30)
    assert "".join(deltas) == text
    seconds = len(decode(audio, "pcm_s16le")) / 16000
    assert 2.5 < seconds < 7.0
    words = transcribe(audio)
    expected = {"total", "three", "dollars", "fifty", "cents"}
    assert len(expected & set(words)) >= 4, words


def test_recogniser_hears_nothing_in_noise():
    """The check above can fail: noise of the same length yields none of the words."""
    rng = np.random.default_rng(0)
    noise = (rng.normal(0, 0.1, 16000 * 4) * 32767).astype(np.int16).tobytes()
    assert not {"total", "dollars", "fifty", "cents"} & set(transcribe(noise))
