"""Text pieces -> normalised fragments: no word, number or tag is cut at a piece boundary."""

from __future__ import annotations

import pytest

from engine.errors import TooLarge
from engine.text.frontend import normalize_text
from engine.text.stream import TextPieces, safe_cut


def en(text: str) -> str:
    return normalize_text(text, "en", "cosyvoice3")


def feed(pieces: list[str], normalize=en, max_chars: int = 1000) -> list[str]:
    tp = TextPieces(normalize, max_chars)
    return [*(tp.push(p) for p in pieces), tp.finish()]


@pytest.mark.parametrize(
    ("text", "cut"),
    [
        ("Hello wor", 5),  # "wor" may continue
        ("Hello world", 5),
        ("Hello world ", 5),  # nothing known after the space yet
        ("It costs $5", 8),  # the number waits for what follows
        ("It costs $5.50 today and", 20),  # released with the word after the number
        ("Jan. 5, 2024 was", 0),  # "Jan." waits too: a digit follows it
        ("Jan. 5, 2024 was good", 16),
        ("Say [breath] then", 12),
        ("Say [bre", 3),
        ("你好世界", 3),  # after each CJK character
        ("共2024年", 0),  # never next to a digit
        ("共2024年的", 0),  # nor one character after one
        ("共2024年的书", 7),
        ("word", 0),
    ],
)
def test_safe_cut(text, cut):
    assert safe_cut(text) == cut


def test_numbers_split_across_pieces_read_as_in_the_whole_text():
    whole = en("It costs $5.50 today, on Jan. 5, 2024.")
    out = feed(["It co", "sts $5", ".5", "0 tod", "ay, on Jan", ". 5, 20", "24."])
    assert "".join(out) == whole
    assert out[-1] != whole  # something was released before the end


def test_fragments_keep_the_space_between_words():
    out = feed(["Hello", " there", " my", " friend"], normalize=lambda s: s)
    assert "".join(out) == "Hello there my friend"
    assert out[:2] == ["", "Hello"] and out[2] == " there"


def test_the_length_limit_counts_every_piece():
    tp = TextPieces(lambda s: s, max_chars=10)
    tp.push("12345 ")
    with pytest.raises(TooLarge, match="10 characters"):
        tp.push("678901")
