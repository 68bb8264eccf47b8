"""bench.lm_host_hop: both arms at each level, each id's age read off the clock it carries."""

from __future__ import annotations

import json

from bench import lm_host_hop


def test_each_arm_measures_every_level_and_the_ages_are_the_clocks(tmp_path) -> None:
    args = ["--streams", "1,3", "--steps", "6", "--step-ms", "2", "--out", str(tmp_path)]
    assert lm_host_hop.main(args) == 0
    saved = json.loads((tmp_path / "lm_host_hop.json").read_text())
    rows = saved["rows"]
    assert [(r["arm"], r["streams"]) for r in rows] == [
        ("in_process", 1), ("lm_host", 1), ("lm_host", 3), ("in_process", 3),  # the first arm alternates
    ]  # fmt: skip
    for r in rows:  # ages: microseconds between two reads of one clock, on one machine
        assert 0 <= r["age_p50_ms"] <= r["age_p99_ms"] <= r["age_max_ms"] < 1000
        assert 0 < r["first_id_p50_ms"] <= r["first_id_max_ms"] < 10_000
    assert saved["meta"]["steps"] == 6
