"""Word timings for Piper: the VITS model's own phoneme durations, mapped to the agent's words.

Piper's VITS graph predicts how many audio frames each phoneme id lasts (its duration
predictor, rounded up by a ``Ceil`` node) and expands the phonemes by exactly that much;
the audio is ``sum(durations) * hop`` samples. :func:`with_durations` makes that tensor a
second output of the graph, so one run gives the audio and its timing.

espeak phonemizes a whole sentence at once and joins some words ("in the" -> "ɪnðə"), so
phonemes cannot be counted off per word. Each spoken word is phonemized alone, and the
sentence's phonemes are aligned to those words' (difflib); a sentence phoneme no word
claims belongs to the word before it. A word's time runs from its first phoneme's start to
its last phoneme's end, including the pad the model puts after each phoneme.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tts_gateway.engine.base import WordTiming
from tts_gateway.engine.text.spoken_words import SpokenWord

log = logging.getLogger(__name__)

# Phonemes that are not sounds of a word: word breaks, stress marks, punctuation.
_NOT_SOUNDS = frozenset(" ˈˌ!'(),-.:;?\"")


def with_durations(model_path: Path) -> tuple[bytes, str | None]:
    """The model, serialized, with the phoneme durations as an extra output, and that output's name.

    A graph without exactly one ``Ceil`` node (not a Piper VITS export) comes back as it is,
    with ``None``: the voice then speaks without word timings.
    """
    import onnx

    model = onnx.load(str(model_path))
    ceils = [node for node in model.graph.node if node.op_type == "Ceil"]
    if len(ceils) != 1:
        log.warning("%s has %d Ceil nodes, not the one VITS duration: no word timings", model_path, len(ceils))
        return model.SerializeToString(), None
    name = ceils[0].output[0]
    model.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    return model.SerializeToString(), name


def phoneme_times(durations: np.ndarray, phoneme_count: int, seconds_per_frame: float) -> np.ndarray:
    """Start and end (seconds) of each phoneme, from the per-id durations of one run.

    Piper's ids are ``BOS PAD (phoneme PAD)* EOS``: phoneme k is id ``2 + 2k``, followed by its pad.
    """
    frames = durations.reshape(-1)
    if frames.size != 3 + 2 * phoneme_count:
        raise ValueError(f"{frames.size} durations for {phoneme_count} phonemes")
    ends = np.cumsum(frames) * seconds_per_frame
    starts = ends - frames * seconds_per_frame
    first = 2 + 2 * np.arange(phoneme_count)
    return np.stack([starts[first], ends[first + 1]], axis=1)


def label_phonemes(sentence: Sequence[str], words: Sequence[Sequence[str]]) -> list[int | None]:
    """For each phoneme of ``sentence``, the index of the word in ``words`` it belongs to.

    ``words`` are the sentence's words phonemized one by one. Break and stress marks get None.
    """
    sounds = [i for i, p in enumerate(sentence) if p not in _NOT_SOUNDS]
    reference = [(p, w) for w, phonemes in enumerate(words) for p in phonemes if p not in _NOT_SOUNDS]
    matcher = difflib.SequenceMatcher(None, [sentence[i] for i in sounds], [p for p, _ in reference], autojunk=False)
    owner: list[int | None] = [None] * len(sounds)
    for tag, a0, a1, b0, b1 in matcher.get_opcodes():
        if tag in ("equal", "replace") and b1 > b0:
            for k in range(a0, a1):  # spread a replaced run over the reference run evenly
                owner[k] = reference[b0 + (k - a0) * (b1 - b0) // (a1 - a0)][1]
    labels: list[int | None] = [None] * len(sentence)
    previous = 0
    for k, i in enumerate(sounds):
        # Unclaimed sounds join the word before; words never go backwards.
        previous = max(previous, owner[k]) if owner[k] is not None else previous
        labels[i] = previous
    return labels


@dataclass(frozen=True, slots=True)
class SourceTiming:
    """An agent word's time inside one chunk (seconds from its start)."""

    source: int  # the agent word's number in the utterance
    text: str
    start_s: float
    end_s: float
    continues: bool = False  # its reading goes on in the next chunk


def time_words(
    words: Sequence[SpokenWord],
    sentences: Sequence[Sequence[str]],
    sentence_times: Sequence[np.ndarray],
    phonemize_word: Callable[[str], list[str]],
) -> list[list[SourceTiming]]:
    """Each sentence's agent words with their times inside that sentence's audio.

    ``sentences`` are the phonemes of one fragment, ``words`` its spoken words in order,
    ``sentence_times`` each sentence's :func:`phoneme_times`. Spoken words of one agent word
    ("three dollars and fifty cents") merge into one timing of the agent word ("$3.50").
    """
    if not words:
        return [[] for _ in sentences]
    flat = [p for sentence in sentences for p in sentence]
    labels = label_phonemes(flat, [phonemize_word(word.text) for word in words])
    timings: list[list[SourceTiming]] = []
    at = 0
    for sentence, times in zip(sentences, sentence_times):
        spans: dict[int, list[float]] = {}  # agent word number -> [start, end]
        texts: dict[int, str] = {}
        for k in range(len(sentence)):
            label = labels[at + k]
            if label is None:
                continue
            word = words[label]
            start, end = float(times[k][0]), float(times[k][1])
            span = spans.setdefault(word.source, [start, end])
            span[0], span[1] = min(span[0], start), max(span[1], end)
            texts[word.source] = word.source_text
        at += len(sentence)
        timings.append([SourceTiming(s, texts[s], start, end) for s, (start, end) in spans.items()])
    _mark_continuations(timings, words[-1])
    return timings


def _mark_continuations(timings: list[list[SourceTiming]], last_word: SpokenWord) -> None:
    """Flag each sentence's last word when the next sentence (or fragment) goes on with it."""
    for k, sentence in enumerate(timings):
        if not sentence:
            continue
        later = next((t for t in timings[k + 1 :] if t), None)
        last = sentence[-1]
        goes_on = later[0].source == last.source if later else last_word.continues and last_word.source == last.source
        if goes_on:
            sentence[-1] = SourceTiming(last.source, last.text, last.start_s, last.end_s, continues=True)


class WordJoiner:
    """One utterance's chunk timings, in order, to the words it reports: a word whose reading
    runs over into the next chunk is reported once, with the next chunk, spanning both."""

    def __init__(self) -> None:
        self._held: SourceTiming | None = None  # times from the utterance's start
        self._chunk_start_s = 0.0

    def chunk(self, timings: Sequence[SourceTiming], duration_s: float) -> tuple[WordTiming, ...]:
        """The words to report with a chunk of ``duration_s`` seconds, times from its start."""
        offset = self._chunk_start_s
        self._chunk_start_s += duration_s
        words = []
        for timing in timings:
            held, self._held = self._held, None
            start_s = timing.start_s
            if held is not None:
                if held.source == timing.source:
                    start_s = held.start_s - offset
                else:  # never cut after all: report it as it was
                    words.append(WordTiming(held.text, held.start_s - offset, held.end_s - offset))
            if timing.continues:
                self._held = SourceTiming(timing.source, timing.text, start_s + offset, timing.end_s + offset)
            else:
                words.append(WordTiming(timing.text, start_s, timing.end_s))
        return tuple(words)
