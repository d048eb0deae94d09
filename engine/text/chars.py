"""Character clean-up: the first stage of the streaming text normaliser.

Works one code point at a time, so it is trivially safe for streaming: the
only thing it ever holds back is a UTF-16 high surrogate whose partner has
not arrived yet (a client that slices JavaScript strings can split an emoji
between two deltas).

- surrogate pairs are re-joined, lone surrogates dropped;
- emoji are removed with everything that glues them together (skin tones,
  ZWJ, variation selectors, keycaps, tags, regional-indicator flags);
- full-width ASCII (１２３, ＡＢＣ, ％, ＄) becomes half-width, except the CJK
  punctuation a Chinese voice uses for prosody (！，：；？（）), which is kept;
- every kind of horizontal whitespace becomes a plain space; carriage
  returns vanish so "\\r\\n" is just a newline.
"""

from __future__ import annotations

import re
import unicodedata

_EMOJI = re.compile(
    "["
    "\U0001F000-\U0001FAFF"  # pictographs, emoticons, transport, flags, skin tones
    "\u2300-\u23FF"  # misc technical: ⌚ ⏰ ⏩
    "\u25A0-\u25FF"  # geometric shapes: ▶ ◀ ■ ●
    "\u2600-\u27BF"  # misc symbols and dingbats: ☀ ✅ ✨ ❤ ➡
    "\u2B00-\u2BFF"  # misc symbols and arrows: ⭐ ⬆ ⭕
    "\u2934\u2935\u3030\u303D\u3297\u3299"
    "\u00A9\u00AE\u2122\u2139\u24C2"  # © ® ™ ℹ Ⓜ
    "\uFE00-\uFE0F"  # variation selectors
    "\u200D"  # zero-width joiner
    "\u20E3"  # combining keycap
    "\U000E0000-\U000E007F"  # tag characters (subdivision flags)
    "]"
)
_SURROGATE_PAIR = re.compile("[\ud800-\udbff][\udc00-\udfff]")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")

# CJK punctuation that shares the full-width block but carries prosody for
# the Chinese voice: keep it as is.
_KEEP_FULL_WIDTH = set("！，：；？（）")


def _build_table() -> dict[int, str]:
    table: dict[int, str] = {ord("\r"): ""}
    for code in range(0xFF01, 0xFF5F):
        ch = chr(code)
        if ch not in _KEEP_FULL_WIDTH:
            table[code] = unicodedata.normalize("NFKC", ch)
    for ch in "￠￡￢￣￤￥￦℃℉":  # "℃" -> "°C" so units read the same either way
        table[ord(ch)] = unicodedata.normalize("NFKC", ch)
    for code in range(0x3001):  # every Unicode space character lies below U+3001
        ch = chr(code)
        if ch != "\n" and ch.isspace():
            table[code] = " "
    # Invisible format characters that would otherwise split words.
    for ch in "\u200b\u200c\u2060\ufeff\u00ad":
        table[ord(ch)] = ""
    return table


_TABLE = _build_table()


def _join_pair(match: re.Match[str]) -> str:
    high, low = match.group()
    return chr(0x10000 + ((ord(high) - 0xD800) << 10) + (ord(low) - 0xDC00))


def clean(text: str) -> str:
    """Clean a complete piece of text (no dangling high surrogate)."""
    text = _SURROGATE_PAIR.sub(_join_pair, text)
    text = _LONE_SURROGATE.sub("", text)
    return _EMOJI.sub("", text).translate(_TABLE)


class CharCleaner:
    """Streaming wrapper around :func:`clean`."""

    def __init__(self) -> None:
        self._high_surrogate = ""

    def push(self, delta: str) -> str:
        text = self._high_surrogate + delta
        self._high_surrogate = ""
        if text and "\ud800" <= text[-1] <= "\udbff":
            self._high_surrogate, text = text[-1], text[:-1]
        return clean(text)

    def flush(self) -> str:
        # A high surrogate with no partner is not a character: drop it.
        self._high_surrogate = ""
        return ""
