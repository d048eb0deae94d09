"""WordClock: agent words timed from the text the LM had read and the voice's pace, carried
by the audio chunks.

The text goes through the real normaliser and SpokenWords, as the engine sends it; a
stand-in tokenizer cuts it into tokens of up to 3 characters, so that words span several
tokens. One speech token is 10 samples here, and 100 samples play for 1 s.
"""

from __future__ import annotations

import re

import pytest

from tts_gateway.engine.cosyvoice2.alignment import WordClock
from tts_gateway.engine.text import TextNormalizer
from tts_gateway.engine.text.spoken_words import SpokenWords

SAMPLES_PER_TOKEN = 10


class Reply:
    """The utterance's text side: normaliser -> spoken words -> text tokens -> the clock."""

    def __init__(self, pace: float) -> None:
        self.normalizer = TextNormalizer("auto")
        self.spoken = SpokenWords()
        self.clock = WordClock(SAMPLES_PER_TOKEN, pace)
        self.tokens: list[str] = []

    def push(self, *deltas: str, end: bool = False) -> None:
        for delta in deltas:
            self._send(self.normalizer.push(delta))
        if end:
            self._send(self.normalizer.flush())

    def _send(self, text: str) -> None:
        if text:
            self.spoken.feed(text, self.normalizer.take_spans())
            pieces = list(re.finditer(r"\s*\S{1,3}", text))
            self.tokens += [m.group() for m in pieces]
            self.clock.add_text(text, [m.end() for m in pieces], self.spoken.words_of(text))

    def round(self, text_read: int, speech: int) -> None:
        self.clock.text_read(text_read)
        self.clock.speech(speech)

    def chunk(self, tokens: int, final: bool = False) -> list[tuple[str, float, float]]:
        words = self.clock.chunk(tokens * SAMPLES_PER_TOKEN, tokens * SAMPLES_PER_TOKEN / 100, final)
        return [(w.text, round(w.start_s, 6), round(w.end_s, 6)) for w in words]


def test_words_follow_each_other_at_the_voices_pace():
    reply = Reply(pace=4)
    reply.push("aa bbbb cc dd", end=True)
    assert reply.tokens == ["aa", " bbb", "b", " cc", " dd"]
    reply.round(5, 30)
    # 4 speech tokens per text token: "bbbb" is two text tokens.
    assert reply.chunk(30, final=True) == [("aa", 0.0, 0.4), ("bbbb", 0.4, 1.2), ("cc", 1.2, 1.6), ("dd", 1.6, 2.0)]


def test_a_word_starts_no_earlier_than_the_lm_had_read_its_last_text_token():
    reply = Reply(pace=2)
    reply.push("aa bbbb cc", end=True)
    reply.round(2, 10)  # "bbbb" is half read: it waits for the next round
    reply.round(4, 10)
    assert reply.chunk(20, final=True) == [("aa", 0.0, 0.2), ("bbbb", 1.0, 1.4), ("cc", 1.4, 1.6)]


def test_words_go_with_the_chunk_whose_audio_reaches_them_clamped_into_it():
    reply = Reply(pace=5)
    reply.push("aa bb cc dd", end=True)
    reply.round(4, 40)  # at 0.5 s a word
    assert reply.chunk(8) == [("aa", 0.0, 0.5), ("bb", 0.5, 0.8)]  # "bb" is cut at the chunk's end
    assert reply.chunk(8) == [("cc", 0.2, 0.7), ("dd", 0.7, 0.8)]
    assert reply.chunk(24, final=True) == []


def test_words_not_read_yet_wait():
    reply = Reply(pace=5)
    reply.push("aa bb", end=True)
    reply.round(1, 20)
    assert reply.chunk(10) == [("aa", 0.0, 0.5)]
    reply.round(2, 10)  # "bb" read at token 20
    assert reply.chunk(10) == []
    assert reply.chunk(10, final=True) == [("bb", 0.0, 0.5)]


def test_the_final_chunk_squeezes_a_pace_that_runs_past_the_reply():
    reply = Reply(pace=10)
    reply.push("aa bb cc dd", end=True)
    reply.round(4, 20)  # 40 tokens of pace in 20 tokens of speech
    assert reply.chunk(20, final=True) == [("aa", 0.0, 0.5), ("bb", 0.5, 1.0), ("cc", 1.0, 1.5), ("dd", 1.5, 2.0)]


def test_agent_words_split_over_deltas_and_read_as_several_come_back_whole():
    reply = Reply(pace=1)
    reply.push("It co", "sts $3.", "50 to", "day.", end=True)
    reply.round(len(reply.tokens), 40)
    words = reply.chunk(40, final=True)
    assert [w for w, _, _ in words] == ["It", "costs", "$3.50", "today."]
    spoken = ("It", " costs", " three dollars and fifty cents", " today.")
    tokens = [len(re.findall(r"\s*\S{1,3}", text)) for text in spoken]
    assert tokens[2] == 10
    assert [end - start for _, start, end in words] == pytest.approx([0.1 * n for n in tokens], abs=1e-5)


def test_a_change_of_speed_scales_the_times_to_the_chunk_as_played():
    reply = Reply(pace=5)
    reply.push("aa bb", end=True)
    reply.round(2, 10)
    words = reply.clock.chunk(100, 0.5, final=True)  # 1 s of audio played twice as fast
    assert [(w.text, w.start_s, w.end_s) for w in words] == [("aa", 0.0, 0.25), ("bb", 0.25, 0.5)]


def test_words_the_lm_never_read_still_come_with_the_final_chunk():
    """A reply the LM ended itself before reading all its text: every word is still timed."""
    reply = Reply(pace=5)
    reply.push("aa bb cc", end=True)
    reply.round(1, 10)
    assert [w for w, _, _ in reply.chunk(10, final=True)] == ["aa", "bb", "cc"]


def test_each_chinese_character_is_a_word_of_its_own():
    """As the normaliser makes every CJK character a token: "3" read "三" is the agent's "3",
    and punctuation, read as nothing, gets no entry."""
    reply = Reply(pace=2)
    reply.push("你好，世界。是3月", end=True)
    reply.round(len(reply.tokens), 20)
    assert [w for w, _, _ in reply.chunk(20, final=True)] == ["你", "好", "世", "界", "是", "3", "月"]


def test_a_character_of_several_byte_tokens_is_read_with_the_last_of_them():
    normalizer, spoken = TextNormalizer("auto"), SpokenWords()
    text = normalizer.push("你好") + normalizer.flush()
    spoken.feed(text, normalizer.take_spans())
    clock = WordClock(SAMPLES_PER_TOKEN, 1)
    clock.add_text(text, [1, 1, 1, 2, 2], spoken.words_of(text))  # three tokens for 你, two for 好
    clock.text_read(2)  # 你's last byte not read yet
    clock.speech(10)
    clock.text_read(5)
    clock.speech(10)
    words = clock.chunk(200, 2.0, final=True)
    assert [(w.text, w.start_s, w.end_s) for w in words] == [("你", 1.0, 1.3), ("好", 1.3, 1.5)]
