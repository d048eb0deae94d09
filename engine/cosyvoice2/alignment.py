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


@dataclass(slots=True, eq=False)
class _Word:
    text: str  # the agent word ("$3.50")
    source: int  # the agent word's number in the utterance
    last_text_token: int  # the reply's text token that completes it
    weight: int  # characters spoken ("three dollars and fifty cents")
    read_at: int | None = None  # the first speech token made after the LM had read it
    start: float | None = None  # estimated start (samples), once its round's length is known


class WordClock:
    """One utterance's words, from the text it sends the LM to the chunks that carry them.

    Fed, on the event loop and in order: :meth:`add_text` with each piece of normalised text
    sent to the LM, :meth:`text_read`, :meth:`speech` and :meth:`speech_ended` as the LM
    stage reports, and :meth:`chunk` for each audio chunk, which returns the words it carries.
    """

    def __init__(self, samples_per_token: int) -> None:
        self._samples_per_token = samples_per_token
        self._pending: collections.deque[_Word] = collections.deque()  # not carried by a chunk yet
        self._unread: collections.deque[_Word] = collections.deque()  # not read by the LM yet
        self._round: list[_Word] = []  # read in the round the LM is making, whose length is open
        self._text_tokens = 0  # the reply's text tokens so far
        self._read = 0  # of them, those the LM had read for the speech tokens that follow
        self._speech = 0  # speech tokens made
        self._speech_ended = False
        self._audio = 0  # samples of the reply's audio carried so far, on the speech tokens' timeline

    def add_text(self, text: str, token_ends: Sequence[int], words: Sequence[SpokenWord]) -> None:
        """A piece of normalised text sent to the LM: its text tokens (where each ends in
        ``text``) and its spoken words (:class:`~engine.text.spoken_words.SpokenWords`)."""
        at = 0
        for spoken in words:
            at = text.index(spoken.text, at) + len(spoken.text)
            last = self._text_tokens + min(bisect.bisect_right(token_ends, at - 1), len(token_ends) - 1)
            previous = self._unread[-1] if self._unread else None
            if previous is not None and previous.source == spoken.source:  # "$3.50" read as several words
                previous.last_text_token = last
                previous.weight += len(spoken.text)
            else:
                word = _Word(spoken.source_text, spoken.source, last, len(spoken.text))
                self._pending.append(word)
                self._unread.append(word)
        self._text_tokens += len(token_ends)

    def text_read(self, count: int) -> None:
        """The speech tokens from now on were made with ``count`` of the reply's text tokens read."""
        self._read = count

    def speech(self, count: int) -> None:
        """``count`` more speech tokens were made."""
        read = []
        while self._unread and self._unread[0].last_text_token < self._read:
            read.append(self._unread.popleft())
        if read:  # a new round: the one before ends here
            self._close_round(self._speech)
            for word in read:
                word.read_at = self._speech
            self._round = read
        self._speech += count

    def speech_ended(self) -> None:
        """The LM has made the reply's last speech token: the last round ends there, and words
        it never read (none, unless it ended the reply early) start there."""
        if self._speech_ended:
            return
        self._speech_ended = True
        self._close_round(self._speech)
        for word in self._unread:
            word.start = self._speech * self._samples_per_token
        self._unread.clear()

    def chunk(self, samples: int, duration_s: float, final: bool) -> tuple[WordTiming, ...]:
        """The words to send with the next audio chunk: ``samples`` of the reply's audio as
        made (``duration_s`` as played, after any change of speed). The final chunk carries
        every word left."""
        if final:
            self.speech_ended()
        if samples <= 0:
            return ()
        start, end = self._audio, self._audio + samples
        self._audio = end
        estimates = [self._estimate(word) for word in self._pending]
        carried = len(estimates) if final else bisect.bisect_left(estimates, end)
        if not carried:
            return ()
        words = [self._pending.popleft() for _ in range(carried)]
        times = _spread_ties([min(max(e, start), end) for e in estimates[:carried]], [w.weight for w in words], end)
        scale = duration_s / samples
        return tuple(
            WordTiming(word.text, (times[k] - start) * scale, (times[k + 1] - start) * scale)
            for k, word in enumerate(words)
        )

    def _estimate(self, word: _Word) -> float:
        """A word's estimated start; in the round still being made only the first word has one
        (the others' depend on how long it gets), so the rest are not due yet (infinite)."""
        if word.start is not None:
            return word.start
        if self._round and word is self._round[0]:
            return word.read_at * self._samples_per_token
        return math.inf

    def _close_round(self, last: int) -> None:
        """The open round's speech ends before token ``last``: its words share it out by
        spoken characters."""
        words, self._round = self._round, []
        if not words:
            return
        first, total, before = words[0].read_at, sum(word.weight for word in words) or 1, 0
        for word in words:
            word.start = (first + (last - first) * before / total) * self._samples_per_token
            before += word.weight


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
