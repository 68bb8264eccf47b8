"""Pure formatters: numbers reach the HTML, shapes are right, user text is escaped."""

from __future__ import annotations

import dataclasses
import html
import re
import time

import numpy as np
import pytest

from engine.serving.metrics import RequestMetrics, ServerStats
from webui import views
from webui.texts import Texts

T = Texts("en")


def metric(html: str, key: str) -> str:
    """Text inside the element carrying ``data-metric=key`` (tags stripped)."""
    m = re.search(rf'data-metric="{key}">(.*?)</(?:span|b)>', html)
    assert m, f"no data-metric={key}"
    return re.sub(r"<[^>]+>", " ", m.group(1)).strip()


def test_pcm16_bytes_round_trips_and_clips() -> None:
    pcm = np.array([0.0, 0.5, -0.5, 1.0, -1.0, 3.0, -3.0], dtype=np.float32)
    out = np.frombuffer(views.pcm16_bytes(pcm), dtype="<i2")
    assert out.tolist() == [0, 16384, -16384, 32767, -32767, 32767, -32767]
    assert len(views.pcm16_bytes(np.zeros(5, np.float32))) == 10


def test_metrics_html_shows_each_number() -> None:
    m = RequestMetrics(
        request_id="abcdef0123456789", seed=42, queue_wait_ms=12.4, ttfa_ms=87.6, elapsed_ms=1500.0,
        audio_s=3.0, lm_tokens=75, lm_tokens_per_s=123.45, stage_ms={"lm": 30.0, "flow": 10.0},
    )  # fmt: skip
    html = views.metrics_html(m, T)
    assert metric(html, "ttfa_server").startswith("88")
    assert metric(html, "rtf") == "0.500"
    assert metric(html, "tokens_s") == "123.5"
    assert metric(html, "lm_tokens") == "75"
    assert metric(html, "queue_wait").startswith("12")
    assert metric(html, "audio_s").startswith("3.00")
    assert metric(html, "seed") == "42"
    assert metric(html, "request") == "abcdef01"
    assert 'data-metric="ttfa_browser"' in html  # filled by the browser
    assert 'data-metric="ttfa_lm"' not in html  # no parts in this snapshot: no parts line


def test_metrics_html_shows_the_ttfa_parts_in_order() -> None:
    parts = {"queue": 0.0, "frontend": 4.2, "lm": 120.0, "t2w_wait": 3.0, "t2w_compute": 98.7}
    html = views.metrics_html(RequestMetrics(request_id="r", ttfa_ms=225.9, ttfa_parts_ms=parts), T)
    assert [metric(html, f"ttfa_{k}") for k in parts] == ["0", "4", "120", "3", "99"]
    assert html.index("ttfa_queue") < html.index("ttfa_lm") < html.index("ttfa_t2w_compute")
    assert T("part_lm") in html and T("ttfa_parts") in html


def test_metrics_html_without_a_request_shows_dashes() -> None:
    html = views.metrics_html(None, T)
    assert metric(html, "ttfa_server").startswith("—")
    assert metric(html, "rtf") == "—"
    assert metric(html, "seed") == "—"


def test_stage_bar_widths_are_shares_of_the_total() -> None:
    html = views.stage_bar_html({"lm": 30.0, "flow": 10.0}, T)
    widths = [float(w) for w in re.findall(r"width:([\d.]+)%", html)]
    assert widths == [0.0, 75.0, 25.0, 0.0]  # frontend, lm, flow, hift
    assert metric(html, "stage_lm") == "30"
    assert all(w == 0.0 for w in map(float, re.findall(r"width:([\d.]+)%", views.stage_bar_html({}, T))))


def test_throughput_rates_are_audio_seconds_per_second() -> None:
    samples = [(0.0, 0.0), (1.0, 2.0), (2.0, 2.0), (2.0, 5.0), (4.0, 6.0)]
    assert views.throughput_rates(samples) == [2.0, 0.0, 0.0, 0.5]
    assert views.throughput_rates([(0.0, 1.0)]) == []


def test_sparkline_scales_to_its_maximum() -> None:
    svg = views.sparkline_svg([0.0, 2.0, 1.0], width=100, height=50)
    line = re.search(r'<polyline points="([^"]+)"', svg).group(1)
    pts = [tuple(map(float, p.split(","))) for p in line.split()]
    assert [x for x, _ in pts] == [0.0, 50.0, 100.0]
    assert pts[1][1] == 2.0 and pts[0][1] == 48.0 and pts[2][1] == pytest.approx(25.0)
    assert "<polyline" in views.sparkline_svg([])  # nothing sampled yet: a flat line, no error


def test_server_html_shows_gauges_and_latest_rate() -> None:
    stats = ServerStats(active_streams=3, queued=2, completed=9, device_memory_mb=1536.4, device="cuda:0")
    html = views.server_html(stats, [0.5, 4.25], T)
    assert (metric(html, "active"), metric(html, "queued"), metric(html, "completed")) == ("3", "2", "9")
    assert metric(html, "memory").startswith("1,536") and "cuda:0" in html
    assert metric(html, "throughput") == "4.25" and metric(html, "throughput_peak") == "4.25"
    assert metric(views.server_html(stats, [5.0, 1.0], T), "throughput_peak") == "5.00"


@pytest.mark.parametrize(
    ("text", "lang", "max_len", "expected"),
    [
        ("你好。世界！今天好吗？", "auto", 4, ["你好。", "世界！", "今天好吗？"]),
        ("你好。世界！今天好吗？", "zh", 80, ["你好。世界！今天好吗？"]),
        ("他说：“走吧。”然后走了", "zh", 5, ["他说：“走吧。”", "然后走了"]),
        ("Hi there. How are you? Fine!", "en", 3, ["Hi there.", "How are you?", "Fine!"]),
        ("Hi there. How are you? Fine!", "auto", 5, ["Hi there. How are you?", "Fine!"]),
        ("  ", "auto", 80, []),
        ("no marks at all", "en", 80, ["no marks at all"]),
    ],
)
def test_split_text(text: str, lang: str, max_len: int, expected: list[str]) -> None:
    segments = views.split_text(text, lang, max_len)
    assert segments == expected
    assert "".join(segments).replace(" ", "") == text.replace(" ", "")  # nothing lost


def test_counter_marks_text_over_the_limit() -> None:
    assert "cosy-over" not in views.counter_text("abc", 3, 1, T)
    over = views.counter_text("abcd", 3, 1, T)
    assert "cosy-over" in over and "4 / 3" in over


def test_prompt_status_reports_duration_against_the_range() -> None:
    assert "cosy-good" in views.prompt_status_html(5.0, 16000, 3.0, 30.0, T)
    assert "16000 Hz" in views.prompt_status_html(5.0, 16000, 3.0, 30.0, T)
    assert "too short" in views.prompt_status_html(2.0, 16000, 3.0, 30.0, T)
    assert "too long" in views.prompt_status_html(31.0, 16000, 3.0, 30.0, T)
    assert "cosy-bad" not in views.prompt_status_html(None, 0, 3.0, 30.0, T)


def test_preset_choices_accept_strings_and_dicts() -> None:
    presets = ["请用广东话表达。", {"label": "Fast", "instruct": "请用尽可能快地语速说一句话。"}, "说快点"]
    assert views.preset_choices(presets, Texts("en")) == [
        ("Cantonese (广东话)", "请用广东话表达。"),
        ("Fast", "请用尽可能快地语速说一句话。"),
        ("说快点", "说快点"),  # no reference preset: the instruction is its own label
    ]


def test_every_reference_preset_reads_in_the_page_language_and_sends_the_trained_text() -> None:
    from engine.text.frontend import instruct_presets

    reference = [p.instruct for p in instruct_presets("cosyvoice3")]
    en = views.preset_choices(reference, Texts("en"))
    zh = views.preset_choices(reference, Texts("zh"))
    assert len(reference) == 26 and [v for _, v in en] == [v for _, v in zh] == reference
    assert all(re.match(r"[A-Z][a-z]", label) for label, _ in en), en  # English first on en pages
    assert ("Loud (大声)", "Please say a sentence as loudly as possible.") in en
    assert not [label for label, _ in zh if re.search(r"[A-Za-z]", label)], zh  # no English on zh pages
    assert ("大声", "Please say a sentence as loudly as possible.") in zh


RID_H = "0123456789abcdef0123456789abcdef"


def entry(rid: str, text: str, created_at: float, stopped: bool = False) -> views.HistoryEntry:
    return views.HistoryEntry(
        request_id=rid, created_at=created_at, mode="zero_shot", text=text, language="en", voice="upload",
        speed=1.25, seed=7, stream=True, ttfa_ms=91.0, rtf=0.25, audio_s=2.5, stopped=stopped,
    )  # fmt: skip


def test_history_is_newest_first_escaped_with_downloads() -> None:
    old, new = "a" * 32, "b" * 32
    html = views.history_html([entry(old, "<b>old</b>", 1.0), entry(new, "new", 2.0, True)], T, {})
    table = html[html.index("<table") :]
    assert table.index(new) < table.index(old)
    assert "<b>old</b>" not in html and "&lt;b&gt;old&lt;/b&gt;" in html
    assert f'href="webui/audio/{new}.wav"' in html and f'href="webui/audio/{new}.mp3"' in html
    assert "seed 7" in html and "×1.25" in html and "TTFA 91 ms" in html
    assert html.count("2.5 s · stopped") == 1  # the stopped entry says so, in words
    assert "appear here" in views.history_html([], T, {})


def test_the_history_rides_along_for_the_browser_to_keep() -> None:
    entries = [entry("a" * 32, 'say "<hi>" & go', 1.0), entry("b" * 32, "你好", 2.0, True)]
    html_text = views.history_html(entries, T, {})
    kept = re.search(r'data-kept-history="([^"]*)"', html_text)
    assert kept is not None and views.history_from_json(html.unescape(kept.group(1))) == entries
    assert 'data-kept-history="[]"' in views.history_html([], T, {})
    failed = dataclasses.replace(entries[0], failed=True, stopped=True)
    assert "2.5 s · failed" in views.history_html([failed], T, {})  # failed, not merely stopped


def test_downloads_are_named_by_date_voice_and_first_words() -> None:
    when = time.mktime((2026, 12, 4, 15, 32, 0, 0, 0, -1))
    assert views.download_stem(when, "Alice Bob", "Hello <strong>Bob</strong>, [breath] how are you?") == (
        "2026-12-04_1532_Alice-Bob_Hello-Bob-how-are-you"
    )
    assert views.download_stem(when, "zh-lan", "收到好友从远方寄来的生日礼物，那份意外") == (
        "2026-12-04_1532_zh-lan_收到好友从远方寄来的生日礼物-那"
    )
    page = views.history_html([entry("c" * 32, "A take / with: odd chars?", when)], T, {})
    assert 'download="2026-12-04_1532_upload_A-take-with-odd-chars.wav"' in page
    assert 'download="2026-12-04_1532_upload_A-take-with-odd-chars.mp3"' in page


def test_header_banner_only_when_asked() -> None:
    plain = views.header_html(T, {"model": "m<1>"})
    assert "cosy-banner" not in plain and "m&lt;1&gt;" in plain
    assert "RANDOM" in views.header_html(T, {}, T("banner_random"))


def test_a_chinese_history_row_names_everything_in_chinese() -> None:
    """Language names, voice, stream / whole file, seed and TTFA words in Chinese (units and formats stay)."""
    row = views.history_html([entry(RID_H, "你好", 0.0)], Texts("zh"), {"zero_shot": "零样本克隆"})
    words = set(re.findall(r"[A-Za-z][A-Za-z0-9]*", re.sub(r"<[^>]+>", " ", row)))
    assert words <= {"English", "RTF", "ms", "s", "wav", "mp3"}, words  # English: its own name, as 日本語
    assert "English (英语)" in row and "上传" in row and "种子 7" in row and "流式" in row
    header = views.header_html(Texts("zh"), {"model": "Fun-CosyVoice3-0.5B", "family": "cosyvoice3"})
    assert "模型" in header and "系列" in header and "model" not in re.sub(r"<[^>]+>", " ", header)
