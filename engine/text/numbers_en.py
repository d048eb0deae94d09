"""English number words for the text normaliser.

Small, dependency-free helpers that turn digit strings into the words an
English voice should say: cardinals, ordinals, years, decimals, digit-by-digit
readings and money amounts. American style: no "and" inside cardinals
("one hundred twenty-three"); "and" only joins dollars and cents.
"""

from __future__ import annotations

_ONES = (
    "zero one two three four five six seven eight nine ten eleven twelve "
    "thirteen fourteen fifteen sixteen seventeen eighteen nineteen"
).split()
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
_SCALES = (
    "",
    " thousand",
    " million",
    " billion",
    " trillion",
    " quadrillion",
    " quintillion",
)
# Past this a number is read digit by digit; nobody says "sextillion".
_CARDINAL_LIMIT = 1000 ** len(_SCALES)

_ORDINAL_IRREGULAR = {
    "one": "first",
    "two": "second",
    "three": "third",
    "five": "fifth",
    "eight": "eighth",
    "nine": "ninth",
    "twelve": "twelfth",
}

# Currency symbol -> (singular, plural, minor singular, minor plural).
CURRENCIES: dict[str, tuple[str, str, str | None, str | None]] = {
    "$": ("dollar", "dollars", "cent", "cents"),
    "€": ("euro", "euros", "cent", "cents"),
    "£": ("pound", "pounds", "penny", "pence"),
    "¥": ("yen", "yen", None, None),
}

# Money/number scale suffixes ("$5k", "$1.2M", "$3bn").
SCALE_SUFFIXES = {
    "k": "thousand",
    "K": "thousand",
    "m": "million",
    "M": "million",
    "mn": "million",
    "b": "billion",
    "B": "billion",
    "bn": "billion",
    "t": "trillion",
    "T": "trillion",
    "tn": "trillion",
}


def cardinal(n: int) -> str:
    """123 -> "one hundred twenty-three"; negative numbers get "minus"."""
    if n < 0:
        return "minus " + cardinal(-n)
    if n >= _CARDINAL_LIMIT:
        return digits(str(n))
    if n < 20:
        return _ONES[n]
    if n < 100:
        tens, ones = divmod(n, 10)
        return _TENS[tens] + ("-" + _ONES[ones] if ones else "")
    if n < 1000:
        hundreds, rest = divmod(n, 100)
        words = _ONES[hundreds] + " hundred"
        return words + (" " + cardinal(rest) if rest else "")
    groups: list[str] = []
    scale = 0
    while n:
        n, group = divmod(n, 1000)
        if group:
            groups.append(cardinal(group) + _SCALES[scale])
        scale += 1
    return " ".join(reversed(groups))


def ordinal(n: int) -> str:
    """21 -> "twenty-first", 102 -> "one hundred second"."""
    words = cardinal(n)
    cut = max(words.rfind(" "), words.rfind("-")) + 1
    head, last = words[:cut], words[cut:]
    if last in _ORDINAL_IRREGULAR:
        last = _ORDINAL_IRREGULAR[last]
    elif last.endswith("y"):
        last = last[:-1] + "ieth"
    else:
        last += "th"
    return head + last


def year(n: int) -> str:
    """Read a year the way people say it.

    1999 -> "nineteen ninety-nine", 2024 -> "twenty twenty-four",
    2005 -> "two thousand five", 1905 -> "nineteen oh five",
    1900 -> "nineteen hundred".
    """
    if 2000 <= n <= 2009 or n < 1000 or n > 9999:
        return cardinal(n)
    high, low = divmod(n, 100)
    if low == 0:
        return cardinal(high) + " hundred"
    if low < 10:
        return cardinal(high) + " oh " + cardinal(low)
    return cardinal(high) + " " + cardinal(low)


def is_year_like(text: str) -> bool:
    """A bare four-digit integer in 1100-2099 is read as a year."""
    return len(text) == 4 and text.isdigit() and 1100 <= int(text) <= 2099


def digits(text: str) -> str:
    """"007" -> "zero zero seven" (non-digits are skipped)."""
    return " ".join(_ONES[int(ch)] for ch in text if ch.isdigit())


def plural_of(words: str) -> str:
    """"nineteen ninety" -> "nineteen nineties" (for decades: "the 1990s")."""
    if words.endswith("y"):
        return words[:-1] + "ies"
    if words.endswith("x"):
        return words + "es"
    return words + "s"


def number(text: str, *, as_year: bool = False) -> str:
    """Read a number as written: "1,234", "3.14", ".5", "007", "2024".

    - thousands separators are ignored ("1,234" -> "one thousand two hundred
      thirty-four");
    - decimals read their fraction digit by digit ("three point one four");
    - a leading zero or ten or more digits without separators means an
      identifier (code, phone number), read digit by digit;
    - ``as_year`` reads a year-like integer as a year.
    """
    plain = text.replace(",", "")
    whole, _, fraction = plain.partition(".")
    if "." in plain:
        head = cardinal(int(whole)) if whole else ""
        return (head + " point " + digits(fraction)).strip()
    if as_year and is_year_like(whole):
        return year(int(whole))
    if "," not in text and (len(whole) >= 10 or (len(whole) > 1 and whole[0] == "0")):
        return digits(whole)
    return cardinal(int(whole))


def is_one(text: str) -> bool:
    """True when a written amount is exactly one (selects singular units)."""
    return text.replace(",", "") == "1"


def money(symbol: str, amount: str, scale: str | None = None) -> str:
    """Read a currency amount.

    "$3.50" -> "three dollars and fifty cents", "$1" -> "one dollar",
    "$0.05" -> "five cents", "$1.2M" -> "one point two million dollars",
    "£2.50" -> "two pounds and fifty pence", "¥300" -> "three hundred yen".
    """
    one, many, minor_one, minor_many = CURRENCIES[symbol]
    plain = amount.replace(",", "")
    whole, _, fraction = plain.partition(".")
    if scale:
        return f"{number(amount)} {SCALE_SUFFIXES.get(scale, scale)} {many}"
    if not fraction.strip("0"):
        value = int(whole or "0")
        return f"{cardinal(value)} {one if value == 1 else many}"
    if len(fraction) <= 2 and minor_one is not None:
        cents = int(fraction.ljust(2, "0"))
        minor = f"{cardinal(cents)} {minor_one if cents == 1 else minor_many}"
        value = int(whole or "0")
        if value == 0:
            return minor
        return f"{cardinal(value)} {one if value == 1 else many} and {minor}"
    return f"{number(amount)} {many}"
