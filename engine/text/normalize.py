"""Streaming text normaliser: LLM reply deltas in, speakable text out.

Agents stream their reply as small text deltas - often cut mid-word, mid-number
or mid-Markdown.  :class:`TextNormalizer` turns that stream into plain spoken
form (Markdown and emoji removed, numbers, money, dates, times, URLs and
abbreviations written out in words) for an espeak-based English voice or the
CosyVoice Chinese voice.

It only commits text that nothing still to come can change: "$3." followed
by "50" must be read "three dollars and fifty cents", not "three dollars.
fifty".  Output therefore lags the input by about one token (two around
numbers, whose reading may depend on the next word).  ``flush()`` commits
everything when the client asks for speech now or the turn ends.

Three stages, each streaming and each deciding only on text it has fully
seen, so the committed output is the same for any way of cutting the input:

1. :mod:`.chars` - emoji, full-width forms, odd whitespace, split surrogates;
2. :mod:`.markdown` - Markdown to plain prose, line breaks to sentence breaks;
3. :mod:`.words` / :mod:`.verbalize` - tokens to their spoken form.

Language: ``"en"`` reads every number in English, ``"zh"`` in Chinese, and
``"auto"`` reads a number in Chinese when the nearest letter before it or
after it (within two tokens) is CJK.  Words are never translated.
"""

from __future__ import annotations

from .chars import CharCleaner
from .markdown import MarkdownStripper
from .words import SourceSpan, WordNormalizer


class TextNormalizer:
    """Incremental normaliser for one stream of agent text."""

    def __init__(self, language: str = "auto") -> None:
        self._chars = CharCleaner()
        self._markdown = MarkdownStripper()
        self._words = WordNormalizer(language)

    def push(self, delta: str) -> str:
        """Add raw text; return the normalised text that is now final ("" if none)."""
        return self._words.push(self._markdown.push(self._chars.push(delta)))

    def flush(self) -> str:
        """Commit everything held back.  The normaliser stays usable."""
        plain = self._markdown.flush(self._chars.flush())
        return self._words.flush(plain)

    def take_spans(self) -> list[SourceSpan]:
        """Which agent word each piece of the output so far speaks (output offsets), once each.

        The agent word is as the agent wrote it, less Markdown ("$3.50," for "three dollars
        and fifty cents,"). Word timings map the voice's words back to it through these.
        """
        return self._words.take_spans()


def normalize(text: str, language: str = "auto") -> str:
    """One-shot normalisation: the same as ``push(text) + flush()``."""
    normalizer = TextNormalizer(language)
    return normalizer.push(text) + normalizer.flush()
