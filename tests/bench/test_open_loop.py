"""Open-loop load: the arrival process, the length draw, the active-stream count, and the CLI end to end
on the tiny v3 model (the demo-tiny kind)."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from bench.__main__ import main
from bench.load import Level
from bench.open_loop import OpenLoop, Slo, active_streams, capacity


def test_arrivals_are_a_poisson_process_at_the_rate():
    sends = OpenLoop(rate=4.0, requests=4000).arrivals(random.Random(1))
    gaps = [b - a for a, b in itertools.pairwise(sends)]
    assert sends[0] == 0.0 and min(gaps) >= 0
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.05)  # mean gap 1 / rate
    # exponential gaps: about e^-1 of them are longer than the mean
    assert sum(g > 0.25 for g in gaps) / len(gaps) == pytest.approx(0.368, abs=0.03)
    assert OpenLoop(4.0, 50).arrivals(random.Random(7)) == OpenLoop(4.0, 50).arrivals(random.Random(7))


def test_lengths_are_uniform_over_the_spread():
    lengths = OpenLoop(1.0, 3000, spread=0.5).lengths(200, random.Random(0))
    assert min(lengths) == 100 and max(lengths) == 300
    assert sum(lengths) / len(lengths) == pytest.approx(200, rel=0.03)
    assert set(OpenLoop(1.0, 10, spread=0.0).lengths(200, random.Random(0))) == {200}


def test_active_streams_is_the_time_weighted_overlap():
    # 0-4 and 1-3 overlap for 2 s; 4-5 touches the first without overlapping
    mean, most = active_streams([(0.0, 4.0), (1.0, 3.0), (4.0, 5.0)], wall_s=5.0)
    assert mean == pytest.approx((4 + 2 + 1) / 5.0) and most == 2
    assert active_streams([], 1.0) == (0.0, 0)


def test_bad_open_loop_settings_are_refused():
    for kw in (
        {"rate": 0.0, "requests": 1},
        {"rate": 1.0, "requests": 0},
        {"rate": 1, "requests": 1, "spread": 1},
    ):
        with pytest.raises(ValueError):
            OpenLoop(**kw)


def test_cli_open_loop_on_the_tiny_v3_model_reports_ttfa_underruns_and_active_streams(tmp_path):
    out = tmp_path / "out"
    argv = ["--random-tiny", "v3", "--cache-dir", str(tmp_path / "cache"), "--concurrency", "8"]
    argv += ["--arrivals", "poisson", "--rate", "2,4", "--duration-s", "2", "--tokens", "40"]
    paths = main([*argv, "--modes", "stream", "--warmup", "0", "--out", str(out)])
    result = json.loads(paths["json"].read_text())
    assert result["meta"]["arrivals"] == "poisson" and result["meta"]["complete"] is True
    levels = result["levels"]
    assert [(lv["mode"], lv["rate"], lv["requests"]) for lv in levels] == [
        ("stream open-loop", 2.0, 4),
        ("stream open-loop", 4.0, 8),
    ]
    for lv in levels:
        assert lv["failed"] == 0 and lv["concurrency"] == lv["active_max"] >= 1
        assert 0 < lv["active_mean"] <= lv["active_max"]
        t = lv["ttfa_ms"]
        assert 0 < t["p50"] <= t["p95"] <= t["p99"] <= t["max"]
        lengths = {round(r["audio_s"] * 25) for r in lv["per_request"]}  # 20-60 tokens, v3 may thin silence
        assert max(lengths) <= 60 and len(lengths) > 1
    md = paths["markdown"].read_text()
    assert "## cosystream · stream open-loop" in md and "| 4.00 | 8 | 0 |" in md and "Poisson" in md
    assert paths["open_plot"].read_bytes()[:4] == b"\x89PNG" and "plot" not in paths


def level_at(rate: float, p95: float, failed: int = 0, underran: int = 0) -> Level:
    """An open-loop level with only what the SLO reads set."""
    ttfa = {"mean": p95, "p50": p95, "p95": p95, "p99": p95, "max": p95}
    return Level(
        "cosystream", "stream open-loop", 8, 100, failed, 1.0, 1.0, 1.0, ttfa, {}, {}, underran, underran,
        0.0, None, 0.0, {}, {}, [], [], rate=rate,
    )  # fmt: skip


def test_slo_names_every_miss():
    slo = Slo(300.0)
    assert slo.misses(level_at(4.0, 299.0)) == []
    assert slo.misses(level_at(4.0, 301.0, failed=2, underran=1)) == [
        "2 failed (0 refused)",
        "1 streams underran",
        "TTFA p95 301 ms > 300",
    ]
    with pytest.raises(ValueError):
        Slo(0.0)


def test_capacity_is_the_highest_rate_met_before_the_first_miss():
    levels = [
        level_at(8.0, 250.0),
        level_at(4.0, 120.0),
        level_at(10.0, 200.0, underran=3),
        level_at(12, 100),
    ]
    found = capacity(levels, Slo(300.0))
    assert found["capacity_rate"] == 8.0
    # ascending, and nothing after the first miss counts (12 met, but 10 did not)
    assert [(r["rate"], r["met"]) for r in found["rates"]] == [(4.0, True), (8.0, True), (10.0, False)]
    assert capacity([level_at(4.0, 900.0)], Slo(300.0))["capacity_rate"] is None


def test_cli_capacity_search_stops_at_the_first_rate_that_misses_the_slo(tmp_path):
    out = tmp_path / "out"
    argv = ["--random-tiny", "v3", "--cache-dir", str(tmp_path / "cache"), "--concurrency", "8"]
    argv += ["--arrivals", "poisson", "--find-capacity", "--rate", "2,4", "--duration-s", "0.5"]
    argv += ["--min-requests", "3", "--slo-ttfa-ms", "0.001", "--tokens", "40", "--modes", "stream"]
    paths = main([*argv, "--warmup", "0", "--out", str(out)])
    result = json.loads(paths["json"].read_text())
    # no stream's first audio comes within a microsecond: the lowest rate misses, the search stops there
    assert [(lv["rate"], lv["requests"]) for lv in result["levels"]] == [(2.0, 3)]
    found = result["meta"]["capacity"]["stream open-loop"]
    assert found["capacity_rate"] is None and found["slo_ttfa_p95_ms"] == 0.001
    assert [r["rate"] for r in found["rates"]] == [2.0] and "TTFA p95" in found["rates"][0]["misses"][-1]
    assert "capacity (stream open-loop" in paths["markdown"].read_text()


def test_ab_relaxed_cap_runs_both_arms_per_rate_in_one_load_alternating_the_order(tmp_path, monkeypatch):
    from engine.serving.token2wav import ChunkScheduler

    switched: list[bool] = []
    rule = ChunkScheduler.relaxed_cap

    def switch(scheduler: ChunkScheduler, on: bool) -> None:
        switched.append(on)
        rule.fset(scheduler, on)

    monkeypatch.setattr(ChunkScheduler, "relaxed_cap", property(rule.fget, switch))
    argv = ["--random-tiny", "v3", "--cache-dir", str(tmp_path / "cache"), "--concurrency", "8"]
    argv += ["--arrivals", "poisson", "--find-capacity", "--rate", "2,4", "--duration-s", "0.5"]
    # offline: one chunk a request, so no underrun on a slow machine stops an arm's search (and no TTFA
    # misses a 1e9 ms SLO): the test is about the switching, not the speed
    argv += ["--min-requests", "3", "--slo-ttfa-ms", "1e9", "--tokens", "40", "--modes", "offline"]
    paths = main([*argv, "--ab", "relaxed-cap", "--warmup", "0", "--out", str(tmp_path / "out")])
    result = json.loads(paths["json"].read_text())
    arms = [(lv["rate"], lv["system"]) for lv in result["levels"]]
    relaxed = "cosystream relaxed-cap"
    assert arms == [(2.0, "cosystream"), (2.0, relaxed), (4.0, relaxed), (4.0, "cosystream")]
    # built auto (the default), then A never and B the rule as configured: auto
    assert switched == [None, False, None, None, False]
    found = result["meta"]["capacity"]
    assert set(found) == {"offline open-loop cosystream", "offline open-loop cosystream relaxed-cap"}
    assert all(arm["capacity_rate"] == 4.0 for arm in found.values())
    assert all(lv["failed"] == 0 for lv in result["levels"])


def test_ab_relaxed_cap_stops_each_arm_at_its_first_miss(tmp_path):
    argv = ["--random-tiny", "v3", "--cache-dir", str(tmp_path / "cache"), "--concurrency", "8"]
    argv += ["--arrivals", "poisson", "--find-capacity", "--rate", "2,4", "--duration-s", "0.5"]
    argv += ["--min-requests", "2", "--slo-ttfa-ms", "0.001", "--tokens", "30", "--modes", "stream"]
    paths = main([*argv, "--ab", "relaxed-cap", "--warmup", "0", "--out", str(tmp_path / "out")])
    levels = json.loads(paths["json"].read_text())["levels"]
    arms = [(lv["rate"], lv["system"]) for lv in levels]
    assert arms == [(2.0, "cosystream"), (2.0, "cosystream relaxed-cap")]


@pytest.mark.parametrize(
    ("ab", "flags"),
    [
        ("relaxed-cap", ["--t2w-relaxed-cap", "off"]),
        ("relaxed-cap", ["--t2w-fifo"]),
        ("relaxed-cap", ["--arrivals", "closed"]),
        ("burst-start", ["--fast-start", "on"]),
        ("burst-start", ["--url", "http://127.0.0.1:9"]),
        ("yield", ["--no-t2w-yield"]),
        ("yield", ["--t2w-fifo"]),
    ],
)
def test_ab_refuses_what_it_cannot_switch(ab, flags, capsys):
    with pytest.raises(SystemExit):
        main(["--random-tiny", "v3", "--arrivals", "poisson", *flags, "--ab", ab])
    assert "--ab" in capsys.readouterr().err


def ab_arms(tmp_path, ab: str) -> list[str]:
    """One rate (2/s, two tiny v3 requests an arm) of ``--ab ab`` in process: the levels' arms, in order."""
    argv = ["--random-tiny", "v3", "--cache-dir", str(tmp_path / "cache"), "--concurrency", "8"]
    argv += ["--arrivals", "poisson", "--find-capacity", "--rate", "2", "--duration-s", "0.5"]
    argv += ["--min-requests", "2", "--slo-ttfa-ms", "1e9", "--tokens", "30", "--modes", "offline"]
    paths = main([*argv, "--ab", ab, "--warmup", "0", "--out", str(tmp_path / "out")])
    return [lv["system"] for lv in json.loads(paths["json"].read_text())["levels"]]


def test_ab_burst_start_switches_the_fast_start_rule_the_engine_reads_per_request(tmp_path, monkeypatch):
    from engine.serving.engine import TTSEngine

    seen: list[float | None] = []
    rule = TTSEngine._splits_first_chunk

    def splits(engine: TTSEngine) -> bool:
        seen.append(engine.cfg.stream.fast_start_burst_s)
        return rule(engine)

    monkeypatch.setattr(TTSEngine, "_splits_first_chunk", splits)
    assert ab_arms(tmp_path, "burst-start") == ["cosystream", "cosystream burst-start"]
    # the engine's warm-up request first (the configured rule, the default), then two requests an arm, each
    # reading the rule as switched: A by requests computing, B by recent starts
    assert seen[-4:] == [None, None, 0.5, 0.5] and set(seen[:-4]) <= {0.5}


def test_find_capacity_needs_open_loop_arrivals():
    with pytest.raises(SystemExit):
        main(["--random-tiny", "v3", "--find-capacity", "--rate", "1"])


def test_ab_burst_start_on_v2_says_both_arms_are_the_same_engine(caplog):
    """The fast start, and so the burst rule, acts on v3 only: an A/B of it on v2 is an A/A, and says so."""
    from types import SimpleNamespace

    from bench.__main__ import AB_SWITCHES
    from engine.config import EngineConfig

    for family, warned in (("cosyvoice2", True), ("cosyvoice3", False)):
        engine = SimpleNamespace(family=family, cfg=EngineConfig(model="demo-tiny"))
        caplog.clear()
        with caplog.at_level("WARNING", "bench"):
            AB_SWITCHES["burst-start"](engine, True)
        assert ("same engine" in caplog.text) == warned and engine.cfg.stream.fast_start_burst_s == 0.5


def test_overload_runs_past_capacity_without_then_with_each_admission_guard(tmp_path, monkeypatch):
    from engine.serving.admission import Admission

    guards: list[float | None] = []
    overloaded = Admission.overloaded

    def watch(admission: Admission) -> float | None:
        guards.append(admission.slack_guard_s)
        return overloaded(admission)

    monkeypatch.setattr(Admission, "overloaded", watch)
    argv = ["--random-tiny", "v3", "--cache-dir", str(tmp_path / "cache"), "--concurrency", "8"]
    argv += ["--arrivals", "poisson", "--find-capacity", "--rate", "2", "--duration-s", "0.5"]
    argv += ["--min-requests", "2", "--slo-ttfa-ms", "1e9", "--tokens", "30", "--modes", "offline"]
    argv += ["--overload", "1.5", "--overload-admit-s", "0.5,2"]
    paths = main([*argv, "--warmup", "0", "--out", str(tmp_path / "out")])
    result = json.loads(paths["json"].read_text())
    runs = [(lv["system"], lv["rate"], lv["requests"]) for lv in result["levels"]]
    assert runs == [
        ("cosystream", 2.0, 2),
        ("cosystream overload", 3.0, 2),
        ("cosystream overload admit 0.5 s", 3.0, 2),
        ("cosystream overload admit 2 s", 3.0, 2),
    ]
    # each request of a run asked admission with that run's guard; the search's and the first overload
    # run's requests with none (the engine's warm-up request may come first)
    assert guards[-6:] == [None, None, 0.5, 0.5, 2.0, 2.0] and set(guards[:-6]) <= {None}
    # the search's record leaves the overload runs out; they have their own
    meta = result["meta"]
    assert meta["capacity"]["offline open-loop"]["capacity_rate"] == 2.0
    assert meta["overload"]["factor"] == 1.5
    assert [r["system"] for r in meta["overload"]["runs"]][1:] == [
        "cosystream overload admit 0.5 s",
        "cosystream overload admit 2 s",
    ]
    assert all(r["admitted"] + r["refused"] == r["requests"] == 2 for r in meta["overload"]["runs"])
    assert "overload (offline open-loop, 3 requests/s = 1.5 x 2," in paths["markdown"].read_text()


def test_overload_rate_is_factor_times_the_best_arm_and_the_lowest_rate_when_none_met(caplog):
    from argparse import Namespace

    from bench.__main__ import overload_rate

    args = Namespace(overload=2.0, rate=[1.0, 2.0, 3.0, 4.0], slo_ttfa_ms=300.0)
    met, missed = level_at(1.0, 200.0), level_at(2.0, 400.0)
    by_arm = {"": [met, missed], " burst-start": [met, level_at(2.0, 250.0), level_at(3.0, 900.0)]}
    assert overload_rate(args, by_arm) == (4.0, " burst-start")
    tie = {"": [met, missed], " burst-start": [met, missed]}
    assert overload_rate(args, tie) == (2.0, " burst-start")  # a tie: the --ab arm
    assert overload_rate(args, {"": [met, level_at(2.0, 100.0)]}) == (4.0, "")
    with caplog.at_level("WARNING", "bench"):
        assert overload_rate(args, {"": [missed]}) == (2.0, "")
    assert "no arm met the SLO" in caplog.text


@pytest.mark.parametrize(
    "flags",
    [
        ["--overload", "2"],  # no search to take the capacity from
        ["--find-capacity", "--overload", "0"],
        ["--find-capacity", "--overload", "2", "--url", "http://127.0.0.1:9"],
        ["--find-capacity", "--overload", "2", "--overload-admit-s", "11"],
    ],
)
def test_overload_refuses_what_it_cannot_run(flags, capsys):
    with pytest.raises(SystemExit):
        main(["--random-tiny", "v3", "--arrivals", "poisson", *flags])
    assert "--overload" in capsys.readouterr().err


def test_ab_yield_switches_the_seam_of_the_engines_token2wav_worker(tmp_path, monkeypatch):
    """A: every token2wav call whole; B: urgent batches at a relaxed call's seam; each rate's arms see the
    switch (the scheduler's setting, read per call)."""
    from engine.serving.token2wav import ChunkScheduler

    seen: list[bool] = []
    urgent = ChunkScheduler.urgent_batch

    def spy(scheduler: ChunkScheduler, running):
        seen.append(scheduler.yield_to_urgent)
        return urgent(scheduler, running)

    monkeypatch.setattr(ChunkScheduler, "urgent_batch", spy)
    assert ab_arms(tmp_path, "yield") == ["cosystream", "cosystream yield"]
    assert False in seen and seen[-1] is True  # A ran its calls, then B (the engine's default again)
