"""The opt-in text helpers of run-batch (``qwenbatch.batch.text``): input normalisation and preamble removal.

``normalize_input`` must clean what is invisible or inconsistent (zero-width characters, BOMs, control
characters, whitespace runs, full-width forms) without touching what carries meaning: Chinese, emoji
sequences (ZWJ families, flags, variation selectors) and code indentation. ``clean_output`` must strip
stock openings only at the very start, and never leave an answer empty.
"""

from __future__ import annotations

import pytest

from qwenbatch.batch.text import clean_output, normalize_input

# -- normalize_input: what must survive -------------------------------------------------------------

FAMILY = "👨\u200d👩\u200d👧"  # man ZWJ woman ZWJ girl: one glyph only while the ZWJs stay
FLAGS = "🇨🇳🇺🇸🇯🇵"  # regional-indicator pairs
HEART = "❤\ufe0f"  # with the emoji-presentation variation selector
KEYCAP = "1\ufe0f\u20e3"


@pytest.mark.parametrize(
    "text",
    [
        "用一句话介绍Python编程语言。",
        "The quick brown fox jumps over the lazy dog.",
        "I 🙂 Python 🎉",
        f"{FAMILY} is a family, {FLAGS} are flags, {HEART} and {KEYCAP}",
        "Symbols # @ / % and 100% stay",
        "日本語とEnglishと한국어",
        "line one\nline two\n\nafter one blank line",
    ],
)
def test_clean_text_is_unchanged(text):
    assert normalize_input(text) == text


def test_zwj_and_zwnj_are_kept_but_zero_width_spaces_go():
    text = f"{FAMILY}\u200b!\u200cx"
    assert normalize_input(text) == f"{FAMILY}!\u200cx"


def test_code_indentation_inside_the_text_is_kept():
    code = "def f(x):\n    if x:\n        return  x  +  1\n    return 0"
    assert normalize_input(code) == "def f(x):\n    if x:\n        return x + 1\n    return 0"


def test_indented_first_line_keeps_its_indentation():
    # A snippet cut from inside a function: every line is indented the same. Stripping only the first
    # line's indentation changes the code's shape (and makes it invalid Python).
    snippet = "    x = 1\n    y = 2"
    lines = normalize_input(snippet).split("\n")
    assert [line[: len(line) - len(line.lstrip())] for line in lines] == ["    ", "    "]


# -- normalize_input: what is cleaned ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("zero\u200bwidth\u2060joiner\u180evowel", "zerowidthjoinervowel"),
        ("\ufeffstarts with a BOM", "starts with a BOM"),
        ("a BOM\ufeff in the middle", "a BOM in the middle"),
        ("nul\x00 bell\x07 esc\x1b[0m", "nul bell esc[0m"),
        ("windows\r\nline ends", "windows\nline ends"),
        ("tab\tand newline\nkept", "tab\tand newline\nkept"),
        ("many     spaces\t\t and tabs", "many spaces and tabs"),
        ("trailing spaces   \nnext", "trailing spaces\nnext"),
        ("a\n\n\n\n\nb", "a\n\nb"),
        ("  \n\nsurrounding blank space \n\n  ", "surrounding blank space"),
        ("ＡＢＣ１２３！", "ABC123!"),
        ("ｆｕｌｌ\u3000ｗｉｄｔｈ\u3000\u3000ｓｐａｃｅｓ", "full width spaces"),
        ("中文，全角：标点！", "中文,全角:标点!"),
    ],
)
def test_noise_is_removed(text, expected):
    assert normalize_input(text) == expected


def test_chinese_text_with_noise():
    assert normalize_input("\ufeff你好\u200b，世界！  \n\n\n\n再见") == "你好,世界!\n\n再见"


def test_emoji_survive_with_noise_around_them():
    assert normalize_input(f"\u200b{FAMILY}   {FLAGS}\u200b  ok\x00") == f"{FAMILY} {FLAGS} ok"


def test_max_chars_keeps_the_first_characters_after_cleaning():
    assert normalize_input("abcdef", max_chars=3) == "abc"
    assert normalize_input("\u200b\u200bab    cd", max_chars=4) == "ab c"
    assert normalize_input("用一句话介绍Python", max_chars=6) == "用一句话介绍"
    assert normalize_input("short", max_chars=100) == "short"


def test_normalisation_is_idempotent():
    text = f"\ufeff  ＡＢＣ\u200b   {FAMILY}\n\n\n\n  indented\x07 line   \n"
    once = normalize_input(text)
    assert normalize_input(once) == once


# -- clean_output -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("好的，以下是Python的简介：\nPython是一种编程语言。", "Python是一种编程语言。"),
        ("好的，以下是代码：print(1)", "print(1)"),
        ("当然可以！Python很好用。", "Python很好用。"),
        ("当然，这是答案。", "这是答案。"),
        ("没问题，马上就好。", "马上就好。"),
        ("以下是三个要点：\n1. 快\n2. 稳", "1. 快\n2. 稳"),
        ("Sure, here is the code:\nprint(1)", "print(1)"),
        ("Sure! Here's the list:\n- a\n- b", "- a\n- b"),
        ("Certainly! Here's a summary:\nIt works.", "It works."),
        ("Certainly, here are the steps: first, second", "first, second"),
        ("Of course. It is 4.", "It is 4."),
        ("  Sure, here is x:\n y", "y"),
    ],
)
def test_stock_openings_are_stripped(text, expected):
    assert clean_output(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "Python是好的，以下是我的看法：它很快。",
        "The answer is sure, here is why: it is 4.",
        "I said: sure, here is the thing.",
        "Surely not.",
        "以后是未来。",
        "print('Sure, here is the code:')",
        "当然的事情不需要解释。",
        "Answer: 42",
    ],
)
def test_text_that_only_contains_such_words_later_is_unchanged(text):
    assert clean_output(text) == text


@pytest.mark.parametrize(
    "text",
    [
        "好的，",
        "当然可以！",
        "以下是答案：",
        "Sure!",
        "Sure.",
        "Certainly,",
        "Sure, here is the code:",
        "好的，以下是答案：",
    ],
)
def test_an_answer_that_is_only_a_preamble_is_not_emptied(text):
    cleaned = clean_output(text)
    assert cleaned.strip()
    assert text.endswith(cleaned)  # nothing invented, at most an opening removed


def test_at_most_two_openings_are_stripped():
    assert clean_output("好的，以下是答案：\n42") == "42"
    assert clean_output("好的，当然可以！以下是：x") == "以下是：x"


def test_whitespace_only_answer_is_returned_as_is():
    assert clean_output("   ") == "   "
    assert clean_output("") == ""
