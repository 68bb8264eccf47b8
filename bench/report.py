"""Bench results -> results.json, results.md (tables), results.png (TTFA and RTF vs concurrency) and, for
open-loop runs, results_open.png (TTFA, underruns and active streams vs the arrival rate).

Everything here works on the JSON form (``{"meta": {...}, "levels": [...]}``), so a saved run can be
re-rendered anywhere: ``python -m bench.report DIR/results.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

Result = dict[str, Any]
COLUMNS = (
    "streams", "requests", "failed", "TTFA p50 ms", "TTFA p95 ms", "TTFA p99 ms", "RTF p50", "RTF p95",
    "RTF p99", "queue p95 ms", "underrun streams", "underrun s", "audio s/s", "peak dev MiB",
)  # fmt: skip


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _row(level: Result) -> list[str]:
    t, r, q = level["ttfa_ms"], level["rtf"], level["queue_wait_ms"]
    return [
        str(level["concurrency"]), str(level["requests"]), str(level["failed"]),
        _num(t["p50"], 0), _num(t["p95"], 0), _num(t["p99"], 0),
        _num(r["p50"], 3), _num(r["p95"], 3), _num(r["p99"], 3),
        _num(q["p95"], 0), f"{level['underrun_requests']}/{level['requests'] - level['failed']}",
        _num(level["underrun_s"], 2), _num(level["audio_s_per_s"], 2),
        _num(level["peak_device_memory_mb"], 0),
    ]  # fmt: skip


OPEN_COLUMNS = (
    "rate /s", "seed", "requests", "failed", "active mean", "active max", "TTFA p50 ms", "TTFA p95 ms",
    "TTFA p99 ms", "RTF p50", "queue p95 ms", "underrun streams", "underrun s", "audio s/s",
    "TTFA p50/p95 ms per window", "active mean per window",
)  # fmt: skip


def is_open(levels: list[Result]) -> bool:
    """Open-loop levels (bench.open_loop) carry their arrival rate."""
    return any(lv.get("rate") is not None for lv in levels)


def _open_row(level: Result) -> list[str]:
    t, r, q = level["ttfa_ms"], level["rtf"], level["queue_wait_ms"]
    windows = level.get("windows") or []  # absent in results before the windows
    seed = level.get("seed")
    return [
        _num(level["rate"], 2), "-" if seed is None else str(seed), str(level["requests"]),
        str(level["failed"]), _num(level["active_mean"], 1), str(level["active_max"]),
        _num(t["p50"], 0), _num(t["p95"], 0), _num(t["p99"], 0), _num(r["p50"], 3), _num(q["p95"], 0),
        f"{level['underrun_requests']}/{level['requests'] - level['failed']}",
        _num(level["underrun_s"], 2), _num(level["audio_s_per_s"], 2),
        " · ".join(f"{_num(w['ttfa_p50_ms'], 0)}/{_num(w['ttfa_p95_ms'], 0)}" for w in windows) or "-",
        " · ".join(_num(w["active_mean"], 1) for w in windows) or "-",
    ]  # fmt: skip


def table(header: Sequence[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def groups(result: Result) -> dict[tuple[str, str], list[Result]]:
    """Levels by (system, mode), in run order, each sorted by concurrency."""
    out: dict[tuple[str, str], list[Result]] = {}
    for level in result["levels"]:
        out.setdefault((level["system"], level["mode"]), []).append(level)
    return {k: sorted(v, key=_order) for k, v in out.items()}


def _order(level: Result) -> tuple[float, int]:
    """Closed loop by concurrency, open loop by rate, then arrival seed."""
    rate = level.get("rate")
    return float(level["concurrency"] if rate is None else rate), level.get("seed") or 0


def realtime_streams(levels: list[Result]) -> int:
    """The largest concurrency whose streams all finished with no underrun (0: none did)."""
    held = [lv["concurrency"] for lv in levels if lv["failed"] == 0 and lv["underrun_requests"] == 0]
    return max(held, default=0)


TTFA_COLUMNS = ("streams", "queue", "frontend", "LM to first chunk", "token2wav wait", "flow + HiFT", "sum")


def ttfa_part_rows(levels: list[Result]) -> list[list[str]]:
    """Per level, the mean TTFA parts (queue, frontend, lm, t2w_wait, t2w_compute) and their sum."""
    rows = []
    for lv in levels:
        parts = lv.get("ttfa_parts_ms_mean") or {}
        if parts:
            values = list(parts.values())
            label = str(lv["concurrency"]) if lv.get("rate") is None else _open_label(lv)
            rows.append([label, *(_num(v, 0) for v in values), _num(sum(values), 0)])
    return rows


def _open_label(level: Result) -> str:
    seed = level.get("seed")
    return _num(level["rate"], 2) + ("" if seed is None else f" (seed {seed})")


def ratio_rows(result: Result) -> list[list[str]]:
    """Per mode and concurrency, how many times better cosystream is: baseline / cosystream for TTFA p50,
    TTFA p95 and RTF p50; cosystream / baseline for audio seconds per second. Below 1x: worse."""
    by = groups(result)
    rows = []
    for (system, mode), base in by.items():
        if system != "baseline":
            continue
        ours = {lv["concurrency"]: lv for lv in by.get(("cosystream", mode), [])}
        for b in base:
            if (o := ours.get(b["concurrency"])) is not None:
                rows.append([mode, str(b["concurrency"]), *_ratios(b, o)])
    return rows


def _ratios(base: Result, ours: Result) -> list[str]:
    def div(a: float | None, b: float | None) -> str:
        return "-" if a is None or not b else f"{a / b:.1f}x"

    return [
        div(base["ttfa_ms"]["p50"], ours["ttfa_ms"]["p50"]),
        div(base["ttfa_ms"]["p95"], ours["ttfa_ms"]["p95"]),
        div(base["rtf"]["p50"], ours["rtf"]["p50"]),
        div(ours["audio_s_per_s"], base["audio_s_per_s"]),
    ]


def capacity_lines(found: dict[str, Any]) -> list[str]:
    """The capacity search's verdicts (``bench.open_loop.capacity``), one line per mode."""
    lines = []
    for mode, rec in sorted(found.items()):
        rate = rec["capacity_rate"]
        tried = ", ".join(
            f"{r['rate']:g} {'met' if r['met'] else 'missed (' + '; '.join(r['misses']) + ')'}{_seeds(r)}"
            for r in rec["rates"]
        )
        held = "none of the rates tried" if rate is None else f"**{rate:g} requests/s**"
        lines.append(
            f"- capacity ({mode}; 0 failed, 0 underrun, TTFA p95 <= {rec['slo_ttfa_p95_ms']:.0f} ms): "
            f"{held}; rates tried: {tried}"
        )
    return lines


def _seeds(row: Result) -> str:
    """A rate's TTFA p95 per arrival seed, e.g. `` [p95 212 ms seed 0, 240 ms seed 1]``."""
    seeds = row.get("seeds") or []  # absent in results before the seeds
    if not seeds:
        return ""
    return " [p95 " + ", ".join(f"{_num(s['ttfa_p95_ms'], 0)} ms seed {s['seed']}" for s in seeds) + "]"


def overload_lines(found: dict[str, Any]) -> list[str]:
    """The overload phase's runs (``python -m bench --overload``): one line each."""
    lines = []
    for run in found.get("runs", []):
        p95 = run["ttfa_p95_ms"]
        lines.append(
            f"- overload ({run['mode']}, {run['rate']:g} requests/s = {found['factor']:g} x "
            f"{run['rate'] / found['factor']:g}, the best arm's capacity or the lowest rate tried), "
            f"{run['system']}: {run['admitted']} of {run['requests']} admitted ({run['refused']} refused, "
            f"{run['failed_not_refused']} failed), {run['underrun_streams']} admitted streams underran, "
            f"TTFA p95 {'-' if p95 is None else format(p95, '.0f')} ms"
        )
    return lines


def markdown(result: Result) -> str:
    meta = result["meta"]
    parts = [
        f"# Bench: {meta['model']}",
        f"- hardware: {meta['hardware']}; device {meta['device']}; LM backend {meta['backend']}",
        f"- {meta['tokens']} speech tokens per request ({meta['tokens'] / 25:.1f} s of audio); "
        f"command: `{meta['command']}`",
    ]
    if meta.get("device_peak_mb_load"):  # absent over HTTP, 0 on CPU
        parts.append(
            f"- device memory peak (torch, MiB): loading {meta['device_peak_mb_load']:.0f}, warm-up "
            f"{meta['device_peak_mb_warmup']:.0f}; each level's own peak is in its row"
        )
    if meta.get("arrivals") == "poisson":
        spread = meta["length_spread"]
        parts.append(
            f"- open loop: Poisson arrivals; lengths uniform in [{meta['tokens'] * (1 - spread):.0f}, "
            f"{meta['tokens'] * (1 + spread):.0f}] speech tokens; active streams = requests sent and not "
            "yet fully received (time-weighted mean, max)"
        )
    if run := meta.get("open_loop"):
        warm, seeds = run["warmup"], ", ".join(map(str, run["seeds"]))
        parts.append(
            f"- each rate: {run['arrival_s']:g} s of arrivals per seed (seeds {seeds}; a rate is met only "
            f"when every seed meets the SLO), TTFA and active streams per {run['window_s']:g} s of arrivals "
            f"(a steady state shows flat windows); warm-up before measuring: {warm['arrival_s']:g} s of "
            f"arrivals at {warm['rate']:g} requests/s"
            + ("; the A/B's first arm alternates per rate and seed" if run.get("ab") else "")
        )
    parts += capacity_lines(meta.get("capacity", {}))
    parts += overload_lines(meta.get("overload", {}))
    for (system, mode), levels in groups(result).items():
        if is_open(levels):
            parts += [f"\n## {system} · {mode}\n", table(OPEN_COLUMNS, [_open_row(lv) for lv in levels])]
        else:
            parts += [f"\n## {system} · {mode}\n", table(COLUMNS, [_row(lv) for lv in levels])]
        if mode == "stream":
            parts.append(f"\nStreams held in real time (no underrun, no failure): {realtime_streams(levels)}")
        if rows := ttfa_part_rows(levels):
            first = "rate /s" if is_open(levels) else TTFA_COLUMNS[0]
            parts += [
                "\nWhere the time to first audio went (mean ms per request):\n",
                table((first, *TTFA_COLUMNS[1:]), rows),
            ]
    if rows := ratio_rows(result):
        header = ("mode", "streams", "TTFA p50 ×", "TTFA p95 ×", "RTF p50 ×", "audio s/s ×")
        note = "\n(times better than the reference-style baseline; below 1x is worse)"
        parts += ["\n## Ratio to the reference-style baseline\n", table(header, rows), note]
    return "\n".join(parts) + "\n"


def plot(result: Result, path: Path) -> bool:
    """TTFA and RTF (p50 solid, p95 dashed) vs concurrency, one row per mode; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning(
            "matplotlib is not installed: no plot (pip install matplotlib; then python -m bench.report)"
        )
        return False
    by = {k: v for k, v in groups(result).items() if not is_open(v)}
    modes = list(dict.fromkeys(mode for _, mode in by))  # in run order
    if not modes:
        return False
    fig, axes = plt.subplots(len(modes), 2, figsize=(11, 3.6 * len(modes)), squeeze=False)
    for row, mode in enumerate(modes):
        for col, (key, label) in enumerate((("ttfa_ms", "time to first audio (ms)"), ("rtf", "RTF"))):
            _panel(axes[row][col], {s: lv for (s, m), lv in by.items() if m == mode}, key, f"{label}, {mode}")
    fig.suptitle(f"{result['meta']['model']} on {result['meta']['hardware']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _panel(ax: Any, systems: dict[str, list[Result]], key: str, title: str) -> None:
    ticks: set[int] = set()
    for n, (system, levels) in enumerate(sorted(systems.items())):
        xs = [lv["concurrency"] for lv in levels]
        ticks.update(xs)
        for pct, style in (("p50", "-o"), ("p95", "--s")):
            ys = [float("nan") if lv[key][pct] is None else lv[key][pct] for lv in levels]
            ax.plot(xs, ys, style, color=f"C{n}", label=f"{system} {pct}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(ticks), [str(t) for t in sorted(ticks)])
    ax.set_xlabel("concurrent streams")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)


def plot_open(result: Result, path: Path) -> bool:
    """Open loop: TTFA p50/p95/p99 and, on a second panel, active streams (mean, max) and streams with an
    underrun, all against the arrival rate. False without matplotlib or without open-loop levels."""
    opened = {k: v for k, v in groups(result).items() if is_open(v)}
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no open-loop plot")
        return False
    if not opened:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    for n, ((system, mode, seed), levels) in enumerate(by_seed(opened).items()):
        rates = [lv["rate"] for lv in levels]
        mode = mode if seed is None else f"{mode} seed {seed}"
        for pct, style in (("p50", "-o"), ("p95", "--s"), ("p99", ":^")):
            ys = [float("nan") if lv["ttfa_ms"][pct] is None else lv["ttfa_ms"][pct] for lv in levels]
            left.plot(rates, ys, style, color=f"C{n}", label=f"{system} {mode} {pct}")
        right.plot(rates, [lv["active_mean"] for lv in levels], "-o", color=f"C{n}", label="active (mean)")
        right.plot(rates, [lv["active_max"] for lv in levels], "--s", color=f"C{n}", label="active (max)")
        under = [lv["underrun_requests"] for lv in levels]
        right.plot(rates, under, ":x", color=f"C{n + 1}", label="streams with an underrun")
    left.set_title("time to first audio (ms) vs arrival rate", fontsize=10)
    right.set_title("streams vs arrival rate", fontsize=10)
    for ax in (left, right):
        ax.set_xlabel("requests per second (Poisson)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{result['meta']['model']} on {result['meta']['hardware']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def by_seed(groups: dict[tuple[str, str], list[Result]]) -> dict[tuple[str, str, int | None], list[Result]]:
    """Open-loop groups split by arrival seed: one line per seed in a plot, not a zigzag between them."""
    out: dict[tuple[str, str, int | None], list[Result]] = {}
    for (system, mode), levels in groups.items():
        for lv in levels:
            out.setdefault((system, mode, lv.get("seed")), []).append(lv)
    return out


def write_report(result: Result, out: str | Path, with_plot: bool = True) -> dict[str, Path]:
    """Write results.json, results.md and (with matplotlib) results.png into ``out``; returns the paths.
    The json is written to a temporary name and renamed: a run killed mid-write keeps its last full one."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "markdown": out / "results.md", "plot": out / "results.png"}
    paths["open_plot"] = out / "results_open.png"
    tmp = paths["json"].with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(paths["json"])
    paths["markdown"].write_text(markdown(result))
    for key, draw in (("plot", plot), ("open_plot", plot_open)):
        if not with_plot or not draw(result, paths[key]):
            del paths[key]
    return paths


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Re-render results.md and results.png from a results.json.")
    parser.add_argument("results", help="path of a results.json written by python -m bench")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path = Path(args.results)
    result = json.loads(path.read_text())
    for kind, written in write_report(result, path.parent).items():
        log.info("%s: %s", kind, written)


if __name__ == "__main__":
    main()
