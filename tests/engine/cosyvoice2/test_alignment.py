"""WordClock: agent words timed from the text the LM had read, carried by the audio chunks.

The text goes through the real normaliser and SpokenWords, as the engine sends it; a
stand-in tokenizer cuts it into tokens of up to 3 characters, so that words span several
tokens. One speech token is 10 samples here, and 100 samples play for 1 s.
"""

from __future__ import annotations

import re

import pytest

from engine.cosyvoice2.alignment import WordClock
from engine.text import TextNormalizer
from engine.text.spoken_words import SpokenWords

SAMPLES_PER_TOKEN = 10


class Reply:
    """The utterance's text side: normaliser -> spoken words -> text tokens -> the clock."""

    def __init__(self) -> None:
        self.normalizer = TextNormalizer("auto")
        self.spoken = SpokenWords()
        self.clock = WordClock(SAMPLES_PER_TOKEN)
        self.tokens: list[str] = []

    def push(self, *deltas: str, end: bool = False) -> None:
        for delta in deltas:
            self._send(self.normalizer.push(delta))
        if end:
            self._send(self.normalizer.flush())

    def _send(self, text: str) -> None:
        if text:
            self.spoken.feed(text, self.normalizer.take_spans())
            pieces = [m for m in re.finditer(r"\s*\S{1,3}", text)]
            self.tokens += [m.group() for m in pieces]
            self.clock.add_text(text, [m.end() for m in pieces], self.spoken.words_of(text))

    def round(self, text_read: int, speech: int) -> None:
        self.clock.text_read(text_read)
        self.clock.speech(speech)

    def chunk(self, tokens: int, final: bool = False) -> list[tuple[str, float, float]]:
        words = self.clock.chunk(tokens * SAMPLES_PER_TOKEN, tokens * SAMPLES_PER_TOKEN / 100, final)
        return [(w.text, round(w.start_s, 6), round(w.end_s, 6)) for w in words]


def test_a_rounds_words_share_its_speech_by_spoken_characters():
    reply = Reply()
    reply.push("aa bbbb cc dd", end=True)
    assert reply.tokens == ["aa", " bbb", "b", " cc", " dd"]
    reply.round(3, 12)  # "aa" and "bbbb" (tokens 0-2) read: their round is 12 tokens
    reply.round(5, 8)  # the rest
    reply.clock.speech_ended()
    # "aa" at token 0, "bbbb" 12 * 2/6 = 4 tokens later; "cc" and "dd" share tokens 12-20.
    assert reply.chunk(20, final=True) == [
        ("aa", 0.0, 0.4), ("bbbb", 0.4, 1.2), ("cc", 1.2, 1.6), ("dd", 1.6, 2.0)
    ]


def test_a_word_is_read_once_its_last_text_token_is():
    reply = Reply()
    reply.push("aa bbbb cc", end=True)
    reply.round(2, 10)  # "bbbb" is half read: it goes with the next round's words
    reply.round(4, 10)
    reply.clock.speech_ended()
    # "aa" and "cc" share tokens 10-20: "cc" starts 10 * 4/6 tokens after "bbbb".
    assert [(w, start) for w, start, _ in reply.chunk(20, final=True)] == [
        ("aa", 0.0), ("bbbb", 1.0), ("cc", pytest.approx(1.0 + 1.0 * 4 / 6))
    ]


def test_words_of_a_round_still_being_made_wait_for_its_end():
    """Only the open round's first word has a start; the rest come once the round's length
    is known, clamped into the chunk then carrying them."""
    reply = Reply()
    reply.push("aa bbbb cc", end=True)
    reply.round(4, 10)
    assert reply.chunk(5) == [("aa", 0.0, 0.5)]  # the chunk's last word runs to its end
    reply.clock.speech(10)
    assert reply.chunk(5) == []  # still open: not due yet
    reply.clock.speech_ended()  # 20 tokens: "bbbb" at 20 * 2/8 = 5, "cc" at 15
    assert reply.chunk(10) == [("bbbb", 0.0, 0.5), ("cc", 0.5, 1.0)]
    assert reply.chunk(5, final=True) == []


def test_words_go_with_the_chunk_whose_audio_reaches_them():
    reply = Reply()
    reply.push("aa bb cc dd ee ff", end=True)
    reply.round(2, 15)  # "aa bb"
    reply.round(4, 15)  # "cc dd"
    reply.round(6, 10)  # "ee ff": the round still being made
    first, second = reply.chunk(20), reply.chunk(10)
    assert first == [("aa", 0.0, 0.75), ("bb", 0.75, 1.5), ("cc", 1.5, 2.0)]
    assert second == [("dd", 0.25, 1.0)]  # "ee" starts at token 30, beyond this chunk
    reply.clock.speech_ended()
    assert reply.chunk(10, final=True) == [("ee", 0.0, 0.5), ("ff", 0.5, 1.0)]


def test_agent_words_split_over_deltas_and_read_as_several_come_back_whole():
    reply = Reply()
    reply.push("It co", "sts $3.", "50 to", "day.", end=True)
    reply.round(len(reply.tokens), 40)
    reply.clock.speech_ended()
    words = reply.chunk(40, final=True)
    assert [w for w, _, _ in words] == ["It", "costs", "$3.50", "today."]
    spoken = {"It": 2, "costs": 5, "$3.50": len("threedollarsandfiftycents"), "today.": 6}
    durations = [end - start for _, start, end in words]
    assert durations == pytest.approx([4.0 * spoken[w] / sum(spoken.values()) for w, _, _ in words], abs=1e-5)


def test_a_change_of_speed_scales_the_times_to_the_chunk_as_played():
    reply = Reply()
    reply.push("aa bb", end=True)
    reply.round(2, 10)
    reply.clock.speech_ended()
    words = reply.clock.chunk(100, 0.5, final=True)  # 1 s of audio played twice as fast
    assert [(w.text, w.start_s, w.end_s) for w in words] == [("aa", 0.0, 0.25), ("bb", 0.25, 0.5)]


def test_the_final_chunk_carries_every_word_left_even_unread_ones():
    """A reply the LM ended early (eos before the last round read everything) still times
    every word: unread ones at the end of the audio."""
    reply = Reply()
    reply.push("aa bb cc", end=True)
    reply.round(1, 10)
    words = reply.chunk(10, final=True)
    assert [w for w, _, _ in words] == ["aa", "bb", "cc"]
    assert words[0] == ("aa", 0.0, 1.0) and words[1][1:] == words[2][1:] == (1.0, 1.0)


def test_each_chinese_character_is_a_word_of_its_own():
    """As the normaliser makes every CJK character a token: "3" read "三" is the agent's "3",
    and punctuation, read as nothing, gets no entry."""
    reply = Reply()
    reply.push("你好，世界。是3月", end=True)
    reply.round(len(reply.tokens), 20)
    reply.clock.speech_ended()
    assert [w for w, _, _ in reply.chunk(20, final=True)] == ["你", "好", "世", "界", "是", "3", "月"]
