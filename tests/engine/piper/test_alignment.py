"""The pieces behind Piper's word timings, without the model."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tts_gateway.engine.base import WordTiming
from tts_gateway.engine.piper.alignment import SourceTiming, WordJoiner, label_phonemes, phoneme_times, time_words
from tts_gateway.engine.text import Segmenter, TextNormalizer
from tts_gateway.engine.text.spoken_words import SpokenWord, SpokenWords

from tests.engine.test_text import TRICKY_TEXTS


def test_phonemes_of_joined_words_are_split_between_them():
    # espeak says "in the box" as "ɪnðə bˈɑːks": the word break falls inside the first word.
    sentence = list("ɪnðə bˈɑːks")
    labels = label_phonemes(sentence, [list("ɪn"), list("ðə"), list("bˈɑːks")])
    assert [labels[i] for i, p in enumerate(sentence) if p not in " ˈ"] == [0, 0, 1, 1, 2, 2, 2, 2, 2]


def test_unclaimed_phonemes_join_the_word_before():
    labels = label_phonemes(list("abxcd"), [list("ab"), list("cd")])
    assert labels == [0, 0, 0, 1, 1]


def test_phoneme_times_skip_the_start_and_keep_each_pad():
    # ids: BOS PAD a PAD b PAD EOS, durations in frames
    durations = np.array([[[1, 1, 2, 1, 3, 1, 1]]], dtype=np.float32)
    assert phoneme_times(durations, 2, 0.5).tolist() == [[1.0, 2.5], [2.5, 4.5]]
    with pytest.raises(ValueError, match="durations for 3 phonemes"):
        phoneme_times(durations, 3, 0.5)


def test_spoken_words_of_one_agent_word_merge():
    words = [SpokenWord("three", 0, "$3"), SpokenWord("dollars", 0, "$3"), SpokenWord("now", 1, "now")]
    sentence = list("θɹiː dɑːlɚz naʊ")
    times = np.array([[i * 0.1, i * 0.1 + 0.1] for i in range(len(sentence))])
    word_phonemes = {"three": list("θɹiː"), "dollars": list("dɑːlɚz"), "now": list("naʊ")}
    [timings] = time_words(words, [sentence], [times], word_phonemes.__getitem__)
    assert [(t.text, round(t.start_s, 1), round(t.end_s, 1)) for t in timings] == [("$3", 0.0, 1.1), ("now", 1.2, 1.5)]


def test_each_spoken_word_knows_the_agent_word_it_speaks():
    text = "Sure! It costs **$3.50**, see you at 10:30 on May 5th."
    pairs = [(w.text, w.source_text) for w in spoken_words_of([text[i : i + 3] for i in range(0, len(text), 3)])]
    assert ("dollars", "$3.50,") in pairs and ("cents,", "$3.50,") in pairs
    assert ("thirty", "10:30") in pairs and ("fifth.", "5th.") in pairs
    assert [source for _, source in pairs if source.startswith("Sure")] == ["Sure!"]


def test_a_fragment_not_from_the_stream_is_refused():
    spoken = SpokenWords()
    spoken.feed("hello there", [])
    with pytest.raises(ValueError, match="not the next text"):
        spoken.words_of("goodbye")


def test_a_word_cut_between_fragments_knows_it_continues():
    normalizer, segmenter, spoken = TextNormalizer("en"), Segmenter(first_max_chars=20), SpokenWords()
    text = normalizer.push("We paid $3.50 today.") + normalizer.flush()
    spoken.feed(text, normalizer.take_spans())
    first, second = segmenter.push(text) + segmenter.flush()
    assert first == "We paid three"  # the cut falls inside "$3.50"'s reading
    first_words, second_words = spoken.words_of(first), spoken.words_of(second)
    assert [(w.source_text, w.continues) for w in first_words][-1] == ("$3.50", True)
    assert second_words[0].source == first_words[-1].source and not second_words[-1].continues


def test_a_word_running_over_into_the_next_chunk_is_reported_once_spanning_both():
    joiner = WordJoiner()
    first = joiner.chunk([SourceTiming(0, "We", 0.0, 0.2), SourceTiming(1, "$3.50", 0.3, 1.0, continues=True)], 1.0)
    second = joiner.chunk([SourceTiming(1, "$3.50", 0.0, 0.8), SourceTiming(2, "today.", 0.9, 1.4)], 1.5)
    assert first == (WordTiming("We", 0.0, 0.2),)
    assert second == (WordTiming("$3.50", -0.7, 0.8), WordTiming("today.", 0.9, 1.4))


@pytest.mark.parametrize("text", TRICKY_TEXTS)
def test_every_spoken_word_maps_to_an_agent_word_in_order_however_the_text_is_cut(text):
    rng = random.Random(len(text))
    one_shot = spoken_words_of([text])
    assert one_shot, text
    for _ in range(10):
        cuts = sorted(rng.sample(range(1, len(text)), min(8, len(text) - 1)))
        words = spoken_words_of([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
        assert words == one_shot
        sources = [word.source for word in words]
        assert sources == sorted(sources)


def spoken_words_of(deltas: list[str]) -> list[SpokenWord]:
    """The spoken words of every fragment the agent's deltas make, in order."""
    normalizer, segmenter, spoken = TextNormalizer(), Segmenter(), SpokenWords()
    fragments = []
    for delta in [*deltas, None]:
        text = normalizer.push(delta) if delta is not None else normalizer.flush()
        spoken.feed(text, normalizer.take_spans())
        fragments += segmenter.push(text) + ([] if delta is not None else segmenter.flush())
    # A word cut between fragments is flagged in the first; the words themselves do not change.
    return [SpokenWord(w.text, w.source, w.source_text) for f in fragments for w in spoken.words_of(f)]
