"""Chinese number readings for the text normaliser.

Turns digit strings into the characters a Chinese voice (CosyVoice) should
read: cardinals with 万/亿 grouping and the usual 零 rules ("10001" ->
"一万零一"), digit-by-digit readings for years and identifiers
("2024" -> "二零二四"), and decimals ("3.5" -> "三点五").
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation

DIGITS = "零一二三四五六七八九"
_SMALL_UNITS = ((1000, "千"), (100, "百"), (10, "十"), (1, ""))
_GROUP_UNITS = ("", "万", "亿", "万亿")
_CARDINAL_LIMIT = 10000 ** len(_GROUP_UNITS)

# Currency symbol -> unit word.  "¥" in a Chinese sentence is the yuan.
CURRENCIES = {"$": "美元", "€": "欧元", "£": "英镑", "¥": "元"}

# Scale suffixes as multipliers ("$1.2M" -> 1200000 -> "一百二十万美元").
SCALE_FACTORS = {
    "k": 10**3,
    "K": 10**3,
    "m": 10**6,
    "M": 10**6,
    "mn": 10**6,
    "b": 10**9,
    "B": 10**9,
    "bn": 10**9,
    "t": 10**12,
    "T": 10**12,
    "tn": 10**12,
}


def _group(n: int) -> str:
    """0 < n < 10000 -> "一千零一十" style reading of one 4-digit group."""
    words = ""
    gap = False
    for value, unit in _SMALL_UNITS:
        digit = n // value % 10
        if digit == 0:
            gap = bool(words)
            continue
        if gap:
            words += "零"
            gap = False
        words += DIGITS[digit] + unit
    return words


def cardinal(n: int) -> str:
    """123 -> "一百二十三", 10000 -> "一万", 10 -> "十", -5 -> "负五"."""
    if n < 0:
        return "负" + cardinal(-n)
    if n == 0:
        return "零"
    if n >= _CARDINAL_LIMIT:
        return digits(str(n))
    groups = []
    while n:
        n, group = divmod(n, 10000)
        groups.append(group)
    words = ""
    zero_pending = False
    for index in range(len(groups) - 1, -1, -1):
        group = groups[index]
        if group == 0:
            zero_pending = bool(words)
            continue
        # A gap (an empty group, or a group below 1000 after a higher one)
        # is read as a single 零: 100010 -> 十万零一十.
        if words and (zero_pending or group < 1000):
            words += "零"
        words += _group(group) + _GROUP_UNITS[index]
        zero_pending = False
    if words.startswith("一十"):
        words = words[1:]
    return words


def digits(text: str) -> str:
    """"2024" -> "二零二四" (non-digits are skipped)."""
    return "".join(DIGITS[int(ch)] for ch in text if ch.isdigit())


def number(text: str, *, as_digits: bool = False) -> str:
    """Read a written number: "1,234", "3.5", "007", "13800138000".

    A leading zero or ten or more digits without separators means an
    identifier (phone number, code) and is read digit by digit, as is any
    integer when ``as_digits`` is set (years before 年).
    """
    plain = text.replace(",", "")
    whole, _, fraction = plain.partition(".")
    if "." in plain:
        return cardinal(int(whole or "0")) + "点" + digits(fraction)
    if as_digits or ("," not in text and (len(whole) >= 10 or (len(whole) > 1 and whole[0] == "0"))):
        return digits(whole)
    return cardinal(int(whole))


def money(symbol: str, amount: str, scale: str | None = None) -> str:
    """"¥3.50" -> "三点五元", "$5" -> "五美元", "$1.2M" -> "一百二十万美元".

    Trailing zeros of the fraction are dropped (3.50 yuan is 三点五元).
    """
    plain = amount.replace(",", "")
    try:
        value = Decimal(plain) * SCALE_FACTORS.get(scale or "", 1)
    except InvalidOperation:
        return amount + CURRENCIES[symbol]
    text = format(value.normalize(), "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return number(text) + CURRENCIES[symbol]
