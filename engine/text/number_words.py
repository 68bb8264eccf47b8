"""English number words for digit runs that text normalisation left behind.

The reference (cosyvoice/utils/frontend_utils.py ``spell_out_number``) replaces every maximal run of digits
with ``inflect.number_to_words``. This module writes the same style without the dependency: hyphenated tens
("twenty-one"), "and" after hundreds ("one hundred and one"), a comma between thousands groups ("one thousand,
two hundred and thirty-four"). Runs with leading zeros or longer than 15 digits (phone, card, serial numbers)
are read digit by digit, which is how people say them.
"""

from __future__ import annotations

import re

_ONES = (
    *("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"),
    *("ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen"),
    "nineteen",
)
_TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")
_SCALES = ("", "thousand", "million", "billion", "trillion")
# ASCII only: \d would also match full-width and other scripts' digits, which are left as they are.
_DIGIT_RUN = re.compile(r"[0-9]+")
_MAX_GROUPED_DIGITS = 15  # up to "trillion"; longer runs are identifiers, not quantities


def _below_hundred(n: int) -> str:
    if n < 20:
        return _ONES[n]
    tens, ones = divmod(n, 10)
    return _TENS[tens] if ones == 0 else f"{_TENS[tens]}-{_ONES[ones]}"


def _below_thousand(n: int, with_and: bool) -> str:
    """``with_and``: the group follows a larger one ("one thousand and five") or has hundreds."""
    hundreds, rest = divmod(n, 100)
    head = f"{_ONES[hundreds]} hundred" if hundreds else ""
    if not rest:
        return head
    tail = _below_hundred(rest)
    if head:
        return f"{head} and {tail}"
    return f"and {tail}" if with_and else tail


def digits_to_words(digits: str) -> str:
    """Read a string of ASCII digits one by one: "007" -> "zero zero seven"."""
    return " ".join(_ONES[int(d)] for d in digits)


def number_to_words(digits: str) -> str:
    """Cardinal reading of a run of ASCII digits: "1234" -> "one thousand, two hundred and thirty-four"."""
    if not digits.isascii() or not digits.isdigit():
        raise ValueError(f"number_to_words expects ASCII digits, got {digits!r}")
    if (len(digits) > 1 and digits[0] == "0") or len(digits) > _MAX_GROUPED_DIGITS:
        return digits_to_words(digits)
    value = int(digits)
    if value == 0:
        return "zero"
    groups: list[int] = []
    while value:
        value, group = divmod(value, 1000)
        groups.append(group)
    return _join_groups(groups)


def _join_groups(groups: list[int]) -> str:
    """``groups`` are base-1000 digits, least significant first."""
    parts: list[str] = []
    for scale in range(len(groups) - 1, -1, -1):
        group = groups[scale]
        if not group:
            continue
        words = _below_thousand(group, with_and=scale == 0 and bool(parts))
        parts.append(f"{words} {_SCALES[scale]}".strip())
    text = ", ".join(parts)
    return text.replace(", and ", " and ")


def spell_out_numbers(text: str) -> str:
    """Replace every maximal run of ASCII digits in ``text`` with its English words."""
    return _DIGIT_RUN.sub(lambda m: number_to_words(m.group()), text)
