"""Sentence segmentation: normalised text in, fragments to synthesise out.

The TTS engines speak one fragment at a time, and a fragment sounds best as a
whole sentence.  But the user hears nothing until the first fragment is
synthesised, so the first fragment of an utterance is kept short: it may end
at a sentence end once it holds two words (a one-word opener such as "Sure!"
would play out before the next fragment is ready, so it joins that one), at a
clause boundary (, ; : — ，、：) once it holds a few words, or at a word
boundary once it grows past ``first_max_chars``.  Later fragments end only at
sentence ends (. ! ? … 。！？；), and a sentence that runs past ``max_chars``
is cut at its last clause boundary, else its last word boundary.

A sentence end needs to see what follows it: "." at the very end of the
buffered text may still turn out to be part of "...", a closing quote may
follow, so it only counts once a space (or, after CJK punctuation, any
character) follows - or when ``flush()`` says nothing more is coming.

Every character of the input ends up in exactly one fragment, in order, with
two exceptions: whitespace at fragment edges is stripped, and a fragment that
would contain nothing speakable (only punctuation) is appended to the
fragment before it in the same batch, or dropped when there is none.
After ``flush()`` the next fragment is a "first" fragment again: a flush
means the client wanted audio now, so what follows starts a new utterance.
"""

from __future__ import annotations

from .script import is_cjk

_SENTENCE_END = frozenset(".!?…。！？；")
_CJK_SENTENCE_END = frozenset("。！？；")
_CLAUSE = frozenset(",;:—")
_CJK_CLAUSE = frozenset("，、：")
_CLOSERS = frozenset("\"'”’)]」』》）】")
# The first fragment may end at a sentence end only from this many words on.
FIRST_SENTENCE_MIN_WORDS = 2


def _count_words(text: str) -> int:
    """Words in ``text``; each CJK character counts as one word."""
    words = 0
    in_word = False
    for ch in text:
        if is_cjk(ch):
            words += 1
            in_word = False
        elif ch.isalnum() or ch in "'’":
            if not in_word:
                words += 1
            in_word = True
        else:
            in_word = False
    return words


def _speakable(fragment: str) -> bool:
    return any(ch.isalnum() for ch in fragment)


class Segmenter:
    """Incremental splitter of normalised text into TTS fragments."""

    def __init__(self, first_min_words: int = 3, first_max_chars: int = 60, max_chars: int = 220) -> None:
        if first_min_words < 1 or first_max_chars < 1 or max_chars < 1:
            raise ValueError("segment sizes must be positive")
        self._first_min_words = first_min_words
        self._first_max_chars = first_max_chars
        self._max_chars = max_chars
        self._buf = ""
        self._first = True

    def push(self, text: str) -> list[str]:
        """Add normalised text; return the fragments that are now complete."""
        self._buf += text
        return self._drain(final=False)

    def flush(self) -> list[str]:
        """Return everything buffered as fragment(s).  The segmenter stays usable."""
        fragments = self._drain(final=True)
        self._first = True
        return fragments

    def _drain(self, final: bool) -> list[str]:
        fragments: list[str] = []
        while True:
            cut = self._next_cut(final)
            if cut is None:
                break
            fragment, self._buf = self._buf[:cut].strip(), self._buf[cut:]
            if _speakable(fragment):
                fragments.append(fragment)
                self._first = False
            elif fragment and fragments:
                fragments[-1] += fragment  # stray closing punctuation
        return fragments

    def _next_cut(self, final: bool) -> int | None:
        """End of the next complete fragment in the buffer, or None."""
        buf = self._buf = self._buf.lstrip()
        n = len(buf)
        if n == 0:
            return None
        first = self._first
        limit = self._first_max_chars if first else self._max_chars
        last_clause = 0  # cut position after the latest clause boundary
        last_word = 0  # cut position at the latest word boundary
        i = 0
        while i < n:
            if i >= limit:
                if not first:
                    return last_clause or last_word or limit
                if last_word:
                    return last_word
                if i >= max(limit, self._max_chars):
                    return i  # no word boundary at all: a hard cut keeps latency bounded
                # One very long word (a URL): cut at the first space after it.
            ch = buf[i]
            if ch in _SENTENCE_END:
                j = i + 1
                while j < n and (buf[j] in _SENTENCE_END or buf[j] in _CLOSERS):
                    j += 1
                if j == n:
                    return n if final else None
                if buf[j].isspace() or any(c in _CJK_SENTENCE_END for c in buf[i:j]):
                    # A one-word opener ("Sure!", "Done.") is too short to speak alone: it
                    # plays out before the next fragment can be ready. It joins the next one.
                    if not (first and _count_words(buf[:j]) < FIRST_SENTENCE_MIN_WORDS):
                        return j
                    last_clause = j
                i = j  # "3.5", "a.b": not a sentence end
                continue
            if ch in _CLAUSE or ch in _CJK_CLAUSE:
                j = i + 1
                while j < n and buf[j] in _CLOSERS:
                    j += 1
                if j == n:
                    return n if final else None
                if buf[j].isspace() or ch not in _CLAUSE or ch == "—":
                    if first and _count_words(buf[:j]) >= self._first_min_words:
                        return j
                    last_clause = j
                i = j
                continue
            if ch.isspace():
                if first and i >= limit:
                    return i
                last_word = i
            elif is_cjk(ch) and i + 1 < n:
                last_word = i + 1  # any two CJK characters have a word boundary between them
            i += 1
        return n if final else None
