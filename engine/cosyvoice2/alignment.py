"""Word timings for CosyVoice2: when the LM had read each word, paced like the voice's prompt.

The LM reads the reply's text in rounds (bistream: 5 text tokens, then up to 15 speech
tokens at 25 Hz; at the end of the text, the rest of it and speech until eos). So for every
speech token it is known how many text tokens the LM had read when it made it (the stages'
``on_text_read``). That bounds when a word can be spoken, but only from below, and loosely:
the mix reads text faster than it is spoken, so the text runs ahead of the speech further
and further as a reply goes on. The other thing known for free is how fast the voice speaks:
its prompt's speech tokens per text token. So (all in speech tokens):

- a word is *read* at the first speech token made after the LM had read its last text token;
- it starts when it is read, or when the word before it has been said, whichever is later; a
  word takes as many speech tokens as its text tokens times the prompt's rate;
- each word goes with the first audio chunk whose audio reaches its start, clamped into that
  chunk: it ends when it has been said, or where the next word starts, or where the chunk
  ends, whichever is first. The final chunk carries every word left, squeezed into it if the
  pace would run past the end of the reply.

So a start is never before the LM had read the word, and the pace is the voice's, not the
reply's: a reply spoken faster or slower than the prompt drifts until the final chunk. See
docs/cosyvoice2.md for how approximate that is.

Speech token ``k`` covers samples ``[k, k + 1) * samples_per_token`` of the reply's audio
(the chunks' cross-fade keeps that timeline: what one chunk holds back, the next one plays).
"""

from __future__ import annotations

import bisect
import collections
import math
from collections.abc import Sequence
from dataclasses import dataclass

from tts_gateway.engine.base import WordTiming
from tts_gateway.engine.text.spoken_words import SpokenWord


@dataclass(slots=True, eq=False)
class _Word:
    text: str  # the agent word ("$3.50")
    source: int  # the agent word's number in the utterance
    last_text_token: int  # the reply's text token that completes it
    text_tokens: int  # text tokens since the word before's last one: how long it takes to say
    start: float | None = None  # estimated start and end in speech tokens, once the LM has read it
    end: float | None = None


class WordClock:
    """One utterance's words, from the text it sends the LM to the chunks that carry them.

    Fed, on the event loop and in order: :meth:`add_text` with each piece of normalised text
    sent to the LM, :meth:`text_read`, :meth:`speech` and :meth:`speech_ended` as the LM
    stage reports, and :meth:`chunk` for each audio chunk, which returns the words it carries.
    ``speech_per_text_token``: the voice prompt's pace.
    """

    def __init__(self, samples_per_token: int, speech_per_text_token: float) -> None:
        self._samples_per_token = samples_per_token
        self._pace = speech_per_text_token
        self._pending: collections.deque[_Word] = collections.deque()  # not carried by a chunk yet
        self._unread: collections.deque[_Word] = collections.deque()  # not read by the LM yet
        self._text_tokens = 0  # the reply's text tokens so far
        self._last_word_token = -1  # the last text token of the last word so far
        self._read = 0  # of them, those the LM had read for the speech tokens that follow
        self._speech = 0  # speech tokens made
        self._said = 0.0  # where the last word read ends (speech tokens)
        self._audio = 0  # samples of the reply's audio carried so far

    def add_text(self, text: str, token_ends: Sequence[int], words: Sequence[SpokenWord]) -> None:
        """A piece of normalised text sent to the LM: its text tokens (where each ends in
        ``text``) and its spoken words (:class:`~tts_gateway.engine.text.spoken_words.SpokenWords`)."""
        at = 0
        for spoken in words:
            at = text.index(spoken.text, at) + len(spoken.text)
            # The token holding the word's last character; a character of several byte tokens
            # (a CJK one) is read with the last of them.
            holding = min(bisect.bisect_right(token_ends, at - 1), len(token_ends) - 1)
            last = self._text_tokens + bisect.bisect_right(token_ends, token_ends[holding]) - 1
            previous = self._unread[-1] if self._unread else None
            if previous is not None and previous.source == spoken.source:  # "$3.50" read as several words
                previous.text_tokens += last - previous.last_text_token
                previous.last_text_token = last
            else:
                word = _Word(spoken.source_text, spoken.source, last, last - self._last_word_token)
                self._pending.append(word)
                self._unread.append(word)
            self._last_word_token = last
        self._text_tokens += len(token_ends)

    def text_read(self, count: int) -> None:
        """The speech tokens from now on were made with ``count`` of the reply's text tokens read."""
        self._read = count

    def speech(self, count: int) -> None:
        """``count`` more speech tokens were made."""
        self._place_read_words()
        self._speech += count

    def speech_ended(self) -> None:
        """The LM has made the reply's last speech token: words it has not read yet (none,
        unless it ended the reply itself) follow the others at the pace."""
        self._read = math.inf
        self._place_read_words()

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
        spt = self._samples_per_token
        starts = [word.start * spt if word.start is not None else math.inf for word in self._pending]
        carried = len(starts) if final else bisect.bisect_left(starts, end)
        if not carried:
            return ()
        words = [self._pending.popleft() for _ in range(carried)]
        ends = [word.end * spt for word in words]
        starts = starts[:carried]
        if final and ends[-1] > end:  # the pace runs past the reply's end: squeeze into the chunk
            lo = min(max(starts[0], start), end)
            squeeze = (end - lo) / (ends[-1] - lo)
            starts, ends = ([lo + (t - lo) * squeeze for t in times] for times in (starts, ends))
        scale = duration_s / samples
        timings = []
        for k, word in enumerate(words):
            t0 = min(max(starts[k], start), end)
            t1 = max(t0, min(ends[k], starts[k + 1] if k + 1 < carried else end, end))
            timings.append(WordTiming(word.text, (t0 - start) * scale, (t1 - start) * scale))
        return tuple(timings)

    def _place_read_words(self) -> None:
        """Start each word the LM has now read: once read, and once the word before is said."""
        while self._unread and self._unread[0].last_text_token < self._read:
            word = self._unread.popleft()
            word.start = max(float(self._speech), self._said)
            word.end = self._said = word.start + word.text_tokens * self._pace
