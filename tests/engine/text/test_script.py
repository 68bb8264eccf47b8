"""engine/text/script.py: the script format, pauses, tags and their errors."""

from __future__ import annotations

import pytest

from engine.errors import InvalidInput, TooLarge
from engine.text.script import (
    MAX_SCRIPT_CHARS,
    Pause,
    Speech,
    break_seconds,
    check_tags,
    compile_script,
    parse_script,
    sentences,
    split_pauses,
)

CAST = ["Alice", "Bob"]


def test_turns_instructs_continuations_and_comments():
    script = "intro line\nAlice: Hi Bob.\n# a comment\n\nbob (whispering): Hi.\nstill Bob\nNote: not a name"
    lines = parse_script(script, CAST)
    assert [(ln.speaker, ln.text, ln.instruct, ln.number) for ln in lines] == [
        ("Alice", "intro line", "", 1),
        ("Alice", "Hi Bob.", "", 2),
        ("Bob", "Hi.", "whispering", 5),
        ("Bob", "still Bob", "", 6),
        ("Bob", "Note: not a name", "", 7),
    ]


@pytest.mark.parametrize(
    ("script", "cast", "match"),
    [
        ("Carol (loud): hi", CAST, "line 1: speaker 'Carol' has no voice"),
        ("Alice: hi\nBob:   ", CAST, "line 2: Bob has nothing to say"),
        ("\n# only a comment\n", CAST, "no text to speak"),
        ("Alice: hi", [], "at least one speaker"),
    ],
)
def test_parse_errors_name_the_line(script, cast, match):
    with pytest.raises(InvalidInput, match=match):
        parse_script(script, cast)


def test_a_script_over_the_limit_states_it():
    with pytest.raises(TooLarge, match=f"the limit is {MAX_SCRIPT_CHARS}"):
        parse_script("a" * (MAX_SCRIPT_CHARS + 1), CAST)


@pytest.mark.parametrize(
    ("tag", "seconds"),
    [('<break time="500ms"/>', 0.5), ("<break time='1.5s' />", 1.5), ('<BREAK time="0ms">', 0.0)],
)
def test_break_forms(tag, seconds):
    assert break_seconds(tag) == seconds


@pytest.mark.parametrize(
    ("tag", "match"),
    [
        ("<break/>", "is not a pause"),
        ('<break time="5m"/>', "is not a pause"),
        ('<break time="11s"/>', "10 s"),
    ],
)
def test_bad_breaks(tag, match):
    with pytest.raises(InvalidInput, match=match):
        break_seconds(tag)


def test_pauses_split_the_text_where_they_stand():
    pieces = split_pauses('One. <break time="250ms"/>Two.<break time="1s"/>')
    assert pieces == ["One.", Pause(0.25), "Two.", Pause(1.0)]


def test_model_tags_pass_and_unknown_tags_are_refused():
    check_tags("I [breath] said <strong>no</strong> [laughter] <laughter>ha</laughter>", "cosyvoice2")
    check_tags("phones [AA1] and pinyin [j][ǐ]", "cosyvoice3")
    for bad in ("a <b>bold</b> word", "see [1]", "<|endofprompt|>", "[AA1] on v2"):
        with pytest.raises(InvalidInput, match="unknown tag"):
            check_tags(bad, "cosyvoice2")


def test_an_unknown_tag_is_quoted_whole_when_short_and_cut_with_its_length_when_long():
    with pytest.raises(InvalidInput, match=r"line 3: unknown tag '<b>';"):
        check_tags("a <b>bold</b> word", "cosyvoice2", line=3)
    long_tag = "<" + "x" * 500 + ">"
    with pytest.raises(InvalidInput) as refused:
        check_tags(f"a {long_tag} word", "cosyvoice2")
    message = str(refused.value)
    assert "'<" + "x" * 39 + "'... (502 characters);" in message
    assert "x" * 41 not in message


def test_compile_puts_gaps_between_turns_and_breaks_in_place():
    lines = parse_script('Alice: One. <break time="400ms"/> Two.\nBob (sad): Three.', CAST)
    assert compile_script(lines, "cosyvoice3", gap_s=0.2) == [
        Speech("Alice", "One.", "", 1),
        Pause(0.4, 1),
        Speech("Alice", "Two.", "", 1),
        Pause(0.2, 2),
        Speech("Bob", "Three.", "sad", 2),
    ]


def test_compile_errors():
    with pytest.raises(InvalidInput, match="gap between turns"):
        compile_script(parse_script("Alice: hi", CAST), "cosyvoice3", gap_s=9)
    with pytest.raises(InvalidInput, match="line 2: unknown tag '<x>'"):
        compile_script(parse_script("Alice: hi\nBob: <x> yo", CAST), "cosyvoice3")
    with pytest.raises(InvalidInput, match="only pauses"):
        compile_script(parse_script('Alice: <break time="1s"/>', CAST), "cosyvoice3")


def test_long_text_is_cut_into_whole_sentences_in_order():
    text = " ".join(f"Sentence number {i} is here." for i in range(400))  # ~11,000 characters
    parts = sentences(text)
    assert len(parts) > 40 and all(len(p) <= 230 for p in parts)
    assert " ".join(parts) == text
