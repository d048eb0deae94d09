"""Tests for tts_gateway.engine.text: the streaming normaliser and the segmenter.

Agents stream reply text in arbitrary deltas, so besides exact readings these
tests check that the committed output never depends on where the deltas were
cut, and that the segmenter neither loses nor repeats text.
"""

from __future__ import annotations

import random

import pytest

from tts_gateway.engine.text import Segmenter, TextNormalizer, normalize


def stream(pieces: list[str], language: str = "auto") -> tuple[list[str], str]:
    """Push ``pieces`` one by one, then flush; return (per-push outputs, all output)."""
    normalizer = TextNormalizer(language)
    outputs = [normalizer.push(piece) for piece in pieces]
    outputs.append(normalizer.flush())
    return outputs, "".join(outputs)


def random_split(text: str, rng: random.Random) -> list[str]:
    pieces, i = [], 0
    while i < len(text):
        size = rng.choice((1, 1, 1, 2, 3, 4, 7, 12))
        pieces.append(text[i : i + size])
        i += size
    return pieces


def utf16_units(text: str) -> list[str]:
    """Split text into UTF-16 code units, as a client slicing JS strings might."""
    data = text.encode("utf-16-le")
    return [data[i : i + 2].decode("utf-16-le", "surrogatepass") for i in range(0, len(data), 2)]


def segment_all(text: str, **sizes: int) -> list[str]:
    """Give the segmenter the whole text at once, then flush."""
    segmenter = Segmenter(**sizes)
    return segmenter.push(text) + segmenter.flush()


def seed_of(text: str) -> int:
    return sum(map(ord, text))  # stable across runs, unlike hash()


def squeeze(text: str) -> str:
    return "".join(text.split())


# -- the brief's example --------------------------------------------------------------

EXAMPLE = "Hello there! The total is $3.50, due May 5th."
EXAMPLE_SPOKEN = "Hello there! The total is three dollars and fifty cents, due May fifth."


def test_example_normalized():
    assert normalize(EXAMPLE) == EXAMPLE_SPOKEN


def test_example_first_fragment_is_the_short_greeting():
    segmenter = Segmenter()
    fragments = segmenter.push(normalize(EXAMPLE)) + segmenter.flush()
    assert fragments == ["Hello there!", "The total is three dollars and fifty cents, due May fifth."]


# -- exact readings ---------------------------------------------------------------------

ENGLISH = [
    ("The sum is 1,234,567.", "The sum is one million two hundred thirty-four thousand five hundred sixty-seven."),
    ("Pi is 3.14 and -5 is negative.", "Pi is three point one four and minus five is negative."),
    ("It is 0.5 or .5 and 007.", "It is zero point five or point five and zero zero seven."),
    ("1st, 2nd, 3rd, 21st and 102nd", "first, second, third, twenty-first and one hundred second"),
    ("Growth was 50% and 3.5%.", "Growth was fifty percent and three point five percent."),
    ("$3.50", "three dollars and fifty cents"),
    ("$1", "one dollar"),
    ("$0.05", "five cents"),
    ("$1,000", "one thousand dollars"),
    ("$1.2M and $5k", "one point two million dollars and five thousand dollars"),
    ("$5 million", "five million dollars"),
    (
        "€3.50 and £2.50 and £1 and ¥300",
        "three euros and fifty cents and two pounds and fifty pence and one pound and three hundred yen",
    ),
    ("In 1999, 2024 and 2005.", "In nineteen ninety-nine, twenty twenty-four and two thousand five."),
    ("1900 and 1905 and 2010", "nineteen hundred and nineteen oh five and twenty ten"),
    ("the 1990s and '80s", "the nineteen nineties and eighties"),
    ("May 5th", "May fifth"),
    ("May 5", "May fifth"),
    ("May 5, 2024", "May fifth, twenty twenty-four"),
    ("5 May 2024", "the fifth of May twenty twenty-four"),
    ("2024-05-05", "May fifth, twenty twenty-four"),
    ("5/6/2024", "May sixth, twenty twenty-four"),  # US month/day
    ("25/12/2024", "December twenty-fifth, twenty twenty-four"),  # day first when it must be
    ("10:30", "ten thirty"),
    ("10:05", "ten oh five"),
    ("12:00", "twelve o'clock"),
    ("9am", "nine a m"),
    ("9 a.m. tomorrow", "nine a m tomorrow"),
    ("at 9 a.m. Then", "at nine a m. Then"),
    ("3:45 PM", "three forty-five p m"),
    ("9:00 AM", "nine a m"),
    ("5-10 people", "five to ten people"),
    ("5 - 10 people", "five to ten people"),
    ("$5-10", "five to ten dollars"),
    ("10-15%", "ten to fifteen percent"),
    ("1999-2005", "nineteen ninety-nine to two thousand five"),
    (
        "Dr. Smith and Mr. Jones met Mrs. Brown, Ms. Lee and Prof. Chen.",
        "Doctor Smith and Mister Jones met Missus Brown, Miz Lee and Professor Chen.",
    ),
    ("St. Louis is on Main St. now", "Saint Louis is on Main Street now"),
    ("cats vs. dogs, e.g. pets, i.e. animals, etc.", "cats versus dogs, for example pets, that is animals, et cetera."),
    ("approx. 5 km", "approximately five kilometers"),
    ("No. 5", "Number five"),
    (
        "5 kg, 1 kg, 10 min, 30 sec, 2 h, 5 cm, 5 mm, 5 ml",
        "five kilograms, one kilogram, ten minutes, thirty seconds, two hours, five centimeters, "
        "five millimeters, five milliliters",
    ),
    ("R&D & more, 100%", "R and D and more, one hundred percent"),
    ("See https://example.com/docs.", "See example dot com slash docs."),
    ("Mail a@b.com.", "Mail a at b dot com."),
    ("www.example.org/a-b_c?x=1#top", "example dot org slash a dash b underscore c"),
    ("Go to example.com/docs now", "Go to example dot com slash docs now"),
    ("x86, COVID-19, 5G, C++, C#", "x eighty-six, COVID nineteen, five G, C plus plus, C sharp"),
    ("3x faster, 128GB, 10°C", "three times faster, one hundred twenty-eight gigabytes, ten degrees Celsius"),
    (
        "Call 555-123-4567 or use PIN 0042",
        "Call five five five, one two three, four five six seven or use PIN zero zero four two",
    ),
    ("A -> B, 2 + 2 = 4", "A to B, two plus two equals four"),
    # Digits joined by hyphens: digit groups (phones, codes), dates, ranges only where words say so.
    ("Call 555-1234 today.", "Call five five five, one two three four today."),
    ("Dial 1-800-555-1234.", "Dial one, eight zero zero, five five five, one two three four."),
    ("Code 4521-8890 works", "Code four five two one, eight eight nine zero works"),
    ("The score was 3-2.", "The score was three, two."),
    ("Due 12-25-2024 at noon", "Due December twenty-fifth, twenty twenty-four at noon"),
    ("Read pages 5-7.", "Read pages five to seven."),
    ("It takes 3-4 days", "It takes three to four days"),
    ("aged 18-25", "aged eighteen to twenty-five"),
    ("between 10-20 minutes", "between ten and twenty minutes"),
    ("5–7", "five to seven"),
    ("I live on Main St. It is nice.", "I live on Main Street. It is nice."),
    ("Visit St. Louis, then St. Patrick's", "Visit Saint Louis, then Saint Patrick's"),
    ("Cost: ~$50 at 20℃", "Cost: about fifty dollars at twenty degrees Celsius"),
    ("The U.S. economy, P.S. and Ph.D. student", "The U S economy, P S and P h D student"),
]


@pytest.mark.parametrize("text,spoken", ENGLISH)
def test_english_readings(text, spoken):
    assert normalize(text, "en") == spoken
    assert normalize(text) == spoken  # auto: no CJK around, so English


CHINESE = [
    ("价格是123元", "价格是一百二十三元"),
    ("2024年5月5日", "二零二四年五月五日"),
    ("圆周率约3.5", "圆周率约三点五"),
    ("增长50%", "增长百分之五十"),
    ("¥3.50的价格", "三点五元的价格"),
    ("3.5元", "三点五元"),
    ("10:30开会", "十点三十分开会"),
    ("时间是10:05", "时间是十点零五分"),
    ("有0个", "有零个"),
    ("共10000人", "共一万人"),
    ("共 10001 人", "共一万零一人"),
    ("日期2024-05-05", "日期二零二四年五月五日"),
    ("3-5天", "三到五天"),
    ("零下-5度", "零下负五度"),
    ("我有2个苹果", "我有两个苹果"),
    ("第2名", "第二名"),
    ("价格$5M，€3.50。", "价格五百万美元，三点五欧元。"),
    ("iPhone 15 发布了", "iPhone 十五发布了"),  # the next letter is CJK
    ("你好！我很好。“好的”《书名》「引用」，一、二：三；", "你好！我很好。“好的”《书名》「引用」，一、二：三；"),
    ("电话13800138000", "电话一三八零零一三八零零零"),
    ("温度是-5℃，等2分钟", "温度是负五摄氏度，等两分钟"),
    ("会议定于2024年3月15日下午2:30举行", "会议定于二零二四年三月十五日下午两点三十分举行"),
    ("GDP增长了6.5%，比分是3:2", "GDP增长了百分之六点五，比分是三比二"),
]


@pytest.mark.parametrize("text,spoken", CHINESE)
def test_chinese_readings(text, spoken):
    assert normalize(text) == spoken


def test_language_setting_overrides_context():
    assert normalize("123", "zh") == "一百二十三"
    assert normalize("The price is 5 dollars", "zh") == "The price is 五 dollars"
    assert normalize("它有2个", "en") == "它有two个"
    assert normalize("I visited 北京 in 2019.") == "I visited 北京 in twenty nineteen."


def test_full_width_forms_become_half_width():
    assert normalize("１２３ＡＢＣ") == "one hundred twenty-three ABC"
    assert normalize("共１２３个") == "共一百二十三个"


def test_invalid_language_is_rejected():
    with pytest.raises(ValueError):
        TextNormalizer("fr")


# -- markdown ------------------------------------------------------------------------------

MARKDOWN = [
    ("**Bold** and *italic* and __under__ and _it_", "Bold and italic and under and it"),
    ("Use `snake_case` and `__init__` here", "Use snake case and init here"),
    ("snake_case_name and 2*3 and a * b", "snake case name and two times three and a b"),
    ("~~old~~ new, ~5 left", "old new, about five left"),
    ("See [the docs](https://x.y/z) and ![a cat](cat.png).", "See the docs and a cat."),
    ("Read [guide][ref] now [1].", "Read guide now."),
    ("# Title\nBody text", "Title. Body text"),
    ("## Step 1\nInstall it", "Step one. Install it"),
    ("Items:\n- apples\n- pears\n* plums\n+ figs", "Items: apples. pears. plums. figs"),
    ("Steps:\n1. Open it\n2. Close it", "Steps: Open it. Close it"),
    ("- [ ] todo\n- [x] done", "todo. done"),
    ("> Quoted text\n> more", "Quoted text. more"),
    ("Run this:\n```python\nprint('hi')\nx = 1\n```\nThat's all.", "Run this: That's all."),
    ("Before\n~~~\ncode\n~~~\nAfter", "Before. After"),
    ("| Plan | Price |\n|------|:-----:|\n| Basic | $9 |", "Plan Price. Basic nine dollars"),
    ("Above\n\n---\n\nBelow", "Above. Below"),
    ("Title\n=====\nText", "Title. Text"),
    ("Line one\nLine two.\n\nNew paragraph!", "Line one. Line two. New paragraph!"),
    ("你好\n世界", "你好。世界"),
    ("Visit <https://a.b/c> now<br>ok", "Visit a dot b slash c now ok"),
    ("Escaped \\*stars\\* stay", "Escaped stars stay"),
    ("#hashtag and #1 pick", "hashtag and number one pick"),
    ("```code``` on one line\nnext", "code on one line. next"),
    (
        "1.5 million people\n42 is the answer\n-5 degrees",
        "one point five million people. forty-two is the answer. minus five degrees",
    ),
    ("**Note:** hi\n*Tip* two", "Note: hi. Tip two"),
    ("好的！以下是**三个建议**：\n\n1. 每天喝8杯水\n2. 保持7-8小时睡眠", "好的！以下是三个建议：每天喝八杯水。保持七到八小时睡眠"),
]


@pytest.mark.parametrize("text,spoken", MARKDOWN)
def test_markdown_is_stripped(text, spoken):
    assert normalize(text) == spoken


# -- emoji and whitespace ---------------------------------------------------------------------

EMOJI = [
    ("Great job 👍🏽!", "Great job!"),
    ("Family 👨‍👩‍👧‍👦 time", "Family time"),
    ("Go 🇺🇸 team 🏴󠁧󠁢󠁳󠁣󠁴󠁿 now", "Go team now"),
    ("Love ❤️ it ✨🎉", "Love it"),
    ("Press 1️⃣ now", "Press one now"),
    ("好的😊。", "好的。"),
]


@pytest.mark.parametrize("text,spoken", EMOJI)
def test_emoji_are_removed(text, spoken):
    assert normalize(text) == spoken


def test_whitespace_collapses():
    assert normalize("  lots   of\t\tspace \u00a0 here  ") == "lots of space here"


def test_emoji_split_between_surrogates():
    text = "Hi 👍🏽 there 😀!"
    _, joined = stream(utf16_units(text))
    assert joined == "Hi there!"


# -- safe commit boundary ---------------------------------------------------------------------

SPLITS = [
    (["$3.", "50 today"], "three dollars and fifty cents today"),
    (["Dr", ". Smith"], "Doctor Smith"),
    (["e.", "g. this"], "for example this"),
    (["at 10:", "30 sharp"], "at ten thirty sharp"),
    (["pi is 3", ".14"], "pi is three point one four"),
    (["see https://exa", "mple.com now"], "see example dot com now"),
    (["mail a@", "b.com"], "mail a at b dot com"),
    (["**bo", "ld** text"], "bold text"),
    (["*", "*bold*", "*"], "bold"),
    (["[do", "cs](https://x", ".y/z) here"], "docs here"),
    (["`co", "de` ok"], "code ok"),
    (["- ", "item\n-", " next"], "item. next"),
    (["``", "`\nhidden\n``", "`\nshown"], "shown"),
    (["May ", "5", "th."], "May fifth."),
    (["2024", "年5", "月"], "二零二四年五月"),
    (["$5 ", "million"], "five million dollars"),
    (["👍", "🏽 ok"], "ok"),
]


@pytest.mark.parametrize("pieces,spoken", SPLITS)
def test_tricky_splits(pieces, spoken):
    _, joined = stream(pieces)
    assert joined == spoken == normalize("".join(pieces))


def test_nothing_unsafe_is_committed_early():
    normalizer = TextNormalizer()
    assert normalizer.push("It costs $3.") == "It costs"
    assert normalizer.push("50") == ""
    # A number waits for the next word too ("$5 million", "5 May", "5个").
    assert normalizer.push(" now") == ""
    assert normalizer.push(" ") == " three dollars and fifty cents now"
    assert normalizer.flush() == ""


def test_commit_lags_by_about_one_token():
    normalizer = TextNormalizer()
    assert normalizer.push("The quick brown") == "The quick"
    assert normalizer.push(" fox jumps") == " brown fox"
    assert normalizer.push(" over ") == " jumps over"
    chinese = TextNormalizer()
    assert chinese.push("今天天气很好") == "今天天气很好"  # CJK commits per character


def test_flush_keeps_normalizer_usable():
    normalizer = TextNormalizer()
    assert normalizer.push("Hello ") == "Hello"
    assert normalizer.flush() == ""
    assert normalizer.push("world ") == " world"
    assert normalizer.push("$5") == ""
    assert normalizer.flush() == " five dollars"
    assert normalizer.push(" again.") == ""
    assert normalizer.flush() == " again."


# -- property: streaming equals one-shot -------------------------------------------------------

TRICKY_TEXTS = [
    EXAMPLE,
    "Dr. Smith arrived at 10:30 on 2024-05-05, e.g. before 9 a.m. Then he left.",
    "It costs $1.2M or $5k, or $5 million. 3.14 and -5 and 1,234,567 (about 50%).",
    "In 1999, 2024 and 2005 we saw growth. The 1990s and '80s. 5-10 items, $5-$10.",
    "Meet at 9am or 3:45 PM or 12:00. See https://example.com/docs or mail a@b.com.",
    "**Bold** and *italic* and `code_here` and [docs](https://x.y/z) ![alt](img.png)",
    "# Heading\n- item one\n- item two\n1. first\n2. second\n\n> quote\n\n```python\nprint(1)\n```\nDone",
    "Great job 👍🏽 family 👨‍👩‍👧 flag 🇺🇸 keycap 1️⃣ ok ❤️",
    "价格是3.5元，2024年5月5日，10:30开会，增长50%，共10000人，0个。",
    "我有2个苹果, iPhone 15 发布了！¥3.50 是价格",
    "| a | b |\n|---|---|\n| 1 | 2 |\n\n---\nsnake_case and __init__ and 2*3",
    "Visit <https://a.b/c> or <br> [1] [x] and **unclosed bold and `unclosed code\nnext \\* ok ~~s~~ ~5 ![",
    "Text with [a link [nests](u) and ![img](i \"t\") ok] **_mixed_** ***all***\n***\nEnd - 5 - 10 — dash",
    "St. Louis, Main St. now; No. 5, 5 kg, 3x, 16:9, 5/6/2024, 24/7, R&D, C#, A -> B.",
    "Mixed 中文 and English 123 then 中文456 and 7 个 and 2024年.",
    "Call 555-1234 or 1-800-555-1234 by 12-25-2024; read pages 5-7, between 10-20 minutes, 3-2.",
]


@pytest.mark.parametrize("text", TRICKY_TEXTS)
def test_random_splits_match_one_shot(text):
    expected = normalize(text)
    rng = random.Random(seed_of(text))
    for _ in range(60):
        _, joined = stream(random_split(text, rng))
        assert joined == expected
    _, per_char = stream(list(text))
    assert per_char == expected
    _, per_unit = stream(utf16_units(text))
    assert per_unit == expected


@pytest.mark.parametrize("language", ["en", "zh"])
def test_random_splits_match_one_shot_in_fixed_language(language):
    rng = random.Random(11)
    for text in TRICKY_TEXTS:
        expected = normalize(text, language)
        for _ in range(10):
            _, joined = stream(random_split(text, rng), language)
            assert joined == expected


def test_random_character_soup_streams_consistently():
    alphabet = list("ab Z 1 2 0 .,;:!?$€%-—*_~`[]()<>#|\\/&@+\n中。，年个 ") + [
        "https://",
        ".com",
        "e.g.",
        "Dr.",
        "St.",
        "a.m.",
        "May ",
        "😀",
        "👨‍👩‍👧",
        "```",
        "- ",
        "1. ",
        "# ",
        "> ",
        "**",
        "2024",
        "10:30",
        "3.50",
        "1,234",
        "th",
        "km",
    ]
    rng = random.Random(2024)
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        expected = normalize(text)
        _, joined = stream(random_split(text, rng))
        assert joined == expected, text


# -- segmenter -------------------------------------------------------------------------------


def test_first_fragment_may_end_at_a_clause():
    text = "Sure, here is the plan for tomorrow, starting early. Then we go home, and sleep. Bye"
    assert segment_all(text) == [
        "Sure, here is the plan for tomorrow,",  # "Sure," alone has too few words
        "starting early.",
        "Then we go home, and sleep.",  # later fragments end at sentences only
        "Bye",
    ]


def test_first_fragment_min_words_is_configurable():
    text = "Sure, here is the plan, today."
    assert segment_all(text, first_min_words=1) == ["Sure,", "here is the plan, today."]


def test_first_fragment_cut_at_word_boundary_when_long():
    text = "This is a very long first sentence without any punctuation that goes on and on for a while"
    assert segment_all(text) == [
        "This is a very long first sentence without any punctuation",
        "that goes on and on for a while",
    ]


def test_long_sentence_cut_at_clause_then_word():
    text = "Ok then. " + "alpha beta, " * 10 + "gamma delta " * 10 + "end."
    fragments = segment_all(text, max_chars=80)
    assert fragments[0] == "Ok then."
    assert fragments[1] == "alpha beta, " * 5 + "alpha beta,"  # last clause within 80 chars
    assert all(len(fragment) <= 80 for fragment in fragments)
    assert squeeze("".join(fragments)) == squeeze(text)


def test_long_sentence_without_clauses_cut_at_word():
    text = "Ok. " + "word " * 30 + "end."
    fragments = segment_all(text, max_chars=50)
    assert fragments[1] == ("word " * 10).strip()
    assert squeeze("".join(fragments)) == squeeze(text)


def test_period_at_end_of_buffer_waits():
    segmenter = Segmenter()
    assert segmenter.push("Hello there.") == []
    assert segmenter.push(" More") == ["Hello there."]
    assert segmenter.flush() == ["More"]


def test_flush_returns_rest_and_segmenter_stays_usable():
    segmenter = Segmenter()
    assert segmenter.push("One two three") == []
    assert segmenter.flush() == ["One two three"]
    assert segmenter.flush() == []
    fragments = segmenter.push("Again, the first fragment is short, see. ")
    assert fragments == ["Again, the first fragment is short,", "see."]


def test_chinese_segments():
    text = "你好。今天天气很好，我们出去玩吧！明天见"
    assert segment_all(text) == ["你好。", "今天天气很好，我们出去玩吧！", "明天见"]


def test_chinese_first_fragment_clause():
    assert segment_all("好的，我们今天下午三点开会，请准时。") == ["好的，我们今天下午三点开会，", "请准时。"]


def test_closing_quotes_stay_with_their_sentence():
    text = '"Really now?!" she asked. 「好。」然后'
    assert segment_all(text) == ['"Really now?!"', "she asked.", "「好。」", "然后"]


def test_a_one_word_opener_joins_the_next_fragment():
    """"Done!" alone would play out (~0.5 s) before the next sentence is ready: a stall."""
    fragments = segment_all("Done! Your reminder is set for tomorrow morning at seven.")
    assert fragments[0].startswith("Done! Your")
    assert segment_all("Hello there! How are you today?")[0] == "Hello there!"
    assert segment_all("好的。我来帮你。")[0] == "好的。"  # two CJK characters are two words


def test_punctuation_only_text_is_never_a_fragment():
    assert segment_all("Hi there! ... ! Bye.") == ["Hi there!...!", "Bye."]
    assert segment_all(" . , ! ") == []
    assert segment_all("") == []


SEGMENT_TEXTS = [normalize(text) for text in TRICKY_TEXTS] + [
    "Short. " * 30,
    "A sentence that keeps going, with clauses; and more clauses: and more words " * 8,
    "你好。今天天气很好，我们出去玩吧！" * 10,
    "x" * 500 + " tail.",
]


@pytest.mark.parametrize("text", SEGMENT_TEXTS)
def test_segmenter_loses_and_duplicates_nothing(text):
    rng = random.Random(seed_of(text))
    for sizes in ({}, {"first_min_words": 1, "first_max_chars": 15, "max_chars": 40}):
        for _ in range(20):
            segmenter = Segmenter(**sizes)
            fragments: list[str] = []
            for piece in random_split(text, rng):
                fragments += segmenter.push(piece)
            fragments += segmenter.flush()
            assert squeeze("".join(fragments)) == squeeze(text)
            for fragment in fragments:
                assert fragment == fragment.strip()
                assert any(ch.isalnum() for ch in fragment)
