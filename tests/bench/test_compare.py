"""bench/compare.py: two saved runs -> a before/after table of the levels they share."""

from __future__ import annotations

import json

import pytest

from bench import compare


def level(system: str, mode: str, c: int, ttfa: float, rtf: float, audio: float, under: int) -> dict:
    return {
        "system": system, "mode": mode, "concurrency": c, "requests": c, "underrun_requests": under,
        "ttfa_ms": {"p50": ttfa, "p95": ttfa * 1.1}, "rtf": {"p50": rtf}, "audio_s_per_s": audio,
    }  # fmt: skip


def run(*levels: dict, git: str) -> dict:
    return {"meta": {"model": "m", "command": "python -m bench", "git": git}, "levels": list(levels)}


def test_shared_levels_show_before_after_and_the_change(tmp_path):
    before = run(
        level("cosystream", "stream", 1, 300, 0.1, 10, 0),
        level("cosystream", "stream", 16, 1300, 0.5, 29, 2),
        git="a",
    )
    after = run(
        level("cosystream", "stream", 16, 1150, 0.42, 36, 0),
        level("cosystream", "stream", 64, 2200, 1.3, 41, 64),
        git="b",
    )
    rows = compare.rows(before, after)
    assert rows == [["cosystream", "stream", "16", "1300 -> 1150 (-12%)", "1430 -> 1265 (-12%)",
                     "0.500 -> 0.420 (-16%)", "29.0 -> 36.0 (+24%)", "2/16 -> 0/16"]]  # fmt: skip
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(before)), b.write_text(json.dumps(after))
    compare.main([str(a), str(b), "--out", str(tmp_path / "c.md")])
    text = (tmp_path / "c.md").read_text()
    assert "(git a)" in text and "(git b)" in text and "| cosystream | stream | 16 |" in text


def test_runs_without_a_shared_level_are_refused():
    with pytest.raises(ValueError, match="share no"):
        compare.markdown(
            run(level("a", "stream", 1, 1, 1, 1, 0), git="x"),
            run(level("a", "stream", 2, 1, 1, 1, 0), git="y"),
        )


def test_open_loop_levels_are_matched_by_rate_and_seed_not_by_their_most_active_streams():
    def at(rate: float, seed: int, most: int, ttfa: float) -> dict:
        return level("cosystream", "stream open-loop", most, ttfa, 0.1, 30, 0) | {"rate": rate, "seed": seed}

    before = run(at(3.0, 0, 12, 300), at(3.0, 1, 14, 320), at(4.0, 0, 30, 600), git="a")
    after = run(at(3.0, 0, 9, 240), at(3.0, 1, 12, 250), git="b")
    rows = compare.rows(before, after)
    assert [r[:4] for r in rows] == [
        ["cosystream", "stream open-loop", "3/s seed 0", "300 -> 240 (-20%)"],
        ["cosystream", "stream open-loop", "3/s seed 1", "320 -> 250 (-22%)"],
    ]
