"""Pronunciation lexicons: hints -> the released tokens, the matching rules, per-owner storage on disk."""

from __future__ import annotations

import json

import pytest

from engine.errors import Conflict, Forbidden, InvalidInput, NotFound
from engine.lexicons import Lexicon, LexiconLibrary, detect_kind, hint_text, make_entries
from engine.text.frontend import special_tokens
from engine.voices import VoiceLibrary


@pytest.mark.parametrize(
    ("hint", "kind", "say"),
    [
        ("ji3", "pinyin", "[j][ǐ]"),  # the official example's hot-fix for 给 in 给予
        ("jǐ", "pinyin", "[j][ǐ]"),
        ("ji3 yu3", "pinyin", "[j][ǐ][y][ǔ]"),
        ("lv4", "pinyin", "[l][ǜ]"),
        ("lüe4", "pinyin", "[l][vè]"),  # the released list spells this final with v
        ("er2", "pinyin", "[ér]"),
        ("zhong1", "pinyin", "[zh][ōng]"),
        ("liu2", "pinyin", "[l][iú]"),
        ("shui3", "pinyin", "[sh][uǐ]"),
        ("ma5", "pinyin", "[m][a]"),
        ("N AY1 K IY0", "arpabet", "[N][AY1][K][IY0]"),
        ("[j][ǐ]", "tokens", "[j][ǐ]"),
        ("Nye-key", "respell", "Nye-key"),
    ],
)
def test_hints_become_released_tokens(hint, kind, say):
    assert detect_kind(hint) == kind
    assert hint_text("w", hint, "auto", "cosyvoice3") == say
    tokens = set(special_tokens("cosyvoice3"))
    assert all(f"[{t}]" in tokens for t in say.strip("[]").split("][")) or kind == "respell"


@pytest.mark.parametrize(
    ("hint", "named"),
    [
        ("N AY9 K IY0", "'AY9'"),
        ("ZZ1", "'ZZ1'"),
        ("jx3", "'jx3'"),
        ("ji6", "'ji6'"),
        ("[j][q9]", "[q9]"),
        ("[breath]", "[breath]"),  # a tag, not a phone
    ],
)
def test_a_bad_hint_is_an_error_naming_the_phone_or_syllable(hint, named):
    with pytest.raises(InvalidInput) as err:
        hint_text("Nike", hint, "auto", "cosyvoice3")
    assert named in str(err.value) and "'Nike'" in str(err.value)


def test_v2_takes_respellings_only():
    assert hint_text("Nike", "Nye-key", "auto", "cosyvoice2") == "Nye-key"
    with pytest.raises(InvalidInput, match="respelling"):
        hint_text("Nike", "N AY1 K IY0", "auto", "cosyvoice2")


def test_bad_entries_are_refused():
    with pytest.raises(InvalidInput, match="twice"):
        make_entries([{"word": "Nike", "hint": "N AY1"}, {"word": "nike", "hint": "N IY1"}], "cosyvoice3")
    with pytest.raises(InvalidInput, match="brackets"):
        make_entries([{"word": "[x]", "hint": "N AY1"}], "cosyvoice3")
    with pytest.raises(InvalidInput, match="hint"):
        make_entries([{"word": "Nike", "hint": " "}], "cosyvoice3")
    with pytest.raises(InvalidInput, match="kind"):
        make_entries([{"word": "Nike", "hint": "N AY1", "kind": "ipa"}], "cosyvoice3")


def lexicon(*entries: dict) -> Lexicon:
    return Lexicon("t", "t", make_entries(list(entries), "cosyvoice3"))


def test_whole_words_any_case_and_chinese_anywhere():
    lex = lexicon({"word": "Nike", "hint": "N AY1 K IY0"}, {"word": "给予", "hint": "ji3 yu3"})
    out = lex.apply("nike, NIKE, Nikes and Nike's; 报道给予好评")
    assert (
        out.text == "[N][AY1][K][IY0], [N][AY1][K][IY0], Nikes and [N][AY1][K][IY0]'s; 报道[j][ǐ][y][ǔ]好评"
    )
    assert out.counts() == {"Nike": 3, "给予": 1}
    assert [(h.matched, h.start) for h in out.hits][:2] == [("nike", 0), ("NIKE", 6)]


def test_match_case_longest_first_and_tags_untouched():
    lex = lexicon(
        {"word": "US", "hint": "you ess", "match_case": True},
        {"word": "New York", "hint": "Noo York"},
        {"word": "New", "hint": "Nyoo"},
    )
    out = lex.apply("the US and us, New York, New, [New] <New>")
    assert out.text == "the you ess and us, Noo York, Nyoo, [New] <New>"


def test_storage_is_per_owner_beside_the_voices(tmp_path):
    voices = VoiceLibrary(tmp_path, "cosyvoice3")
    lib = LexiconLibrary(voices.root, "cosyvoice3")
    lib.save("Brands", [{"word": "Nike", "hint": "N AY1 K IY0"}], owner="alice")
    lib.save("Shared", [{"word": "Qwen", "hint": "chwen"}], owner=None)
    assert [x.name for x in lib.list("alice")] == ["Brands", "Shared"]
    assert [x.name for x in lib.list("bob")] == ["Shared"]
    with pytest.raises(NotFound):
        lib.get("brands", "bob")
    with pytest.raises(NotFound):
        lib.delete("brands", "bob")
    with pytest.raises(Forbidden):
        lib.delete("shared", "alice")
    with pytest.raises(Conflict):
        lib.save("brands", [], owner="alice")
    assert lib.get("Brands", "alice").entries[0].say == "[N][AY1][K][IY0]"
    assert voices.list("alice") == voices.list(None)  # the lexicon folders are no voices
    stored = [p for p in tmp_path.rglob("*.json")]
    assert len(stored) == 2 and not any("alice" in str(p) for p in stored)  # the owner is hashed
    assert json.loads(stored[0].read_text())["format"] == 1
    lib.delete("brands", "alice")
    assert [x.name for x in lib.list("alice")] == ["Shared"]


def test_a_lexicon_saved_for_v3_names_its_entry_when_read_by_v2(tmp_path):
    LexiconLibrary(tmp_path, "cosyvoice3").save("Brands", [{"word": "Nike", "hint": "N AY1 K IY0"}], "a")
    with pytest.raises(InvalidInput, match="Nike"):
        LexiconLibrary(tmp_path, "cosyvoice2").get("Brands", "a")


@pytest.mark.parametrize(
    "pieces",
    [
        ["I love Ni", "ke and New", " York, 报道", "给", "予好评 [Ni", "ke] nike", "s Nike"],
        list("I love Nike and New York, 报道给予好评 [Nike] nikes Nike"),
        ["I love Nike and New York, 报道给予好评 [Nike] nikes Nike"],
    ],
)
def test_text_in_pieces_gets_what_the_whole_text_gets(pieces):
    from engine.lexicons import StreamApplier

    lex = lexicon(
        {"word": "Nike", "hint": "N AY1 K IY0"},
        {"word": "New York", "hint": "Noo York"},
        {"word": "给予", "hint": "ji3 yu3"},
    )
    stream = StreamApplier(lex)
    out = "".join(stream.feed(p) for p in pieces) + stream.end()
    whole = lex.apply("".join(pieces))
    assert out == whole.text and len(stream.hits) == len(whole.hits) == 4
