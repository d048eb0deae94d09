"""Token stage of the streaming normaliser: plain text in, spoken form out.

Input is plain text from :mod:`tts_gateway.engine.text.markdown`.  It is cut into tokens:
runs of non-space characters, except that every CJK character or CJK
punctuation mark is a token of its own (Chinese has no spaces, and we do not
want to wait for a whole sentence).

A token is committed once it is complete - followed by a space or a CJK
character, or the input is flushed - and, when its reading depends on what
comes next (numbers, "St.", "No.", "etc.", a dash between numbers), once the
next token is complete too.  Everything a reading may look at is then known
and final, so the output does not depend on how the agent's deltas were cut.

Spacing: runs of spaces collapse to one, spaces between CJK characters are
dropped, no space is put before closing punctuation, and a trailing space is
held until more text follows (so output never ends in a space; after a
``flush()`` it is sent with the next word).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .script import BOUNDARY_CLASS, is_cjk, is_cjk_boundary
from .verbalize import Context, needs_next, render, split_token

_WORD_RUN = re.compile(f"[^\\s{BOUNDARY_CLASS}]*")
_NO_SPACE_BEFORE = frozenset(",.;:!?…)]}%")
_PAUSES = frozenset(",.;:!?…，。；：！？、")
# How many following tokens may be examined to find the next word when
# deciding whether a number sits in Chinese context.
_CONTEXT_REACH = 2


@dataclass(frozen=True, slots=True)
class SourceSpan:
    """Output characters ``start:end`` (counted from the stream's start) speak input ``token``."""

    token: str
    start: int
    end: int


class _NeedMore(Exception):
    """The input ends before a decision can be made."""


class WordNormalizer:
    """Streaming plain text -> spoken form.  ``push``/``flush`` return new output."""

    def __init__(self, language: str = "auto") -> None:
        if language not in ("auto", "en", "zh"):
            raise ValueError(f"language must be 'auto', 'en' or 'zh', not {language!r}")
        self._language = language
        self._buf = ""
        self._prev_core = ""  # previous token without its punctuation
        self._prev_letter = ""  # last letter (Latin or CJK) seen before the current token
        self._last_out = ""  # last character emitted
        self._pending_space = False
        self._emitted = 0  # characters of output so far, across push/flush calls
        self._spans: list[SourceSpan] = []  # spoken spans not yet taken by take_spans()

    def push(self, text: str) -> str:
        self._buf += text
        return self._run(final=False)

    def take_spans(self) -> list[SourceSpan]:
        """Which input token each piece of the output so far speaks, oldest first, once each."""
        spans, self._spans = self._spans, []
        return spans

    def flush(self, text: str = "") -> str:
        self._buf += text
        return self._run(final=True)

    # -- tokenising -----------------------------------------------------------

    def _token_at(self, pos: int, final: bool) -> tuple[str, int]:
        """The token starting at ``pos`` (no leading space); raises if incomplete."""
        buf = self._buf
        if is_cjk_boundary(buf[pos]):
            return buf[pos], pos + 1
        end = _WORD_RUN.match(buf, pos).end()
        if end == len(buf) and not final:
            raise _NeedMore
        return buf[pos:end], end

    def _skip_space(self, pos: int) -> int:
        buf = self._buf
        while pos < len(buf) and buf[pos].isspace():
            pos += 1
        return pos

    def _next_token(self, pos: int, final: bool) -> tuple[str | None, int]:
        """The complete token after ``pos`` (None at the end of the input)."""
        pos = self._skip_space(pos)
        if pos == len(self._buf):
            if final:
                return None, pos
            raise _NeedMore
        return self._token_at(pos, final)

    # -- driver -----------------------------------------------------------------

    def _run(self, final: bool) -> str:
        out: list[str] = []
        pos = 0
        buf = self._buf
        while pos < len(buf):
            if buf[pos].isspace():
                pos = self._skip_space(pos)
                if self._last_out:
                    self._pending_space = True
                continue
            try:
                token, end = self._token_at(pos, final)
                spoken = self._speak(token, end, final)
            except _NeedMore:
                break
            self._emit(spoken, out, token)
            self._remember(token)
            pos = end
        self._buf = buf[pos:]
        return "".join(out)

    def _speak(self, token: str, end: int, final: bool) -> str:
        if len(token) == 1 and is_cjk_boundary(token):
            return token
        following = self._next_token(end, final)[0] if needs_next(token, self._prev_core) else None
        zh = self._language == "zh"
        if self._language == "auto":
            if any(ch.isdigit() for ch in token):
                zh = self._chinese_context(token, end, final)
            else:
                zh = is_cjk(self._prev_letter)
        return render(token, Context(zh=zh, prev=self._prev_core, next=following))

    def _chinese_context(self, token: str, end: int, final: bool) -> bool:
        """Whether the nearest letter before or after the number is CJK.

        Letters inside the token ("5th", "x86", "$5M") are nearer than
        anything outside it, and they are never CJK.
        """
        first_digit = next(i for i, ch in enumerate(token) if ch.isdigit())
        last_digit = max(i for i, ch in enumerate(token) if ch.isdigit())
        before = [ch for ch in token[:first_digit] if ch.isalpha()]
        after = [ch for ch in token[last_digit + 1 :] if ch.isalpha()]
        if not before and is_cjk(self._prev_letter):
            return True
        return not after and is_cjk(self._next_letter(end, final))

    def _next_letter(self, pos: int, final: bool) -> str:
        """The first letter after ``pos``, looking a couple of tokens ahead."""
        for _ in range(_CONTEXT_REACH):
            following, pos = self._next_token(pos, final)
            if following is None:
                break
            for ch in following:
                if ch.isalpha():
                    return ch
        return ""

    def _remember(self, token: str) -> None:
        self._prev_core = split_token(token)[1] or token
        if any(ch.isdigit() for ch in token):
            return  # letters in "$5M" or "10kg" are suffixes, not context
        for ch in reversed(token):
            if ch.isalpha():
                self._prev_letter = ch
                break

    def _emit(self, spoken: str, out: list[str], token: str) -> None:
        if spoken.startswith(",") and (not self._last_out or self._last_out in _PAUSES):
            spoken = spoken[1:].lstrip()  # "word, - next" must not say two commas
        if not spoken:
            return
        if self._pending_space:
            joined_cjk = is_cjk_boundary(self._last_out) and is_cjk_boundary(spoken[0])
            if not joined_cjk and spoken[0] not in _NO_SPACE_BEFORE:
                out.append(" ")
                self._emitted += 1
        self._pending_space = False
        out.append(spoken)
        self._spans.append(SourceSpan(token, self._emitted, self._emitted + len(spoken)))
        self._emitted += len(spoken)
        self._last_out = spoken[-1]
