"""Sentence splitting: terminal marks, quote attachment, greedy merge, short-tail merge, dropped segments."""

from __future__ import annotations

import pytest

from engine.text.split import (
    EN_TERMINALS,
    MAX_SENTENCE_CHARS,
    ZH_TERMINALS,
    cut_long,
    cut_sentences,
    is_punctuation_only,
    merge_sentences,
    split_sentences,
)


def words(text: str) -> int:
    """A stand-in token length: one token per word or mark."""
    return len(text.replace(".", " .").split())


def test_cut_keeps_every_character_and_attaches_closing_quotes():
    raw = "他说：“你好。”我笑了！！真的？后来"
    cut = cut_sentences(raw, ZH_TERMINALS)
    assert "".join(cut) == raw
    assert cut == ["他说：", "“你好。”", "我笑了！！", "真的？", "后来"]
    en = cut_sentences('He said "Stop." Then he left!! Why?', EN_TERMINALS)
    assert en == ['He said "Stop."', " Then he left!!", " Why?"]


def test_zh_and_en_terminal_sets_differ():
    assert cut_sentences("一、二", ZH_TERMINALS) == ["一、", "二"]
    assert cut_sentences("a、b", EN_TERMINALS) == ["a、b"]
    assert cut_sentences("a: b", EN_TERMINALS) == ["a:", " b"]


def test_a_final_mark_is_added():
    assert split_sentences("你好", "zh") == ["你好。"]
    assert split_sentences("hello", "en", words) == ["hello."]


def test_greedy_merge_closes_only_past_max_and_above_min():
    sentences = ["a" * 30 + "。"] * 7  # 31 characters each
    segments = merge_sentences(sentences, len, max_n=80, min_n=60, merge_len=20)
    # 31 -> 62 -> (93 > 80 and 62 > 60) close; the same again; the last 31 is >= 20 so it stays alone
    assert [len(s) for s in segments] == [62, 62, 62, 31]


def test_segment_under_min_keeps_growing_past_max():
    sentences = ["a" * 50 + "。", "b" * 50 + "。", "c" * 50 + "。"]
    segments = merge_sentences(sentences, len, max_n=80, min_n=60, merge_len=20)
    assert [len(s) for s in segments] == [102, 51]


def test_short_tail_joins_the_previous_segment():
    raw = "一" * 70 + "。" + "二" * 70 + "。" + "尾巴。"
    segments = split_sentences(raw, "zh")
    assert len(segments) == 2 and segments[-1].endswith("二。尾巴。")
    long_tail = "一" * 70 + "。" + "二" * 70 + "。" + "三" * 25 + "。"
    assert len(split_sentences(long_tail, "zh")) == 3


def test_en_length_is_measured_with_the_token_function():
    sentence = "one two three four five six seven eight nine ten. "  # 11 "tokens"
    segments = split_sentences(sentence * 20, "en", words)
    assert len(segments) > 1
    assert all(words(s) <= 80 + 11 for s in segments)
    assert all(words(s) > 60 for s in segments[:-1])
    assert split_sentences(sentence * 20, "en", len) != segments  # characters would cut differently


def test_en_needs_a_token_length():
    with pytest.raises(ValueError, match="token_len_fn"):
        split_sentences("hello.", "en")


def test_punctuation_only_segments_are_dropped():
    assert is_punctuation_only("。！？…“”$+") and is_punctuation_only("")
    assert not is_punctuation_only("好。") and not is_punctuation_only(" 。")
    assert split_sentences("。！？", "zh") == []
    assert split_sentences("...", "en", words) == []
    assert split_sentences("   ", "zh") == []


def test_segments_are_stripped():
    segments = split_sentences("a" * 70 + ". " + "b" * 70 + ".  ", "en", len)
    assert segments == ["a" * 70 + ".", "b" * 70 + "."]


def test_text_without_marks_is_cut_into_bounded_sentences_keeping_every_character():
    """Before: 2000 Chinese characters without punctuation were one segment (minutes of speech for one LM
    pass, past what one flow pass takes: 413 after 9.8 s, or a stream cut at the request timeout)."""
    text = "".join(chr(0x4E00 + i % 500) for i in range(2000))
    segments = split_sentences(text, "zh")
    assert len(segments) >= 10 and max(map(len, segments)) <= MAX_SENTENCE_CHARS + 1
    assert "".join(segments) == text + "。"
    words = " ".join(["word"] * 600)
    pieces = cut_long(words)
    assert "".join(pieces) == words and all(len(p) <= MAX_SENTENCE_CHARS for p in pieces)
    assert all(p.endswith(" ") for p in pieces[:-1])  # cut at a space, not inside a word
