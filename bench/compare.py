"""Before/after table of two bench runs: ``python -m bench.compare BEFORE.json AFTER.json [--out FILE]``.

Levels are matched by (system, mode, concurrency), open-loop ones by (system, mode, rate, arrival seed); each
row shows TTFA p50/p95, RTF p50, audio s/s and the
underrun streams before -> after with the change in percent (negative = less time / fewer stalls).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.report import table

log = logging.getLogger(__name__)
Result = dict[str, Any]
COLUMNS = (
    "system",
    "mode",
    "streams or rate",
    "TTFA p50 ms",
    "TTFA p95 ms",
    "RTF p50",
    "audio s/s",
    "underrun streams",
)


def _key(level: Result) -> tuple[str, str, str]:
    """A closed-loop level by its streams; an open-loop one by its rate and arrival seed (its concurrency is
    only the most streams it happened to have active)."""
    if level.get("rate") is None:
        return level["system"], level["mode"], str(level["concurrency"])
    seed = level.get("seed")
    return level["system"], level["mode"], f"{level['rate']:g}/s" + ("" if seed is None else f" seed {seed}")


def _change(before: float | None, after: float | None, digits: int) -> str:
    if before is None or after is None:
        return "-"
    pct = f" ({(after - before) / before * 100:+.0f}%)" if before else ""
    return f"{before:.{digits}f} -> {after:.{digits}f}{pct}"


def rows(before: Result, after: Result) -> list[list[str]]:
    """One row per level present in both runs, in the order of ``after``."""
    old = {_key(lv): lv for lv in before["levels"]}
    out = []
    for lv in after["levels"]:
        if (b := old.get(_key(lv))) is None:
            continue
        out.append([
            *_key(lv),
            _change(b["ttfa_ms"]["p50"], lv["ttfa_ms"]["p50"], 0),
            _change(b["ttfa_ms"]["p95"], lv["ttfa_ms"]["p95"], 0),
            _change(b["rtf"]["p50"], lv["rtf"]["p50"], 3),
            _change(b["audio_s_per_s"], lv["audio_s_per_s"], 1),
            f"{b['underrun_requests']}/{b['requests']} -> {lv['underrun_requests']}/{lv['requests']}",
        ])  # fmt: skip
    return out


def markdown(before: Result, after: Result) -> str:
    found = rows(before, after)
    if not found:
        raise ValueError("the two runs share no level (system, mode, concurrency or rate and seed)")
    head = [
        f"# Before -> after: {after['meta'].get('model', '?')}",
        f"- before: `{before['meta'].get('command', '?')}` (git {before['meta'].get('git', '?')})",
        f"- after: `{after['meta'].get('command', '?')}` (git {after['meta'].get('git', '?')})",
        "",
    ]
    return "\n".join(head) + table(COLUMNS, found) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("before", help="results.json of the earlier run")
    p.add_argument("after", help="results.json of the later run")
    p.add_argument("--out", help="write the markdown here (default: print it)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    text = markdown(json.loads(Path(args.before).read_text()), json.loads(Path(args.after).read_text()))
    if args.out:
        Path(args.out).write_text(text)
        log.info("wrote %s", args.out)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
