"""Spoken forms for single tokens: numbers, money, dates, URLs, abbreviations.

A token is a run of non-space, non-CJK characters ("$3.50,", "10:30",
"https://example.com/docs.", "Dr.") as cut by :mod:`tts_gateway.engine.text.words`.
:func:`render` gets the token plus a small :class:`Context` - the previous
token, the next token when :func:`needs_next` asked for it, and whether the
token sits in Chinese context - and returns what the voice should say.

English readings (American style):

- cardinals "1,234" -> "one thousand two hundred thirty-four"; decimals
  "3.14" -> "three point one four"; negatives "-5" -> "minus five";
  a leading zero or 10+ bare digits -> digit by digit (codes, phones);
- 4-digit integers 1100-2099 -> years: "1999" -> "nineteen ninety-nine",
  "2024" -> "twenty twenty-four", "2005" -> "two thousand five";
  decades "1990s"/"'90s" -> "nineteen nineties"/"nineties";
- ordinals "21st" -> "twenty-first"; "May 5" -> "May fifth"; "5 May" ->
  "the fifth of May";
- dates: ISO "2024-05-05" -> "May fifth, twenty twenty-four"; slashed dates
  are US month/day ("5/6/2024" -> "May sixth, ...") unless the first part
  cannot be a month ("25/12/2024" -> "December twenty-fifth, ...");
- times "10:30" -> "ten thirty", "10:05" -> "ten oh five", "12:00" ->
  "twelve o'clock", "3:45 PM" -> "three forty-five p m", "9am" -> "nine a m";
- money "$3.50" -> "three dollars and fifty cents", "$1" -> "one dollar",
  "$1.2M"/"$5k" -> "one point two million dollars"/"five thousand dollars",
  "$5 million" -> "five million dollars"; € euros, £ pounds/pence, ¥ yen;
- digits joined by hyphens: digit groups ("555-1234" -> "five five five,
  one two three four": phones, codes), dates ("12-25-2024"), and ranges only
  where the words around say so ("pages 5-7", "5-10 people", "between 10-20",
  two years in order "1999-2005");
- percentages, ranges ("5–10" -> "five to ten", "$5-10" -> "five to ten
  dollars", "10-15%"), fractions (1/2 -> "one half"), ratios ("16:9" -> "sixteen to
  nine"), units after numbers ("5 km" -> "five kilometers", "3x" -> "three
  times"), "#1" -> "number one", "~5" -> "about five";
- abbreviations: Dr. Mr. Mrs. Ms. Prof. vs. etc. e.g. i.e. approx., No. before
  a number, St. (Saint before a capitalised word unless one precedes it, as
  in "Main St."; else Street), a.m./p.m., initialisms "U.S." -> "U S";
  "&" -> "and", "%" -> "percent";
- URLs and e-mail addresses: "https://example.com/docs" -> "example dot com
  slash docs" (scheme, "www.", query and fragment dropped), "a@b.com" ->
  "a at b dot com".

Chinese readings (numbers in Chinese context): "123" -> "一百二十三",
"3.5" -> "三点五", "50%" -> "百分之五十", "¥3.50" -> "三点五元",
"10:30" -> "十点三十分", "2024-05-05" -> "二零二四年五月五日", a 4-digit
number before 年 digit by digit ("2024年" -> "二零二四年"), 2 before a
measure word -> 两 ("2个" -> "两个"), ranges with 到.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from . import numbers_en as en
from . import numbers_zh as zh
from .script import is_cjk

# -- vocabulary ----------------------------------------------------------------

MONTHS = (
    "January February March April May June July August September October November December"
).split()
_MONTH_BY_ABBREVIATION = {m[:3]: m for m in MONTHS} | {"Sept": "September"}
_MONTH_NAMES = frozenset(MONTHS) | frozenset(_MONTH_BY_ABBREVIATION)

# Abbreviations written with a final period (the key is without it).
_DOTTED = {
    "Dr": "Doctor",
    "Mr": "Mister",
    "Mrs": "Missus",
    "Ms": "Miz",
    "Prof": "Professor",
    "Jr": "Junior",
    "Sr": "Senior",
    "Mt": "Mount",
    "Ave": "Avenue",
    "Blvd": "Boulevard",
    "Rd": "Road",
    "Dept": "Department",
    "vs": "versus",
    "Vs": "Versus",
    "approx": "approximately",
    "Approx": "Approximately",
    "e.g": "for example",
    "E.g": "For example",
    "i.e": "that is",
    "I.e": "That is",
    "cf": "compare",
    "Fig": "Figure",
    "fig": "figure",
} | {abbr: full for abbr, full in _MONTH_BY_ABBREVIATION.items() if abbr != "May"}
# Abbreviations also common without a period ("Mr Smith", "cats vs dogs").
_UNDOTTED = {"Dr": "Doctor", "Mr": "Mister", "Mrs": "Missus", "Ms": "Miz", "vs": "versus", "etc": "et cetera"}
# Abbreviations that may also end the sentence: their period is kept when the
# next token starts a new sentence (capital letter) or nothing follows.
_SENTENCE_FINAL = {
    "etc": "et cetera",
    "a.m": "a m",
    "p.m": "p m",
    "A.M": "a m",
    "P.M": "p m",
    "Ph.D": "P h D",
}
# Names that follow "St." as Saint even after a capitalised word ("Visit St. Louis").
_SAINT_NAMES = frozenset(
    "Louis Paul Petersburg Peter Patrick John Mary Lucia Kitts Moritz Andrews Augustine "
    "George Tropez Helena Thomas Vincent Martin Pancras Francis Lawrence Cloud Charles "
    "Joseph James Jude Michael Anthony Catharines Albans Ives Helens Kilda".split()
)
_INITIALISM = re.compile(r"(?:[A-Za-z]\.)+[A-Za-z]")
_AM_PM = {"AM": "a m", "PM": "p m", "am": "a m", "pm": "p m"}

# Units read after a number: written form -> (singular, plural).
_UNITS_EN: dict[str, tuple[str, str]] = {
    "km": ("kilometer", "kilometers"),
    "cm": ("centimeter", "centimeters"),
    "mm": ("millimeter", "millimeters"),
    "kg": ("kilogram", "kilograms"),
    "g": ("gram", "grams"),
    "mg": ("milligram", "milligrams"),
    "lb": ("pound", "pounds"),
    "lbs": ("pound", "pounds"),
    "oz": ("ounce", "ounces"),
    "ml": ("milliliter", "milliliters"),
    "mL": ("milliliter", "milliliters"),
    "L": ("liter", "liters"),
    "h": ("hour", "hours"),
    "hr": ("hour", "hours"),
    "hrs": ("hour", "hours"),
    "min": ("minute", "minutes"),
    "mins": ("minute", "minutes"),
    "sec": ("second", "seconds"),
    "secs": ("second", "seconds"),
    "ms": ("millisecond", "milliseconds"),
    "ft": ("foot", "feet"),
    "mph": ("mile per hour", "miles per hour"),
    "km/h": ("kilometer per hour", "kilometers per hour"),
    "kph": ("kilometer per hour", "kilometers per hour"),
    "KB": ("kilobyte", "kilobytes"),
    "MB": ("megabyte", "megabytes"),
    "GB": ("gigabyte", "gigabytes"),
    "TB": ("terabyte", "terabytes"),
    "Hz": ("hertz", "hertz"),
    "kHz": ("kilohertz", "kilohertz"),
    "MHz": ("megahertz", "megahertz"),
    "GHz": ("gigahertz", "gigahertz"),
    "W": ("watt", "watts"),
    "kW": ("kilowatt", "kilowatts"),
    "kWh": ("kilowatt hour", "kilowatt hours"),
    "°C": ("degree Celsius", "degrees Celsius"),
    "°F": ("degree Fahrenheit", "degrees Fahrenheit"),
    "°": ("degree", "degrees"),
    "x": ("times", "times"),
    "k": ("thousand", "thousand"),
}
_UNITS_ZH = {
    "km": "公里",
    "cm": "厘米",
    "mm": "毫米",
    "kg": "公斤",
    "g": "克",
    "mg": "毫克",
    "ml": "毫升",
    "mL": "毫升",
    "L": "升",
    "h": "小时",
    "hr": "小时",
    "hrs": "小时",
    "min": "分钟",
    "mins": "分钟",
    "sec": "秒",
    "secs": "秒",
    "ms": "毫秒",
    "km/h": "公里每小时",
    "°C": "摄氏度",
    "°F": "华氏度",
    "°": "度",
    "x": "倍",
    "k": "千",
}
_SCALE_WORDS = frozenset({"thousand", "million", "billion", "trillion"})
# Measure words after which 2 is read 两 ("2个" -> "两个").
_ZH_MEASURE_WORDS = frozenset("个位只条本张次天种件岁名台辆家份块瓶杯双对周倍颗棵座层点分秒米公千斤克升角毛")
_PER_WORDS = r"(?:month|mo|year|yr|week|wk|day|hour|hr|night|person|user|seat|unit|each|piece)s?\b"
_TLDS = (
    "com|org|net|io|ai|dev|edu|gov|co|uk|de|cn|app|me|info|us|tv|ly|gg|xyz|fr|jp|ca|au|eu|"
    "tech|cloud|site|online|blog|news|ru|nl|ch|se|no|es|it|in"
)

# -- token anatomy ---------------------------------------------------------------

_LEAD = "\"'“‘([{¿¡"
_TRAIL = ".,;:!?…\"'”’)]}"
_NUM = r"(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?)"
_CUR = r"[$€£¥]"
_SCALE = r"(?:bn|mn|tn|[kKmMbBtT])"
# Words that make digits joined by a hyphen a range ("pages 5-7", "5-10 people"); without
# them, "555-1234" is a phone number read in digit groups.
_RANGE_BEFORE = frozenset(
    "page pages pp p chapter chapters verse verses line lines step steps item items question questions "
    "slide slides section sections row rows column columns from between ages aged grade grades level "
    "levels room rooms floor floors seat seats size sizes day days week weeks month months year years "
    "episode episodes season seasons issue issues volume volumes".split()
)
_RANGE_AFTER = (
    frozenset(
        "people persons person items times days weeks months years hours minutes seconds mins secs hrs "
        "pages percent points players servings cups inches feet miles meters metres degrees dollars "
        "euros words steps sets reps kids children students guests members".split()
    )
    | frozenset(unit.lower() for unit in _UNITS_EN)
)
_UNIT = "|".join(re.escape(u) for u in sorted(_UNITS_EN, key=len, reverse=True))
_TIME = r"\d{1,2}:\d{2}"
_RANGE_SIDE = rf"{_CUR}?(?:{_TIME}|{_NUM})(?:%|(?:{_UNIT})(?![A-Za-z]))?"

_NUMERIC_TOKEN = re.compile(rf"[-−+~]?{_CUR}?{_NUM}%?")
_TIME_TOKEN = re.compile(rf"{_TIME}(?::\d{{2}})?|\d{{1,2}}")
_MONEY_TOKEN = re.compile(rf"[-−+]?{_CUR}{_NUM}")
_INTEGER = re.compile(r"\d{1,2}")

_PATTERN = re.compile(
    rf"""
      (?P<url>(?:https?|ftp)://[^\s<>"]+|www\.[^\s<>"]+)
    | (?P<email>[\w.+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{{2,}})
    | (?P<domain>(?<![\w@./-])(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?\.)+(?:{_TLDS})
        (?![A-Za-z0-9-])(?:[/?\#]\S*)?)
    | (?P<isodate>(?<![\w.])(?P<iy>\d{{4}})[-/](?P<im>0?[1-9]|1[0-2])[-/](?P<id>0?[1-9]|[12]\d|3[01])(?!\d))
    | (?P<usdate>(?<![\w./])(?P<ua>\d{{1,2}})/(?P<ub>\d{{1,2}})/(?P<uy>\d{{4}}|\d{{2}})(?![\d/]))
    | (?P<yearmonth>(?<![\w.])(?P<ymy>\d{{4}})-(?P<ymm>0[1-9])(?![\d-]))
    | (?P<groups>(?<![\w.-])\d+(?:-\d+)+(?![\w%-]|[.,]\d))
    | (?P<range>(?<![\w.-])(?P<ra>{_RANGE_SIDE})[-–~](?P<rb>{_RANGE_SIDE})(?![\w-]|[.,]\d))
    | (?P<time>(?<![\w:.])(?P<th>\d{{1,2}}):(?P<tm>[0-5]\d)(?::(?P<ts>[0-5]\d))?
        (?:(?P<tap>[aApP])\.?[mM](?![A-Za-z]))?(?![\d:]))
    | (?P<ampm>(?<![\w.])(?P<ah>\d{{1,2}})(?P<aap>[aApP])\.?[mM](?![A-Za-z]))
    | (?P<money>(?<![\w.])(?P<msign>[-−+])?(?P<mcur>{_CUR})(?P<mnum>{_NUM})
        (?:(?P<mscale>{_SCALE})(?![A-Za-z]))?)
    | (?P<ordinal>(?<![\w.])(?P<on>\d+)(?:st|nd|rd|th)(?![A-Za-z]))
    | (?P<decade>(?<![\w.])['’]?(?P<dec>[1-9]0|1\d\d0|20\d0)s(?![A-Za-z]))
    | (?P<percent>(?<![\w.])(?P<psign>[-−+])?(?P<pnum>{_NUM})%)
    | (?P<fraction>(?<![\w./])(?P<fa>\d+)/(?P<fb>\d+)(?![\d/]))
    | (?P<ratio>(?<![\w:.])(?P<xa>\d+):(?P<xb>\d+)(?![\d:]))
    | (?P<version>(?<![\w.])[vV]?(?P<ver>\d+(?:\.\d+){{2,}})(?!\d))
    | (?P<numabbr>(?<!\w)[Nn]o\.(?=\d))
    | (?P<number>(?:(?<![\w.])(?P<npre>[-−+~\#]))?(?P<nnum>{_NUM}|(?<![\w.])\.\d+)
        (?:(?P<nunit>{_UNIT})(?![A-Za-z0-9]))?)
    | (?P<hyphen>(?<=[A-Za-z])-(?=\d))
    | (?P<arrow>->|=>|→)
    | (?P<dash>—|–|-{{2,}})
    | (?P<dot>(?<=[A-Za-z])\.(?=[A-Za-z]))
    | (?P<sym>[&@+=\#*×~^<>{{}}\[\]\\|_/%])
    """,
    re.VERBOSE,
)


@dataclass(frozen=True)
class Context:
    """What a token may know about its surroundings."""

    zh: bool = False  # read numbers in Chinese
    prev: str = ""  # previous token, surrounding punctuation stripped ("" at start)
    next: str | None = None  # next token (raw) when needs_next() was true; None at the end

    @property
    def next_core(self) -> str:
        return split_token(self.next)[1] if self.next else ""

    @property
    def sentence_final(self) -> bool:
        """The next token starts a new sentence (or there is none)."""
        if self.next is None:
            return True
        core = self.next.lstrip(_LEAD)
        return not core or core[0].isupper() or is_cjk(core[0])


def split_token(token: str) -> tuple[str, str, str]:
    """Split "(\"$3.50,\"" into leading punctuation, core and trailing punctuation."""
    stripped = token.lstrip(_LEAD)
    lead = token[: len(token) - len(stripped)]
    core = stripped.rstrip(_TRAIL)
    return lead, core, stripped[len(core) :]


def is_numeric(core: str) -> bool:
    return bool(_NUMERIC_TOKEN.fullmatch(core))


def needs_next(token: str, prev: str) -> bool:
    """Whether the reading of ``token`` depends on the token after it.

    Numbers always do (Chinese context, 年, "May", "million", "o'clock"),
    as do dashes between numbers and a few abbreviations.
    """
    if any(ch.isdigit() for ch in token):
        return True
    _, core, trail = split_token(token)
    if core in ("-", "–", "−", "*", "×") or (core == "x" and is_numeric(prev)):
        return True
    if trail.startswith(".") and (
        core in ("St", "No", "no") or core in _SENTENCE_FINAL or _INITIALISM.fullmatch(core)
    ):
        return True
    return False


# -- rendering ---------------------------------------------------------------------


def render(token: str, ctx: Context) -> str:
    """Spoken form of one token."""
    lead, core, trail = split_token(token)
    if not core:
        return _drop_brackets(token)
    word = _render_word(core, trail, ctx)
    if word is not None:
        spoken, trail = word
    else:
        spoken = _render_core(core, ctx)
    spoken = " ".join(spoken.split())
    # Brackets are not spoken; "'90s" loses its apostrophe once it is "nineties".
    lead, trail = _drop_brackets(lead), _drop_brackets(trail)
    if lead[-1:] in ("'", "’") and core[:1].isdigit():
        lead = lead[:-1]
    return lead + spoken + trail if spoken else (lead + trail).strip()


def _drop_brackets(text: str) -> str:
    return text.translate(_BRACKETS) if text else text


_BRACKETS = str.maketrans("", "", "[]{}")


def _render_word(core: str, trail: str, ctx: Context) -> tuple[str, str] | None:
    """Whole-token readings (abbreviations, units, symbols); None if not one."""
    prev = ctx.prev
    dotted = trail.startswith(".")
    if dotted:
        rest = trail[1:]
        if core == "St":
            # "St. Louis", "to St. Paul" vs "Main St.", "on Elm St. Then"
            following = ctx.next_core
            if following[:1].isupper() and (not prev[:1].isupper() or following in _SAINT_NAMES):
                return "Saint", rest
            return "Street", ("." if ctx.sentence_final else "") + rest
        if core in ("No", "no"):
            if ctx.next_core[:1].isdigit() or ctx.next_core[:1] == "#":
                return ("Number" if core == "No" else "number"), rest
            return core, trail
        if core in _DOTTED:
            return _DOTTED[core], rest
        if core in _SENTENCE_FINAL or _INITIALISM.fullmatch(core):
            spoken = _SENTENCE_FINAL.get(core) or " ".join(core.split("."))
            return spoken, ("." if ctx.sentence_final else "") + rest
    if core in _UNDOTTED:
        return _UNDOTTED[core], trail
    if core in _AM_PM and _TIME_TOKEN.fullmatch(prev):
        return _AM_PM[core], trail
    if is_numeric(prev) and "%" not in prev:
        unit = _unit(core, one=en.is_one(prev.lstrip("-−+~$€£¥")), zh_reading=ctx.zh)
        if unit:
            return unit, trail
        if core.lower() in _SCALE_WORDS and _MONEY_TOKEN.fullmatch(prev):
            currency = prev.lstrip("-−+")[0]
            return f"{core} {en.CURRENCIES[currency][1]}", trail
    symbol = _STANDALONE_SYMBOLS.get(core)
    if symbol is not None:
        return symbol(ctx), trail
    if core == "x" and is_numeric(prev) and ctx.next is not None and is_numeric(ctx.next_core):
        return "by", trail
    return None


def _unit(core: str, *, one: bool, zh_reading: bool) -> str | None:
    if core == "k" or core == "x":
        return None  # only as suffixes: "5k", "3x"
    if zh_reading and core in _UNITS_ZH:
        return _UNITS_ZH[core]
    forms = _UNITS_EN.get(core)
    if forms is None:
        return None
    return forms[0] if one else forms[1]


def _between_numbers(ctx: Context) -> bool:
    return is_numeric(ctx.prev) and ctx.next is not None and is_numeric(ctx.next_core)


_STANDALONE_SYMBOLS = {
    "-": lambda ctx: ("到" if ctx.zh else "to") if _between_numbers(ctx) else ",",
    "–": lambda ctx: ("到" if ctx.zh else "to") if _between_numbers(ctx) else ",",
    "−": lambda ctx: ("到" if ctx.zh else "to") if _between_numbers(ctx) else ",",
    "—": lambda ctx: ",",
    "*": lambda ctx: "times" if _between_numbers(ctx) else "",
    "×": lambda ctx: "times" if _between_numbers(ctx) else "",
    "&": lambda ctx: "和" if ctx.zh else "and",
    "+": lambda ctx: "plus",
    "=": lambda ctx: "equals",
    "@": lambda ctx: "at",
    "%": lambda ctx: "percent",
    "→": lambda ctx: "to",
    "->": lambda ctx: "to",
    "=>": lambda ctx: "to",
    "~": lambda ctx: "",
    "#": lambda ctx: "",
    "/": lambda ctx: "",
}


def _render_core(core: str, ctx: Context) -> str:
    """Rewrite every number, URL and symbol inside a token core."""

    def replace(match: re.Match[str]) -> str:
        kind = match.lastgroup
        spoken = _HANDLERS[kind](match, core, ctx)
        if kind in _PADDED and not ctx.zh:
            # "x86" -> "x eighty-six", "3D" -> "three D"
            if match.start() > 0 and core[match.start() - 1].isalnum():
                spoken = " " + spoken
            if match.end() < len(core) and core[match.end()].isalnum():
                spoken += " "
        return spoken

    return _PATTERN.sub(replace, core)


def _standalone(match: re.Match[str], core: str) -> bool:
    return match.start() == 0 and match.end() == len(core)


# -- handlers (one per pattern group) ---------------------------------------------


def _say_digits_words(text: str) -> str:
    """Digits inside URLs: short runs as numbers, long ones digit by digit."""
    return re.sub(r"\d+", lambda m: " " + en.number(m.group()) + " ", text)


def _say_host(host: str) -> str:
    host, _, port = host.partition(":")
    words = " dot ".join(_say_digits_words(label) for label in host.split(".") if label)
    if port:
        words += " colon " + en.digits(port)
    return words


def _say_path(segment: str) -> str:
    segment = re.sub(r"[^\w.\-~]", " ", segment)
    segment = segment.replace("-", " dash ").replace("_", " underscore ").replace(".", " dot ")
    return _say_digits_words(segment.replace("~", " tilde "))


def _url(match, core, ctx) -> str:
    text = re.sub(r"^(?:(?:https?|ftp)://)?(?:www\.)?", "", match.group())
    text = re.split(r"[?#]", text, maxsplit=1)[0].rstrip("/")
    host, _, path = text.partition("/")
    words = _say_host(host)
    for segment in path.split("/"):
        if segment:
            words += " slash " + _say_path(segment)
    return " " + words + " "


def _email(match, core, ctx) -> str:
    local, _, host = match.group().partition("@")
    local = local.replace(".", " dot ").replace("_", " underscore ").replace("-", " dash ")
    local = local.replace("+", " plus ")
    return " " + _say_digits_words(local) + " at " + _say_host(host) + " "


def _date_words(year: str | None, month: int, day: int | None, ctx: Context) -> str:
    if ctx.zh:
        text = (zh.digits(year) + "年" if year else "") + zh.cardinal(month) + "月"
        return text + (zh.cardinal(day) + "日" if day else "")
    words = MONTHS[month - 1]
    if day:
        words += " " + en.ordinal(day)
    if year:
        words += (", " if day else " ") + en.year(int(year))
    return words


def _isodate(match, core, ctx) -> str:
    return _date_words(match["iy"], int(match["im"]), int(match["id"]), ctx)


def _month_and_day(first: int, second: int) -> tuple[int, int] | None:
    """US month/day order unless the first cannot be a month; None when neither order is a date."""
    if 1 <= first <= 12 and 1 <= second <= 31:
        return first, second
    if 1 <= second <= 12 and 1 <= first <= 31:
        return second, first
    return None


def _usdate(match, core, ctx) -> str:
    year = match["uy"]
    if len(year) == 2:
        year = "20" + year
    month_day = _month_and_day(int(match["ua"]), int(match["ub"]))
    if month_day is None:
        return " slash ".join(en.number(part) for part in (match["ua"], match["ub"], match["uy"]))
    return _date_words(year, *month_day, ctx)


def _yearmonth(match, core, ctx) -> str:
    return _date_words(match["ymy"], int(match["ymm"]), None, ctx)


def _digit_groups(match, core, ctx) -> str:
    """Digits joined by hyphens: phone numbers, codes, dates, and ranges where the words around say so.

    "555-1234" -> "five five five, one two three four"; "12-25-2024" -> a date; "pages 5-7",
    "5-10 people", "1999-2005" -> ranges.
    """
    groups = match.group().split("-")
    if len(groups) == 2 and _hyphen_is_range(groups, ctx):
        if not ctx.zh and ctx.prev.lower() == "between":
            return en.number(groups[0]) + " and " + en.number(groups[1])  # "between 10-20"
        return _range_words(groups[0], groups[1], ctx)
    if len(groups) == 3 and len(groups[2]) == 4 and max(len(groups[0]), len(groups[1])) <= 2:
        month_day = _month_and_day(int(groups[0]), int(groups[1]))
        if month_day is not None:
            return _date_words(groups[2], *month_day, ctx)
    if ctx.zh:
        return "".join(zh.digits(g) for g in groups)
    return ", ".join(en.digits(g) for g in groups)


def _hyphen_is_range(sides: list[str], ctx: Context) -> bool:
    if ctx.zh:
        return is_cjk(ctx.next_core[:1])  # "3-5天", "7-8小时": a measure word follows
    if ctx.prev.lower() in _RANGE_BEFORE or ctx.next_core.lower() in _RANGE_AFTER:
        return True
    low, high = (int(side) for side in sides)
    # "1999-2005": two years, in order
    return all(len(side) == 4 and 1000 <= int(side) <= 2099 for side in sides) and low < high


def _range(match, core, ctx) -> str:
    return _range_words(match["ra"], match["rb"], ctx)


def _range_words(low: str, high: str, ctx: Context) -> str:
    low_cur = low[0] if low[0] in "$€£¥" else ""
    high_cur = high[0] if high[0] in "$€£¥" else ""
    currency = low_cur or high_cur
    if currency and re.fullmatch(r"[$€£¥]?\d+", low) and re.fullmatch(r"[$€£¥]?\d+", high):
        # "$5-10", "$5-$10" -> "five to ten dollars"
        low, high = low.lstrip("$€£¥"), currency + high.lstrip("$€£¥")
    year_digits = ctx.zh and _next_is(ctx, "年")
    side = Context(zh=ctx.zh, prev="", next="年" if year_digits else "")
    joiner = "到" if ctx.zh else " to "
    return _render_core(low, side) + joiner + _render_core(high, side)


def _hour_zh(hour: int) -> str:
    return "两" if hour == 2 else zh.cardinal(hour)


def _time(match, core, ctx) -> str:
    hour, minute, second, ampm = int(match["th"]), match["tm"], match["ts"], match["tap"]
    next_ampm = ctx.next_core in _AM_PM or ctx.next_core in _SENTENCE_FINAL
    if ctx.zh:
        text = _hour_zh(hour) + "点"
        if minute != "00":
            text += ("零" if minute[0] == "0" else "") + zh.cardinal(int(minute)) + "分"
        if second and second != "00":
            text += zh.cardinal(int(second)) + "秒"
        if ampm:
            text = ("上午" if ampm in "aA" else "下午") + text
        return text
    words = en.cardinal(hour)
    if minute == "00":
        if not (ampm or next_ampm or second):
            words += " o'clock"
    elif minute[0] == "0":
        words += " oh " + en.cardinal(int(minute[1]))
    else:
        words += " " + en.cardinal(int(minute))
    if second and second != "00":
        words += " and " + en.cardinal(int(second)) + (" second" if second == "01" else " seconds")
    if ampm:
        words += " a m" if ampm in "aA" else " p m"
    return words


def _ampm(match, core, ctx) -> str:
    hour, ampm = int(match["ah"]), match["aap"]
    if ctx.zh:
        return ("上午" if ampm in "aA" else "下午") + _hour_zh(hour) + "点"
    return en.cardinal(hour) + (" a m" if ampm in "aA" else " p m")


def _money(match, core, ctx) -> str:
    sign, currency, amount, scale = match["msign"], match["mcur"], match["mnum"], match["mscale"]
    if ctx.zh:
        return ("负" if sign in ("-", "−") else "") + zh.money(currency, amount, scale)
    prefix = {"-": "minus ", "−": "minus ", "+": "plus "}.get(sign or "", "")
    if not scale and _standalone(match, core) and ctx.next_core.lower() in _SCALE_WORDS:
        # "$5 million": the next token says "million dollars"
        return prefix + en.number(amount)
    return prefix + en.money(currency, amount, scale)


def _ordinal(match, core, ctx) -> str:
    value = int(match["on"])
    if ctx.zh:
        return "第" + zh.cardinal(value)
    return en.ordinal(value)


def _decade(match, core, ctx) -> str:
    text = match["dec"]
    if ctx.zh:
        return (zh.digits(text) if len(text) == 4 else zh.cardinal(int(text))) + "年代"
    value = int(text)
    return en.plural_of(en.year(value) if len(text) == 4 else en.cardinal(value))


def _percent(match, core, ctx) -> str:
    sign, amount = match["psign"], match["pnum"]
    negative = sign in ("-", "−")
    if ctx.zh:
        return ("负" if negative else "") + "百分之" + zh.number(amount)
    prefix = "minus " if negative else ("plus " if sign == "+" else "")
    return prefix + en.number(amount) + " percent"


_FRACTIONS = {
    ("1", "2"): "one half",
    ("1", "3"): "one third",
    ("2", "3"): "two thirds",
    ("1", "4"): "one quarter",
    ("3", "4"): "three quarters",
    ("24", "7"): "twenty-four seven",
    ("50", "50"): "fifty-fifty",
}


def _fraction(match, core, ctx) -> str:
    top, bottom = match["fa"], match["fb"]
    if ctx.zh:
        return zh.number(bottom) + "分之" + zh.number(top)
    if (top, bottom) in _FRACTIONS:
        return _FRACTIONS[(top, bottom)]
    joiner = " out of " if bottom in ("5", "10", "100") else " over "
    return en.number(top) + joiner + en.number(bottom)


def _ratio(match, core, ctx) -> str:
    if ctx.zh:
        return zh.number(match["xa"]) + "比" + zh.number(match["xb"])
    return en.number(match["xa"]) + " to " + en.number(match["xb"])


def _version(match, core, ctx) -> str:
    parts = match["ver"].split(".")
    if ctx.zh:
        return "点".join(zh.number(p) for p in parts)
    return " point ".join(en.number(p) for p in parts)


def _numabbr(match, core, ctx) -> str:
    return "number "


def _next_is(ctx: Context, text: str) -> bool:
    return ctx.next is not None and ctx.next.startswith(text)


def _number(match, core, ctx) -> str:
    prefix, amount, unit = match["npre"] or "", match["nnum"], match["nunit"]
    alone = _standalone(match, core)
    integer = amount.isdigit()
    if ctx.zh:
        next_char = (ctx.next or "")[:1]
        if unit:
            spoken = zh.number(amount) + _UNITS_ZH.get(unit, unit)
        elif alone and integer and len(amount) == 4 and next_char == "年":
            spoken = zh.digits(amount)  # 2024年 -> 二零二四年
        elif alone and amount == "2" and next_char in _ZH_MEASURE_WORDS and ctx.prev != "第":
            spoken = "两"
        else:
            spoken = zh.number(amount)
        return {"-": "负", "−": "负", "+": "正", "~": "约", "#": ""}.get(prefix, "") + spoken
    words = {"-": "minus ", "−": "minus ", "+": "plus ", "~": "about ", "#": "number "}.get(prefix, "")
    day = int(amount) if integer and _INTEGER.fullmatch(amount) else 0
    if unit:
        forms = _UNITS_EN[unit]
        return words + en.number(amount) + " " + (forms[0] if en.is_one(amount) else forms[1])
    if alone and not prefix and 1 <= day <= 31 and ctx.prev in _MONTH_NAMES:
        return en.ordinal(day)  # "May 5" -> "May fifth"
    if alone and not prefix and 1 <= day <= 31 and ctx.next_core in MONTHS:
        return "the " + en.ordinal(day) + " of"  # "5 May" -> "the fifth of May"
    return words + en.number(amount, as_year=not prefix)


def _hyphen(match, core, ctx) -> str:
    return " "  # "COVID-19" -> "COVID nineteen"


def _arrow(match, core, ctx) -> str:
    return " to "


def _dash(match, core, ctx) -> str:
    return ", "


def _dot(match, core, ctx) -> str:
    following = core[match.end()]
    return ". " if following.isupper() else " dot "  # "Node.js" vs "end.Next"


def _sym(match, core, ctx) -> str:
    ch = match.group()
    before = core[match.start() - 1] if match.start() else ""
    after = core[match.end()] if match.end() < len(core) else ""
    if ch == "&":
        return " 和 " if ctx.zh else " and "
    if ch == "@":
        return " at "
    if ch == "+":
        return " plus "
    if ch == "=":
        return " equals "
    if ch == "%":
        return " percent "
    if ch == "~" and after[:1] in "$€£¥" and after:
        return " 约" if ctx.zh else " about "  # "~$50"
    if ch == "#" and before in ("C", "F", "J") and not after.isalnum():
        return " sharp "
    if ch in "*×" and before.isdigit() and after.isdigit():
        return " times "
    if ch == "/" and re.match(_PER_WORDS, core[match.end() :]):
        return " per "
    return " "


_HANDLERS = {
    "url": _url,
    "email": _email,
    "domain": _url,
    "isodate": _isodate,
    "usdate": _usdate,
    "yearmonth": _yearmonth,
    "groups": _digit_groups,
    "range": _range,
    "time": _time,
    "ampm": _ampm,
    "money": _money,
    "ordinal": _ordinal,
    "decade": _decade,
    "percent": _percent,
    "fraction": _fraction,
    "ratio": _ratio,
    "version": _version,
    "numabbr": _numabbr,
    "number": _number,
    "hyphen": _hyphen,
    "arrow": _arrow,
    "dash": _dash,
    "dot": _dot,
    "sym": _sym,
}
# Readings that need a space from letters glued to them ("x86", "5G").
_PADDED = frozenset(_HANDLERS) - {"hyphen", "arrow", "dash", "dot", "sym", "numabbr"}
