"""Which agent word each spoken word of a fragment speaks.

The normaliser says which stretch of its output speaks which agent token
(:class:`~tts_gateway.engine.text.words.SourceSpan`); the segmenter cuts that output into
fragments, keeping every character in order but stripping whitespace at the edges.
:class:`SpokenWords` follows both: fed the normaliser's output and spans, it tells
for each fragment its words and the agent word behind each ("dollars" -> "$3.50"),
so an engine that times the words it speaks can report the agent's words.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass

from .script import BOUNDARY_CLASS
from .words import SourceSpan

# A spoken word: a run of non-space characters, except that every CJK character (or CJK
# punctuation mark) is a word of its own, as the normaliser makes it a token of its own.
_WORD = re.compile(f"[{BOUNDARY_CLASS}]|[^\\s{BOUNDARY_CLASS}]+")


@dataclass(frozen=True, slots=True)
class SpokenWord:
    text: str  # as the voice reads it: "dollars"
    source: int  # the agent word's number in the utterance, from 0
    source_text: str  # the agent word: "$3.50"
    # The agent word's reading goes on in the next fragment: the segmenter cut inside it
    # ("three dollars | and fifty cents"). Only ever true of a fragment's last word.
    continues: bool = False


class SpokenWords:
    """Maps one utterance's fragments back to the agent's words, fragment by fragment in order."""

    def __init__(self) -> None:
        self._stream = ""  # normalised output not yet passed by a fragment
        self._base = 0  # stream offset of self._stream[0]
        self._starts: list[int] = []  # span starts, ascending
        self._spans: list[SourceSpan] = []
        self._first_span = 0  # number of the agent word self._spans[0] speaks

    def feed(self, text: str, spans: list[SourceSpan]) -> None:
        """Add the normaliser's new output and the spans it reported with it."""
        self._stream += text
        self._spans.extend(spans)
        self._starts.extend(span.start for span in spans)

    def words_of(self, fragment: str) -> list[SpokenWord]:
        """The words of the next fragment, each with its agent word (punctuation-only ones left out)."""
        offsets = self._locate(fragment)
        if not offsets:
            return []
        words = []
        for match in _WORD.finditer(fragment):
            first = next((i for i in range(match.start(), match.end()) if fragment[i].isalnum()), None)
            if first is None:
                continue
            index = bisect.bisect_right(self._starts, offsets[first]) - 1
            if index < 0:
                raise ValueError(f"no agent word speaks {match.group()!r}")
            span = self._spans[index]
            words.append(SpokenWord(match.group(), self._first_span + index, span.token))
        if words:
            words[-1] = self._with_continuation(words[-1], offsets[-1])
        self._forget_before(offsets[-1])
        return words

    def _with_continuation(self, word: SpokenWord, fragment_end: int) -> SpokenWord:
        span = self._spans[word.source - self._first_span]
        rest = self._stream[fragment_end + 1 - self._base : span.end - self._base]
        if any(ch.isalnum() for ch in rest):
            return SpokenWord(word.text, word.source, word.source_text, continues=True)
        return word

    def _locate(self, fragment: str) -> list[int]:
        """Stream offset of each character of ``fragment`` (whitespace inside may differ in width)."""
        offsets = []
        stream, pos = self._stream, 0
        for ch in fragment:
            if ch.isspace():
                offsets.append(self._base + pos)
                continue
            while pos < len(stream) and stream[pos].isspace():
                pos += 1
            if pos == len(stream) or stream[pos] != ch:
                raise ValueError(f"fragment {fragment!r} is not the next text of the stream")
            offsets.append(self._base + pos)
            pos += 1
        return offsets

    def _forget_before(self, offset: int) -> None:
        """Drop the stream before ``offset`` and the spans that end before it."""
        cut = offset - self._base + 1
        self._stream, self._base = self._stream[cut:], self._base + cut
        keep = bisect.bisect_right(self._starts, offset) - 1
        if keep > 0:
            del self._spans[:keep], self._starts[:keep]
            self._first_span += keep
