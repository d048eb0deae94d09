"""Markdown stripping: the second stage of the streaming text normaliser.

Agents write chat-style Markdown; the voice must not say "asterisk asterisk".
This stage turns the character stream into plain prose and commits it as
early as it safely can.  It holds text back only while a construct is still
undecided:

- the start of a line, until a character shows whether it opens a heading,
  list item, blockquote, table rule, horizontal rule or code fence;
- a run of ``*``/``_``/``~`` until the next character shows whether it is an
  emphasis marker (deleted) or literal (``2*3``, ``snake_case``);
- ``[``, ``![``, ``<`` and backticks until the link, image, tag or code span
  is closed (or the line ends, which makes them literal);
- a ``!`` or ``\\`` at the very end of the input.

Every decision depends only on text already seen, so any way of splitting
the input into deltas gives the same output.

What is read how:

- emphasis markers, strikethrough ``~~``, inline-code backticks: removed;
  inline code text is kept verbatim;
- fenced code blocks (```` ``` ```` / ``~~~``): dropped entirely, fence lines
  and content - a listener cannot follow code read aloud;
- headings, list bullets, numbered-list markers ("1." is dropped; the item is
  its own sentence), task boxes, blockquote ``>``: markers removed, text kept;
- ``[text](url)`` -> text, ``![alt](url)`` -> alt, ``[text][ref]`` -> text,
  bare citation marks like ``[1]`` -> dropped, ``<https://x>`` -> the URL,
  HTML tags -> dropped;
- table pipes -> spaces, table rule rows and horizontal rules -> dropped;
- every line break is a sentence break: when the text before it does not
  end in punctuation a "." (or "。" after Chinese) is added so the voice
  pauses between list items, headings and paragraphs;
- runs of spaces collapse to one; no space at the start.
"""

from __future__ import annotations

import re

from .script import is_cjk

# Characters that can make up the markers at the start of a Markdown line.
# The line's kind is decided at the first character outside this set.
_LINE_MARKERS = re.compile(r"[ \t#>*\-+_`~|:=.)0-9\[\]xX•]*")

_FENCE = re.compile(r"[ \t]{0,3}(`{3,}|~{3,})")
_HORIZONTAL_RULE = re.compile(r"[ \t]*([-*_])(?:[ \t]*\1){2,}[ \t]*")
_SETEXT_UNDERLINE = re.compile(r"[ \t]*=+[ \t]*")
_TABLE_RULE = re.compile(r"[ \t|:-]*")
_LINE_PREFIX = re.compile(
    r"""
    [ \t]*
    (?:>[ \t]?)*                 # blockquote markers, possibly nested
    [ \t]*
    (?:
        \#{1,6}(?:[ \t]+|(?=\n)|$)   # ATX heading
      | [-*+•][ \t]+                 # bullet
      | \d{1,2}[.)][ \t]+            # numbered item
    )?
    (?:\[[ xX]\][ \t]+)?         # task-list box
    """,
    re.VERBOSE,
)
_PLAIN_RUN = re.compile(r"[^ \n\\`*_~|\[!<]+")
_CITATION = re.compile(r"\d+(?:\s*[,–-]\s*\d+)*")
_AUTOLINK = re.compile(r"(?:https?|ftp)://\S+|[\w.+-]+@[\w-]+(?:\.[\w-]+)+")
_HTML_TAG = re.compile(r"/?[A-Za-z][A-Za-z0-9-]*(?:\s[^<>]*)?/?|!--.*--")
_ASCII_PUNCT = frozenset("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")

_SENTENCE_END = frozenset(".!?…。！？")
_CLAUSE_END = frozenset(",;:、，；：")
_CLOSERS = frozenset("\"'”’)]」』》）】")

# How far ahead an unclosed construct may look before it is taken literally;
# bounds how long a stray "[" or "`" can delay speech.
_LINK_TEXT_LIMIT = 300
_LINK_TARGET_LIMIT = 1000
_CODE_SPAN_LIMIT = 300
_TAG_LIMIT = 300


class MarkdownStripper:
    """Streaming Markdown -> plain text.  ``push``/``flush`` return new output."""

    def __init__(self) -> None:
        self._buf = ""
        self._at_line_start = True
        self._fence: str | None = None  # opening fence while inside a code block
        self._skip_line = False  # dropping the rest of a rule or closing fence line
        self._prev = "\n"  # last raw character on this line (emphasis flanking)
        self._space_emitted = False  # the last character emitted was a space
        self._tail = ""  # last few non-space characters emitted (sentence breaks)

    def push(self, text: str) -> str:
        self._buf += text
        return self._run(final=False)

    def flush(self, text: str = "") -> str:
        self._buf += text
        return self._run(final=True)

    # -- driver -------------------------------------------------------------

    def _run(self, final: bool) -> str:
        buf, out, i, n = self._buf, [], 0, len(self._buf)
        while i < n:
            if buf[i] == "\n":
                if self._fence is None:
                    self._line_break(out)
                self._at_line_start, self._skip_line, self._prev = True, False, "\n"
                i += 1
            elif self._at_line_start:
                j = self._line_start(buf, i, final)
                if j is None:
                    break
                i = j
            elif self._fence is not None or self._skip_line:
                newline = buf.find("\n", i)
                i = n if newline < 0 else newline
            else:
                j = self._inline(buf, i, n, final, out)
                if j is None:
                    break
                i = j
        self._buf = buf[i:]
        return "".join(out)

    # -- output -------------------------------------------------------------

    def _emit(self, text: str, out: list[str]) -> None:
        for index, part in enumerate(text.split(" ")):
            if index:
                self._space(out)
            if part:
                out.append(part)
                self._space_emitted = False
                self._tail = (self._tail + part)[-8:]

    def _space(self, out: list[str]) -> None:
        # Spaces go out at once (so the next stage can commit the word before
        # them), collapsed, and never at the very start.
        if self._tail and not self._space_emitted:
            out.append(" ")
            self._space_emitted = True

    def _line_break(self, out: list[str]) -> None:
        if not self._tail:
            return
        last = self._tail.rstrip("".join(_CLOSERS))[-1:]
        if last not in _SENTENCE_END and last not in _CLAUSE_END:
            # May follow a space already sent; the word stage attaches
            # punctuation to the word before it.
            self._emit("。" if is_cjk(last) else ".", out)
        self._space(out)

    # -- line starts ----------------------------------------------------------

    def _line_start(self, buf: str, i: int, final: bool) -> int | None:
        n = len(buf)
        j = _LINE_MARKERS.match(buf, i).end()
        if j == n and not final:
            return None  # the line's kind is still open
        whole_line = j == n or buf[j] == "\n"
        head = buf[i:j]
        fence = _FENCE.match(head)
        if self._fence is not None:
            self._at_line_start = False
            if fence and fence.group(1)[0] == self._fence[0] and len(fence.group(1)) >= len(self._fence):
                self._fence = None
                self._skip_line = True
            return i  # the code line (or closing fence) is dropped
        if fence and fence.group(1)[0] == "`":
            # "```code```" on one line is inline code, not a fence: a backtick
            # fence's info string never contains a backtick.
            line_end = buf.find("\n", i)
            if line_end < 0 and not final:
                return None
            if "`" in buf[i + fence.end() : line_end if line_end >= 0 else n]:
                fence = None
        self._at_line_start = False
        if fence:
            self._fence = fence.group(1)
            return i  # the info string ("```python") is dropped with the block
        if whole_line and (
            _HORIZONTAL_RULE.fullmatch(head)
            or _SETEXT_UNDERLINE.fullmatch(head)
            or ("|" in head and "-" in head and _TABLE_RULE.fullmatch(head))
        ):
            self._skip_line = True
            return i
        prefix = _LINE_PREFIX.match(buf, i, j + 1 if j < n else n)
        end = prefix.end() if prefix else i
        if end > i:
            self._prev = " "
        return end

    # -- inline constructs ----------------------------------------------------

    def _inline(self, buf: str, i: int, limit: int, final: bool, out: list[str]) -> int | None:
        """Consume one inline item at ``buf[i]``; None if it is still undecided.

        ``limit`` ends the text this item may look at; ``final`` says nothing
        more will follow it.
        """
        plain = _PLAIN_RUN.match(buf, i, limit)
        if plain:
            self._emit(plain.group(), out)
            self._prev = buf[plain.end() - 1]
            return plain.end()
        ch = buf[i]
        if ch == " " or ch == "|":  # "|" separates table cells
            self._space(out)
            self._prev = ch
            return i + 1
        if ch == "\\":
            if i + 1 >= limit:
                if not final:
                    return None
                self._prev = ch
                return i + 1
            escaped = buf[i + 1]
            if escaped in _ASCII_PUNCT:
                self._emit(escaped, out)
                self._prev = escaped
                return i + 2
            self._prev = ch
            return i + 1  # a backslash that escapes nothing is not spoken
        if ch == "`":
            return self._code_span(buf, i, limit, final, out)
        if ch in "*_~":
            return self._emphasis(buf, i, limit, final, out)
        if ch in "[!":
            return self._link(buf, i, limit, final, out)
        return self._angle(buf, i, limit, final, out)

    def _literal(self, text: str, i: int, out: list[str]) -> int:
        self._emit(text, out)
        self._prev = text[-1]
        return i + len(text)

    def _emphasis(self, buf: str, i: int, limit: int, final: bool, out: list[str]) -> int | None:
        marker = buf[i]
        j = i
        while j < limit and buf[j] == marker:
            j += 1
        if j == limit and not final:
            return None  # the run may grow, and we need the character after it
        before = self._prev
        after = buf[j] if j < limit else "\n"
        run = buf[i:j]
        literal = (
            (marker == "~" and len(run) < 2)  # "~5" means "about five"
            or (before.isspace() and after.isspace())  # "2 * 3", "a _ b"
            or (marker == "_" and before.isalnum() and after.isalnum())  # snake_case
            or (marker == "*" and before.isdigit() and after.isdigit())  # 2*3
        )
        if literal:
            return self._literal(run, i, out)
        self._prev = marker
        return j

    def _code_span(self, buf: str, i: int, limit: int, final: bool, out: list[str]) -> int | None:
        j = i
        while j < limit and buf[j] == "`":
            j += 1
        if j == limit and not final:
            return None
        width = j - i
        k = j
        horizon = min(limit, j + _CODE_SPAN_LIMIT)
        while True:
            while k < horizon and buf[k] not in "`\n":
                k += 1
            if k == horizon:
                if horizon == limit and not final:
                    return None
                break  # unclosed within reach: the backticks were literal
            if buf[k] == "\n":
                break
            close = k
            while close < limit and buf[close] == "`":
                close += 1
            if close == limit and not final:
                return None
            if close - k == width:
                self._emit(buf[j:k], out)  # code text is spoken as written
                self._prev = "`"
                return close
            k = close
        # No closing run: drop the stray backticks, keep the text.
        self._prev = "`"
        return j

    def _link(self, buf: str, i: int, limit: int, final: bool, out: list[str]) -> int | None:
        if buf[i] == "!":
            if i + 1 >= limit:
                return None if not final else self._literal("!", i, out)
            if buf[i + 1] != "[":
                return self._literal("!", i, out)
            start = i + 2
        else:
            start = i + 1
        close = self._scan(buf, start, limit, "]", "[\n", _LINK_TEXT_LIMIT)
        if close is None:
            return None if not final else self._literal(buf[i], i, out)
        if close < 0:
            return self._literal(buf[i], i, out)
        if close + 1 >= limit:
            if not final:
                return None
            follower = ""
        else:
            follower = buf[close + 1]
        if follower in "([":
            end = self._scan(buf, close + 2, limit, ")" if follower == "(" else "]", "\n", _LINK_TARGET_LIMIT)
            if end is None:
                return None if not final else self._literal(buf[i], i, out)
            if end < 0:
                return self._literal(buf[i], i, out)
            self._inline_text(buf, start, close, out)
            self._prev = buf[end]
            return end + 1
        if buf[i] == "[" and _CITATION.fullmatch(buf[start:close]):
            self._prev = "]"
            return close + 1  # "[1]" citation marks are not read
        return self._literal(buf[i], i, out)

    @staticmethod
    def _scan(buf: str, start: int, limit: int, closer: str, stoppers: str, reach: int) -> int | None:
        """Index of ``closer`` (parentheses nest), -1 if a stopper or the reach
        comes first, None if the text runs out before deciding."""
        depth = 0
        horizon = min(limit, start + reach)
        k = start
        while k < horizon:
            ch = buf[k]
            if closer == ")" and ch == "(":
                depth += 1
            elif ch == closer:
                if depth == 0:
                    return k
                depth -= 1
            elif ch in stoppers:
                return -1
            k += 1
        if horizon == limit:
            return None
        return -1

    def _inline_text(self, buf: str, start: int, end: int, out: list[str]) -> None:
        """Strip inline Markdown inside complete link text."""
        self._prev = "["
        k = start
        while k < end:
            step = self._inline(buf, k, end, True, out)
            assert step is not None  # final=True always decides
            k = step

    def _angle(self, buf: str, i: int, limit: int, final: bool, out: list[str]) -> int | None:
        if i + 1 >= limit:
            return None if not final else self._literal("<", i, out)
        if not (buf[i + 1].isalpha() or buf[i + 1] in "/!"):
            return self._literal("<", i, out)
        close = self._scan(buf, i + 1, limit, ">", "<\n", _TAG_LIMIT)
        if close is None:
            return None if not final else self._literal("<", i, out)
        if close < 0:
            return self._literal("<", i, out)
        inner = buf[i + 1 : close]
        if _AUTOLINK.fullmatch(inner):
            self._emit(inner, out)
        elif _HTML_TAG.fullmatch(inner):
            self._space(out)  # "<br>" separates words
        else:
            return self._literal("<", i, out)
        self._prev = ">"
        return close + 1
