"""Pure formatters: metrics, server gauges and history -> HTML; PCM -> bytes; text -> split preview.

Nothing here touches Gradio or the engine's state: every function maps plain values to plain values, so the
look of the studio is unit-testable. CSS classes (``cosy-*``) are styled in ``webui/static/studio.css``;
``data-metric`` attributes name the numbers the browser test reads.
"""

from __future__ import annotations

import dataclasses
import html
import itertools
import json
import re
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.serving.metrics import STAGES, RequestMetrics, ServerStats
from engine.text.frontend import instruct_presets
from webui.texts import Texts, language_name

# A sentence: the shortest run of text ending in a run of terminal marks (plus a closing quote) or at the end.
SENTENCE = re.compile(r"\S.*?(?:[。！？；!?;.]+[”\"]?|$)", re.S)
CJK = re.compile(r"[\u3040-\u30ff\u3400-\u9fff\uac00-\ud7af]")


@dataclass(frozen=True)
class HistoryEntry:
    """One finished (or stopped) generation of this session, with the settings that produced it."""

    request_id: str
    created_at: float
    mode: str
    text: str
    language: str
    voice: str
    speed: float
    seed: int
    stream: bool
    ttfa_ms: float | None
    rtf: float | None
    audio_s: float
    stopped: bool = False
    failed: bool = False  # ended by a failure, with the audio made before it


def history_from_json(kept: Any) -> list[HistoryEntry]:
    """History entries from what a browser kept (a JSON text or its parsed list of objects, oldest
    first); an item that is not an entry (unknown or missing fields, wrong types, a request id that is no
    32-hex id) is dropped, never guessed at."""
    if isinstance(kept, str):
        try:
            kept = json.loads(kept) if kept.strip() else []
        except ValueError:
            return []
    if not isinstance(kept, list):
        return []
    return [entry for item in kept if (entry := _entry(item)) is not None]


def _entry(item: Any) -> HistoryEntry | None:
    if not isinstance(item, dict) or set(item) - _ENTRY_TYPES.keys():
        return None
    try:
        entry = HistoryEntry(**item)
    except TypeError:  # a required field is missing
        return None
    for name, kinds in _ENTRY_TYPES.items():
        value = getattr(entry, name)
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            return None
    return entry if RID_TEXT.match(entry.request_id) else None


def history_to_json(entries: Sequence[HistoryEntry]) -> str:
    """The entries as the browser keeps them (``history_from_json`` reads them back)."""
    return json.dumps([dataclasses.asdict(e) for e in entries], ensure_ascii=False)


_NUM = (int, float)
_ENTRY_TYPES: dict[str, tuple[type, ...]] = {
    "request_id": (str,), "created_at": _NUM, "mode": (str,), "text": (str,), "language": (str,),
    "voice": (str,), "speed": _NUM, "seed": (int,), "stream": (bool,), "ttfa_ms": (*_NUM, type(None)),
    "rtf": (*_NUM, type(None)), "audio_s": _NUM, "stopped": (bool,), "failed": (bool,),
}  # fmt: skip
RID_TEXT = re.compile(r"^[0-9a-f]{32}$")


def fmt_ms(value: float | None) -> str:
    return "—" if value is None else f"{value:,.0f}"


def fmt_num(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def pcm16_bytes(pcm: np.ndarray) -> bytes:
    """float32 [-1, 1] mono -> little-endian int16 bytes (the live player's wire format)."""
    scaled = np.clip(np.asarray(pcm, dtype=np.float32), -1.0, 1.0) * 32767.0
    return np.round(scaled).astype("<i2").tobytes()


def _tile(key: str, label: str, value: str, unit: str = "", hero: bool = False) -> str:
    cls = "cosy-tile cosy-hero" if hero else "cosy-tile"
    unit_html = f"<small>{unit}</small>" if unit else ""
    return (
        f'<div class="{cls}"><span class="cosy-k">{html.escape(label)}</span>'
        f'<span class="cosy-v" data-metric="{key}">{value}{unit_html}</span></div>'
    )


def stage_bar_html(stage_ms: dict[str, float], t: Texts) -> str:
    """A stacked bar of per-stage compute time; widths are shares of the stage total."""
    total = sum(stage_ms.get(s, 0.0) for s in STAGES)
    parts, legend = [], []
    for i, stage in enumerate(STAGES):
        ms = stage_ms.get(stage, 0.0)
        share = 100.0 * ms / total if total > 0 else 0.0
        parts.append(f'<span class="cosy-seg cosy-s{i}" style="width:{share:.1f}%"></span>')
        legend.append(
            f'<span class="cosy-leg"><i class="cosy-s{i}"></i>{html.escape(t("stage_" + stage))} '
            f'<b data-metric="stage_{stage}">{fmt_ms(ms)}</b></span>'
        )
    return (
        f'<div class="cosy-stages"><div class="cosy-k">{html.escape(t("stages"))}</div>'
        f'<div class="cosy-bar">{"".join(parts)}</div><div class="cosy-legend">{"".join(legend)}</div></div>'
    )


def ttfa_parts_html(parts: dict[str, float], t: Texts) -> str:
    """The server TTFA as its parts in order (queue, text + prompt, LM, vocoder queue, flow + HiFT)."""
    if not parts:
        return ""
    items = " + ".join(
        f'{html.escape(t("part_" + name))} <b data-metric="ttfa_{name}">{fmt_ms(ms)}</b>'
        for name, ms in parts.items()
    )
    return f'<div class="cosy-parts"><span class="cosy-k">{html.escape(t("ttfa_parts"))}</span> {items}</div>'


def metrics_html(m: RequestMetrics | None, t: Texts) -> str:
    """The per-request metrics card; the browser TTFA tile is filled client-side (CSS variable)."""
    m = m or RequestMetrics()
    seed = str(m.seed) if m.request_id else "—"
    tiles = [
        _tile("ttfa_server", t("ttfa_server"), fmt_ms(m.ttfa_ms), "ms", hero=True),
        '<div class="cosy-tile cosy-hero"><span class="cosy-k">'
        f'{html.escape(t("ttfa_browser"))}</span><span class="cosy-v cosy-bttfa" data-metric="ttfa_browser">'
        "</span></div>",
        _tile("rtf", t("rtf"), fmt_num(m.rtf, 3)),
        _tile("tokens_s", t("tokens_s"), fmt_num(m.lm_tokens_per_s, 1)),
        _tile("lm_tokens", t("lm_tokens"), str(m.lm_tokens)),
        _tile("queue_wait", t("queue_wait"), fmt_ms(m.queue_wait_ms), "ms"),
        _tile("audio_s", t("audio_len"), fmt_num(m.audio_s), "s"),
        _tile("elapsed", t("elapsed"), fmt_ms(m.elapsed_ms), "ms"),
        _tile("seed", t("seed_used"), seed),
        _tile("request", t("request_id"), html.escape(m.request_id[:8]) or "—"),
    ]
    return (
        f'<div class="cosy-metrics"><div class="cosy-tiles">{"".join(tiles)}</div>'
        f"{stage_bar_html(m.stage_ms, t)}{ttfa_parts_html(m.ttfa_parts_ms, t)}</div>"
    )


def throughput_rates(samples: Sequence[tuple[float, float]]) -> list[float]:
    """(time s, cumulative audio s) samples -> audio seconds produced per wall second between samples."""
    rates = []
    for (t0, a0), (t1, a1) in itertools.pairwise(samples):
        rates.append(max(0.0, (a1 - a0) / (t1 - t0)) if t1 > t0 else 0.0)
    return rates


def sparkline_svg(values: Sequence[float], width: int = 260, height: int = 56) -> str:
    """A filled line plot of ``values`` (oldest first) scaled to its own maximum; flat when all zero."""
    if len(values) < 2:
        values = [0.0, 0.0]
    top = max(max(values), 1e-9)
    step = width / (len(values) - 1)
    pts = [f"{i * step:.1f},{height - 2 - (height - 4) * v / top:.1f}" for i, v in enumerate(values)]
    line = " ".join(pts)
    area = f"0,{height} {line} {width},{height}"
    return (
        f'<svg class="cosy-spark" viewBox="0 0 {width} {height}" preserveAspectRatio="none" '
        f'width="100%" height="{height}"><polygon points="{area}" class="cosy-spark-fill"/>'
        f'<polyline points="{line}" class="cosy-spark-line"/></svg>'
    )


def server_html(stats: ServerStats, rates: Sequence[float], t: Texts, warming: bool = False) -> str:
    """The server panel: live gauges plus the throughput sparkline; ``warming``: start-up work is still
    running beside the requests (``/ready``'s stage): the first audio may be slower, and the panel says so."""
    now, peak = (rates[-1], max(rates)) if rates else (0.0, 0.0)
    tiles = [
        _tile("active", t("active"), str(stats.active_streams)),
        _tile("queued", t("queued"), str(stats.queued)),
        _tile("completed", t("completed"), str(stats.completed)),
        _tile("memory", t("memory"), f"{stats.device_memory_mb:,.0f}", f"MB · {html.escape(stats.device)}"),
    ]
    note = f'<div class="cosy-warming" role="status">{html.escape(t("warming"))}</div>' if warming else ""
    return (
        f'<div class="cosy-server">{note}<div class="cosy-tiles cosy-tiles4">{"".join(tiles)}</div>'
        f'<div class="cosy-k">{html.escape(t("throughput"))} <b data-metric="throughput">{now:.2f}</b>'
        f' · {html.escape(t("peak"))} <b data-metric="throughput_peak">{peak:.2f}</b></div>'
        f"{sparkline_svg(list(rates))}</div>"
    )


def split_text(text: str, language: str = "auto", max_len: int = 80) -> list[str]:
    """Preview of how the engine will cut ``text``: sentences merged up to ``max_len`` units.

    Units are characters for CJK text and words for English (a stand-in for the engine's splitter, which
    counts text tokens; see engine.text.split).
    """
    spaced = language == "en" or (language == "auto" and not CJK.search(text))

    def length(s: str) -> int:
        return len(s.split()) if spaced else len(s.strip())

    joiner = " " if spaced else ""
    segments: list[str] = []
    for sentence in SENTENCE.findall(text.strip()):
        if segments and length(segments[-1] + joiner + sentence) <= max_len:
            segments[-1] += joiner + sentence
        else:
            segments.append(sentence)
    return [s.strip() for s in segments if s.strip()]


def download_stem(created_at: float, voice: str, text: str, words: int = 6) -> str:
    """A file name for people, without its extension: local date and time, the voice, the first words
    ("2026-12-04_1532_Alice-Bob_Hello-Bob-how-are-you-today"); letters of any script are kept, every run
    of anything else is one "-" (nothing a file system or a URL chokes on)."""

    def slug(s: str, limit: int) -> str:
        return re.sub(r"[\W_]+", "-", s).strip("-")[:limit].strip("-")

    text = re.sub(r"<[^<>]*>|\[[^\[\]]*\]", " ", text)  # the script's tags and pauses are no words
    first = " ".join(text.split()[:words]) if not CJK.search(text) else text.strip()[:16]
    parts = [time.strftime("%Y-%m-%d_%H%M", time.localtime(created_at)), slug(voice, 40), slug(first, 48)]
    return "_".join(p for p in parts if p)


def counter_text(text: str, limit: int, segments: int, t: Texts) -> str:
    """The characters Generate will count (the text without its outer blanks, as ``Studio.check_text``
    gets it: a trailing newline once made the counter say 2200 where the error said 2199)."""
    chars = len(text.strip())
    over = " cosy-over" if chars > limit else ""
    label = html.escape(t("counter", chars=chars, limit=limit, segments=segments))
    return f'<div class="cosy-counter{over}" data-metric="chars">{label}</div>'


def split_preview_html(segments: Sequence[str]) -> str:
    items = "".join(f"<li>{html.escape(s)}</li>" for s in segments)
    return f'<ol class="cosy-split">{items}</ol>'


def note_html(text: str, kind: str = "") -> str:
    """A one-line note; ``kind`` is "", "good" or "bad" (colour)."""
    cls = f"cosy-note cosy-{kind}" if kind else "cosy-note"
    return f'<div class="{cls}">{html.escape(text)}</div>'


def for_modes(modes: Sequence[str]) -> list[str]:
    """The classes that show an element only while one of ``modes`` is picked (``layout.mode_css``)."""
    return ["cosy-for", *(f"cosy-for-{m}" for m in modes)]


def mode_help_html(modes: Sequence[str], t: Texts) -> str:
    """Every mode's help line; the page shows the picked mode's."""
    return "".join(
        f'<div class="cosy-note {" ".join(for_modes([m]))}">{html.escape(t(f"mode_help_{m}"))}</div>'
        for m in modes
    )


def prompt_status_html(seconds: float | None, rate: int, min_s: float, max_s: float, t: Texts) -> str:
    """One line under the prompt audio: its duration and whether it is inside [min_s, max_s]."""
    if seconds is None:
        return note_html(t("prompt_none"))
    if seconds < min_s:
        return note_html(t("prompt_short", seconds=seconds, min_s=min_s), "bad")
    if seconds > max_s:
        return note_html(t("prompt_long", seconds=seconds, max_s=max_s), "bad")
    return note_html(t("prompt_ok", seconds=seconds, rate=rate), "good")


def voice_choices(voices: Sequence[Any], t: Texts) -> list[tuple[str, str]]:
    """Dropdown (label, id) pairs: public and example voices are marked, and a label shown twice gets the
    voice's id, so two voices with one name stay apart."""
    labels = []
    for v in voices:
        scope = "voice_example" if getattr(v, "example", False) else "voice_public"
        public = getattr(v, "public", False)
        labels.append(f"{v.name} · {t(scope)}" if public else str(v.name))
    counts = Counter(labels)
    return [
        (f"{label} ({v.id})" if counts[label] > 1 else label, str(v.id))
        for label, v in zip(labels, voices, strict=True)
    ]


def preset_choices(presets: Sequence[object], t: Texts | None = None) -> list[tuple[str, str]]:
    """Engine presets (plain strings, or dicts with ``label``/``instruct``) -> dropdown (label, value).

    The value is always the instruction the model was trained on; the label is in ``t``'s language: a
    reference preset's English label ("Cantonese (广东话)") on an English page, its Chinese name ("广东话")
    on a Chinese one; an instruction of no preset labels itself."""
    known = {p.instruct: p.label for p in instruct_presets("cosyvoice3")}  # the labels are family-free
    choices = []
    for p in presets:
        instruct = str(p["instruct"]) if isinstance(p, dict) else str(p)
        label = str(p.get("label", instruct)) if isinstance(p, dict) else known.get(instruct, instruct)
        choices.append((_in_language(label, t) if label != instruct else label, instruct))
    return choices


def _in_language(label: str, t: Texts | None) -> str:
    """A label "English (中文)": whole on an English page, the part in brackets on a Chinese one."""
    native = re.fullmatch(r".*\((.+)\)", label)
    return native.group(1) if t is not None and t.lang == "zh" and native else label


def history_html(entries: Sequence[HistoryEntry], t: Texts, mode_label: dict[str, str]) -> str:
    """Newest-first table of this visitor's generations with links to wav and mp3 downloads. The entries
    ride along as JSON (``data-kept-history``): the browser keeps them for the next visit (``keep.js``)."""
    kept = f'<div class="cosy-history-box" data-kept-history="{html.escape(history_to_json(entries))}">'
    if not entries:
        return kept + note_html(t("history_empty")) + "</div>"
    head = "".join(f"<th>{html.escape(t(k))}</th>" for k in ("h_time", "h_mode", "h_text", "h_settings"))
    head += f"<th>{html.escape(t('h_metrics'))}</th><th>{html.escape(t('h_files'))}</th>"
    rows = [_history_row(e, mode_label, t) for e in reversed(entries)]
    body = f"<thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody>"
    return f'{kept}<table class="cosy-history">{body}</table></div>'


def _history_row(e: HistoryEntry, mode_label: dict[str, str], t: Texts) -> str:
    text = e.text if len(e.text) <= 48 else e.text[:47] + "…"
    stream = t("h_stream") if e.stream else t("h_offline")
    voice = t("h_upload") if e.voice == "upload" else e.voice
    language = language_name(e.language, t)
    settings = f"{language} · {voice} · ×{e.speed:g} · {t('h_seed')} {e.seed} · {stream}"
    # a word, not a symbol: "⏹" is missing from common fonts and rendered as an empty box
    flag = f" · {t('h_failed')}" if e.failed else f" · {t('live_stopped')}" if e.stopped else ""
    metrics = f"{t('h_ttfa')} {fmt_ms(e.ttfa_ms)} ms · RTF {fmt_num(e.rtf, 3)} · {e.audio_s:.1f} s{flag}"
    base, name = f"webui/audio/{e.request_id}", html.escape(download_stem(e.created_at, voice, e.text))
    # the browser saves the file under a name for people (date, voice, first words), not the request id
    links = " · ".join(f'<a href="{base}.{x}" download="{name}.{x}">{x}</a>' for x in ("wav", "mp3"))
    cells = (
        time.strftime("%H:%M:%S", time.localtime(e.created_at)),
        html.escape(mode_label.get(e.mode, e.mode)),
        f'<span title="{html.escape(e.text)}">{html.escape(text)}</span>',
        html.escape(settings),
        html.escape(metrics),
        links,
    )
    return "<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>"


def header_html(t: Texts, chips: dict[str, str], banner: str | None = None) -> str:
    """Title, subtitle with the way into the prompt lab (its own page, in the same language), model facts as
    chips (e.g. model, family, rate) and an optional warning banner."""
    chip_html = "".join(
        f'<span class="cosy-chip">{html.escape(t("chip_" + k))} <b>{html.escape(v)}</b></span>'
        for k, v in chips.items()
    )
    top = (
        f'<div class="cosy-header" data-lang="{t.lang}" data-error-title="{html.escape(t("err_title"))}">'
        f'<div><h1 class="cosy-title">{html.escape(t("title"))}</h1>'
        f'<div class="cosy-sub">{html.escape(t("subtitle"))} · <a class="cosy-lab-link" '
        f'href="/lab?lang={t.lang}">{html.escape(t("lab_link"))}</a></div></div>'
        f'<div class="cosy-chips">{chip_html}</div></div>'
    )
    return top + (f'<div class="cosy-banner">⚠ {html.escape(banner)}</div>' if banner else "")
