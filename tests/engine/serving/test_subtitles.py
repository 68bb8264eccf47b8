"""engine/serving/subtitles.py: word timings (spread and ASR-aligned) and SRT / WebVTT output."""

from __future__ import annotations

import re

import numpy as np
import pytest

from engine.serving.subtitles import (
    Turn,
    Word,
    align,
    align_words,
    cues,
    spread,
    spread_words,
    to_srt,
    to_vtt,
    voiced_span,
    words_of,
)

RATE = 24000
SRT_TIME = r"\d{2}:\d{2}:\d{2},\d{3}"
VTT_TIME = r"\d{2}:\d{2}:\d{2}\.\d{3}"


def tone(seconds: float, lead_s: float = 0.0, tail_s: float = 0.0) -> np.ndarray:
    t = np.arange(int(seconds * RATE)) / RATE
    voiced = (0.5 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    return np.concatenate(
        [np.zeros(int(lead_s * RATE), np.float32), voiced, np.zeros(int(tail_s * RATE), np.float32)]
    )


def test_words_drop_tags_and_split_chinese_characters():
    assert words_of("Hi [breath] <strong>you</strong> there!") == ["Hi", "you", "there!"]
    assert words_of("你好，世界 ok") == ["你", "好，", "世", "界", "ok"]  # the comma ends its word


def test_spread_covers_the_voiced_stretch_only_by_letters():
    pcm = tone(2.0, lead_s=0.5, tail_s=0.5)
    assert voiced_span(pcm, RATE) == pytest.approx((0.5, 2.5), abs=1e-3)
    words = spread_words("aaa b aaa", pcm, RATE, offset_s=10.0)
    assert [w.text for w in words] == ["aaa", "b", "aaa"]
    assert words[0].start_s == pytest.approx(10.5, abs=1e-3) and words[-1].end_s == pytest.approx(
        12.5, abs=1e-3
    )
    # 4 + 2 + 4 weight units over 2 s
    assert words[1].end_s - words[1].start_s == pytest.approx(0.4, abs=1e-3)


def test_align_takes_matched_times_and_spreads_the_rest_between_them():
    heard = [Word("hello", 0.1, 0.3), Word("wold", 0.5, 0.7), Word("HOW", 0.9, 1.0)]
    words = align(["Hello,", "there", "world.", "How"], heard, 0.0, 1.2)
    assert [w.text for w in words] == ["Hello,", "there", "world.", "How"]
    assert (words[0].start_s, words[0].end_s) == (0.1, 0.3) and (words[3].start_s, words[3].end_s) == (
        0.9,
        1.0,
    )
    assert (
        words[1].start_s == 0.3
        and words[2].end_s == pytest.approx(0.9)
        and words[1].end_s == words[2].start_s
    )


class Timer:
    def __init__(self, heard):
        self.heard, self.calls = heard, 0

    def words(self, pcm, sample_rate, language):
        self.calls += 1
        return self.heard


def test_align_words_uses_the_timer_and_falls_back_when_nothing_matches():
    pcm = tone(1.0)
    timed = align_words("good day", pcm, RATE, Timer([Word("good", 0.2, 0.4), Word("day", 0.5, 0.9)]), 2.0)
    assert [(w.start_s, w.end_s) for w in timed] == [(2.2, 2.4), (2.5, 2.9)]
    noise = Timer([Word("zzz", 0.0, 1.0)])
    assert (
        align_words("good day", pcm, RATE, noise) == spread_words("good day", pcm, RATE) and noise.calls == 1
    )


def test_srt_and_vtt_are_well_formed():
    words = spread_words(
        "One two three. Four five six seven eight nine ten eleven twelve.", tone(6.0), RATE, 3600.0
    )
    srt, vtt = to_srt(words), to_vtt(words)
    blocks = srt.strip().split("\n\n")
    assert len(blocks) == 2  # a cue a sentence
    previous_end = 0.0
    for i, block in enumerate(blocks, 1):
        number, times, text = block.split("\n")
        assert number == str(i) and re.fullmatch(f"{SRT_TIME} --> {SRT_TIME}", times) and text
        start, end = (_seconds(t.replace(",", ".")) for t in times.split(" --> "))
        assert previous_end <= start < end
        previous_end = end
    assert blocks[0].split("\n")[1].startswith("01:00:00,000")
    head, *vtt_cues = vtt.strip().split("\n\n")
    assert head == "WEBVTT" and len(vtt_cues) == 2
    for cue in vtt_cues:
        times, text = cue.split("\n")
        assert re.fullmatch(f"{VTT_TIME} --> {VTT_TIME}", times)
        inline = re.findall(r"<(\S+)>", text)
        assert len(inline) == len(text.split()) - 1 and all(re.fullmatch(VTT_TIME, t) for t in inline)
    assert re.sub(r"<\S+>", "", vtt_cues[0].split("\n")[1]) == "One two three."


def _seconds(clock: str) -> float:
    h, m, s = clock.split(":")
    return int(h) * 3600 + int(m) * 60 + float(s)


LONG = (
    "The studio keeps the visitor's work through a reload, a restart and a failure, on a phone and by "
    "keyboard, and it says so plainly. Hi. It works."
)


def test_cues_end_at_sentences_or_clauses_and_leave_no_short_tail():
    words = spread(words_of(LONG), 0.0, 12.0)
    out = cues(words)
    assert " ".join(c.text for c in out) == " ".join(words_of(LONG))  # every word once, in order
    for cue in out:
        assert cue.text[-1] in ".,;:!?", cue.text  # never mid-clause
        assert len(cue.text) <= 84 and cue.end_s - cue.start_s <= 7.0
        assert cue.end_s - cue.start_s >= 1.0, cue  # no 0.37 s tail of a sentence
    assert out[-1].text == "Hi. It works."  # a very short sentence shares the next one's cue


def test_a_clause_too_long_for_one_cue_is_cut_in_halves_of_like_length():
    text = " ".join(f"word{i}" for i in range(30))  # no punctuation at all: 209 characters
    out = cues(spread(words_of(text), 0.0, 9.0))
    lengths = [c.end_s - c.start_s for c in out]
    assert len(out) >= 3 and all(len(c.text) <= 84 for c in out)
    assert min(lengths) > 0.6 * max(lengths)  # balanced, not 10 words then a stub


def test_chinese_cues_end_at_its_own_marks():
    text = (
        "收到好友从远方寄来的生日礼物，那份意外的惊喜与深深的祝福让我心中充满了甜蜜的快乐。"
        "今天天气很好，我们去散步吧。"
    )
    out = cues(spread(words_of(text), 0.0, 14.0))
    assert [c.text for c in out] == [  # 40 characters: cut at its comma; 14: whole
        "收到好友从远方寄来的生日礼物，",
        "那份意外的惊喜与深深的祝福让我心中充满了甜蜜的快乐。",
        "今天天气很好，我们去散步吧。",
    ]


def test_speakers_are_named_in_srt_and_vtt_and_a_cue_never_spans_two():
    words = spread(words_of("Hello Bob, how are you? I am fine. Thanks!"), 0.0, 4.0)
    turns = [Turn("Alice", tuple(words[:5])), Turn("Bob <2>", tuple(words[5:]))]
    srt, vtt = to_srt(turns), to_vtt(turns)
    lines = [b.split("\n")[2] for b in srt.strip().split("\n\n")]
    assert lines == ["Alice: Hello Bob, how are you?", "Bob <2>: I am fine. Thanks!"]
    texts = [c.split("\n")[1] for c in vtt.strip().split("\n\n")[1:]]
    assert texts[0].startswith("<v Alice>Hello <") and texts[1].startswith("<v Bob &lt;2&gt;>I ")
    assert re.sub(r"<[^>]+>", "", texts[1]) == "I am fine. Thanks!"
    assert "Alice" not in to_srt(words)  # plain words: nobody named
