"""Opt-in text clean-up for batch jobs: input normalisation and stock-preamble removal.

Both are conservative on purpose. The practitioners' versions these replace delete emoji, ``#``,
``@``, ``/`` and ``%`` from prompts and eat the whole first sentence of an answer; these change
only what is listed below.

``normalize_input``:
- Unicode NFKC (full-width letters, digits and punctuation become their ASCII forms: ``ＡＢＣ１２３！``
  -> ``ABC123!``; CJK characters and emoji are unchanged);
- removes zero-width spaces and byte-order marks (U+200B, U+2060, U+FEFF, U+180E) and control
  characters other than tab and newline; keeps U+200C/U+200D and variation selectors, which
  scripts and emoji sequences (👨‍👩‍👧) need;
- collapses runs of spaces and tabs inside a line to one space (leading indentation is kept, so
  code keeps its shape), strips trailing spaces, and collapses three or more newlines to two;
- with ``max_chars``, keeps the first ``max_chars`` characters.

``clean_output`` strips, from the start of an answer only, these stock openings (once each, at
most two): "好的，" / "当然可以！" / "当然，" / "没问题，"; "以下是…：" up to a colon within 40
characters; "Sure, here is …:" / "Certainly! Here's …:" up to a colon within 80 characters;
"Sure!" / "Certainly," / "Of course." on their own. Nothing is stripped if nothing would be left.
"""

from __future__ import annotations

import re
import unicodedata

_REMOVED = {"\u200b", "\u2060", "\ufeff", "\u180e"}
_SPACE_RUN = re.compile(r"(?<=\S)[ \t]{2,}")
_TRAILING = re.compile(r"[ \t]+$", re.MULTILINE)
_BLANK_RUN = re.compile(r"\n{3,}")
_LEADING_BLANK_LINES = re.compile(r"\A(?:[ \t]*\n)+")


def normalize_input(text: str, max_chars: int | None = None) -> str:
    """NFKC, invisible characters removed, whitespace runs collapsed, optionally truncated (see module doc)."""
    text = unicodedata.normalize("NFKC", text)
    text = "".join(c for c in text if c not in _REMOVED and (c in "\t\n" or unicodedata.category(c) != "Cc"))
    text = _SPACE_RUN.sub(" ", text)
    text = _TRAILING.sub("", text)
    text = _LEADING_BLANK_LINES.sub("", _BLANK_RUN.sub("\n\n", text)).rstrip()  # the first line keeps its indent
    if max_chars is not None:
        text = text[:max_chars]
    return text


_PREAMBLES = [
    re.compile(r"^(?:好的|当然可以|当然|没问题)[，,！!。.、]\s*"),
    re.compile(r"^以下是[^：:\n]{0,40}[：:]\s*"),
    re.compile(r"^(?:sure|certainly|of course|absolutely)[,!.]?\s+(?:here is|here's|here are)[^:\n]{0,80}:\s*", re.I),
    re.compile(r"^(?:sure|certainly|of course|absolutely)[,!.]\s*", re.I),
]


def clean_output(text: str) -> str:
    """The answer without a stock opening such as "好的，以下是…：" or "Sure, here is …:" (see module doc)."""
    cleaned = text.lstrip()
    for _ in range(2):
        match = next((m for p in _PREAMBLES if (m := p.match(cleaned))), None)
        if match is None:
            break
        if not cleaned[match.end() :].strip():
            return text  # the answer is only a preamble: leave it whole
        cleaned = cleaned[match.end() :]
    return cleaned if cleaned.strip() else text
