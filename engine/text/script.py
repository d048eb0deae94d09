"""Which script a character belongs to (CJK or not), shared by the stages."""

from __future__ import annotations

import re

# Ideographs, kana and hangul: characters that make a number "Chinese context"
# and that are spoken one syllable each (as a regex character-class body).
CJK_CLASS = (
    "\u1100-\u11ff"  # hangul jamo
    "\u3040-\u30ff"  # hiragana, katakana
    "\u3130-\u318f"  # hangul compatibility jamo
    "\u3400-\u4dbf"  # CJK extension A
    "\u4e00-\u9fff"  # CJK unified ideographs
    "\uac00-\ud7af"  # hangul syllables
    "\uf900-\ufaff"  # CJK compatibility ideographs
    "\U00020000-\U0003ffff"  # CJK extensions B and later
)
# CJK punctuation: kept as written (it carries the Chinese voice's prosody).
CJK_PUNCTUATION = frozenset("、。〃〈〉《》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟・！（），：；？")
# Characters that stand alone as tokens: CJK text and punctuation.
BOUNDARY_CLASS = CJK_CLASS + "\u3001-\u303f" + re.escape("".join(sorted(CJK_PUNCTUATION)))

_CJK = re.compile(f"[{CJK_CLASS}]")
_BOUNDARY = re.compile(f"[{BOUNDARY_CLASS}]")


def is_cjk(ch: str) -> bool:
    """True for a CJK ideograph, kana or hangul character."""
    return bool(ch) and _CJK.match(ch) is not None


def is_cjk_boundary(ch: str) -> bool:
    """True for characters that stand alone as tokens: CJK text and punctuation.

    Chinese is written without spaces, so every CJK character is its own
    token; that keeps commit latency at one character instead of a sentence.
    """
    return bool(ch) and _BOUNDARY.match(ch) is not None
