"""English number words for digit runs (inflect's style: hyphens, "and", group commas)."""

from __future__ import annotations

import pytest

from engine.text.number_words import digits_to_words, number_to_words, spell_out_numbers


@pytest.mark.parametrize(
    ("digits", "words"),
    [
        ("0", "zero"),
        ("7", "seven"),
        ("13", "thirteen"),
        ("21", "twenty-one"),
        ("40", "forty"),
        ("100", "one hundred"),
        ("101", "one hundred and one"),
        ("999", "nine hundred and ninety-nine"),
        ("1000", "one thousand"),
        ("1001", "one thousand and one"),
        ("1234", "one thousand, two hundred and thirty-four"),
        ("2000000", "two million"),
        ("1000001", "one million and one"),
    ],
)
def test_cardinals(digits, words):
    assert number_to_words(digits) == words


def test_leading_zeros_and_very_long_runs_are_read_digit_by_digit():
    assert number_to_words("007") == "zero zero seven"
    assert number_to_words("1" * 16) == digits_to_words("1" * 16) == " ".join(["one"] * 16)


def test_spell_out_replaces_each_ascii_run_only():
    assert spell_out_numbers("Room 12B, gate 3 and ４") == "Room twelveB, gate three and ４"
    with pytest.raises(ValueError):
        number_to_words("12a")
