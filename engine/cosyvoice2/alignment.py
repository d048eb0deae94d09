"""Word timings for CosyVoice2: when the LM had read each word, placed on the reply's audio.

The LM reads the reply's text in rounds (bistream: 5 text tokens, then up to 15 speech
tokens at 25 Hz; at the end of the text, the rest of it and speech until eos). So for every
speech token it is known how many text tokens the LM had read when it made it (the stages'
``on_text_read``). The model has no other tie between text and speech that serving can see
for free, so a word is timed from that:

- a word is *read at* the first speech token made after the LM had read all its text tokens;
- words read at the same token (one round's text) share the round's speech tokens, up to the
  token where the next round's words are read, in proportion to their spoken characters;
- each word goes with the first audio chunk whose audio reaches its estimated start, and its
  start and end are clamped to that chunk: it ends where the next word starts, the chunk's
  last word where the chunk ends.

The estimate runs early: the 5:15 mix keeps the text ahead of the speech, so the LM speaks a
word some time after it has read it, more so as a long reply goes on. The start is a lower
bound from what the LM had read, not a measurement of the audio (docs/cosyvoice2.md).

Speech token ``k`` covers samples ``[k, k + 1) * samples_per_token`` of the reply's audio
(the chunks' cross-fade keeps that timeline: what one chunk holds back, the next one plays).
"""

from __future__ import annotations

import bisect
import collections
import math
from collections.abc import Sequence
from dataclasses import dataclass

from engine.base import WordTiming
from engine.text.spoken_words import SpokenWord


@dataclass(slots=True)
class _Word:
    source: int  # the agent word's number in the utterance
    text: str  # the agent word ("$3.50")
    last_text_token: int  # the reply's text token that completes it
    weight: int  # characters spoken ("three dollars and fifty cents")
    read_at: int | None = None  # the first speech token made after the LM had read it


class WordClock:
    """One utterance's words, from the text it sends the LM to the chunks that carry them.

    Fed, on the event loop and in order: :meth:`add_text` with each piece of normalised text
    sent to the LM, :meth:`text_read` and :meth:`speech` as the LM stage reports, and
    :meth:`chunk` for each audio chunk, which returns the words that chunk carries.
    """

    def __init__(self, samples_per_token: int) -> None:
        self._samples_per_token = samples_per_token
        self._pending: collections.deque[_Word] = collections.deque()  # not carried by a chunk yet
        self._unread = 0  # index in _pending of the first word not read yet
        self._text_tokens = 0  # the reply's text tokens so far
        self._read = 0  # of them, those the LM had read for the speech tokens that follow
        self._speech = 0  # speech tokens made
        self._audio = 0  # samples of the reply's audio, on the speech tokens' timeline
        self._speech_ended = False  # the LM has made its last speech token

    def add_text(self, text: str, token_ends: Sequence[int], words: Sequence[SpokenWord]) -> None:
        """A piece of normalised text sent to the LM: its text tokens (where each ends in
        ``text``) and its spoken words (:class:`~engine.text.spoken_words.SpokenWords`)."""
        at = 0
        for word in words:
            at = text.index(word.text, at) + len(word.text)
            last = self._text_tokens + min(bisect.bisect_right(token_ends, at - 1), len(token_ends) - 1)
            previous = self._pending[-1] if len(self._pending) > self._unread else None
            if previous is not None and previous.source == word.source:  # "$3.50" read as several words
                previous.last_text_token = last
                previous.weight += len(word.text)
            else:
                self._pending.append(_Word(word.source, word.source_text, last, len(word.text)))
        self._text_tokens += len(token_ends)

    def text_read(self, count: int) -> None:
        """The speech tokens from now on were made with ``count`` of the reply's text tokens read."""
        self._read = count

    def speech(self, count: int) -> None:
        """``count`` more speech tokens were made."""
        pending = self._pending
        while self._unread < len(pending) and pending[self._unread].last_text_token < self._read:
            pending[self._unread].read_at = self._speech
            self._unread += 1
        self._speech += count

    def speech_ended(self) -> None:
        """The LM has made the reply's last speech token: the last round's length is known."""
        self._speech_ended = True

    def chunk(self, samples: int, duration_s: float, final: bool) -> tuple[WordTiming, ...]:
        """The words to send with the next audio chunk: ``samples`` of the reply's audio as
        made (``duration_s`` as played, after any change of speed). The final chunk carries
        every word left."""
        if samples <= 0:
            return ()
        start, end = self._audio, self._audio + samples
        self._audio = end
        estimates = self._estimated_starts(final)
        carried = len(estimates) if final else bisect.bisect_left(estimates, end)
        if not carried:
            return ()
        words = [self._pending.popleft() for _ in range(carried)]
        self._unread -= min(carried, self._unread)
        times = _spread_ties([min(max(e, start), end) for e in estimates[:carried]], [w.weight for w in words], end)
        scale = duration_s / samples
        return tuple(
            WordTiming(word.text, (times[k] - start) * scale, (times[k + 1] - start) * scale)
            for k, word in enumerate(words)
        )

    def _estimated_starts(self, final: bool) -> list[float]:
        """Each pending word's estimated start (samples on the reply's timeline): its round's
        speech tokens shared out by spoken characters.

        While the LM is still making the latest round's speech, only that round's first word
        has a start (the others' depend on how long the round gets): the rest are not due
        yet (infinite). Once the speech has ended, the last round runs to its last token and
        words never read start there.
        """
        pending = list(self._pending)
        read = self._unread
        closed = final or self._speech_ended
        starts: list[float] = []
        i = 0
        while i < read:
            group_end = i
            while group_end < read and pending[group_end].read_at == pending[i].read_at:
                group_end += 1
            first = pending[i].read_at
            if group_end < read:
                last = pending[group_end].read_at
            elif closed:
                last = self._speech
            else:
                starts.append(first * self._samples_per_token)
                break
            total = sum(word.weight for word in pending[i:group_end]) or 1
            before = 0
            for k in range(i, group_end):
                starts.append((first + (last - first) * before / total) * self._samples_per_token)
                before += pending[k].weight
            i = group_end
        later = self._speech * self._samples_per_token if closed else math.inf
        return starts + [later] * (len(pending) - len(starts))


def _spread_ties(starts: list[float], weights: list[int], end: float) -> list[float]:
    """Non-decreasing starts, with each run of equal ones (words clamped to the chunk's start)
    shared out by weight up to the next start; the chunk's ``end`` appended."""
    times = [*starts, end]
    i = 0
    while i < len(starts):
        j = i
        while j < len(starts) and starts[j] == starts[i]:
            j += 1
        span, total, before = times[j] - starts[i], sum(weights[i:j]) or 1, 0
        for k in range(i, j):
            times[k] = starts[i] + span * before / total
            before += weights[k]
        i = j
    return times
