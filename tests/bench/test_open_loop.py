"""Open-loop load: the arrival process, the length draw, the active-stream count, and the CLI end to end
on the tiny v3 model (the demo-tiny kind)."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import types

import numpy as np
import pytest

from bench.__main__ import main
from bench.load import Level, RequestResult, Workload, prompt_audio
from bench.open_loop import OpenLoop, Slo, active_streams, capacity, run_open_level, windows
from engine.config import StreamConfig


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
    """Each rate once per arrival seed (0 and 1 by default), rate x --arrival-s requests, TTFA per window of
    arrivals beside the whole; results.json says how the rates were measured and in which order."""
    out = tmp_path / "out"
    argv = ["--random-tiny", "v3", "--cache-dir", str(tmp_path / "cache"), "--concurrency", "8"]
    argv += ["--arrivals", "poisson", "--rate", "2,4", "--arrival-s", "1", "--window-s", "0.5"]
    paths = main([*argv, "--tokens", "40", "--modes", "stream", "--warmup", "0", "--out", str(out)])
    result = json.loads(paths["json"].read_text())
    meta = result["meta"]
    assert meta["arrivals"] == "poisson" and meta["complete"] is True
    run = meta["open_loop"]
    assert (run["arrival_s"], run["window_s"], run["seeds"], run["rates"]) == (1.0, 0.5, [0, 1], [2.0, 4.0])
    assert run["requests"] == {"2": 2, "4": 4} and run["warmup"]["arrival_s"] == 0.0  # no A/B: no warm-up
    levels = result["levels"]
    runs = [(lv["mode"], lv["rate"], lv["seed"], lv["requests"]) for lv in levels]
    assert runs == [
        ("stream open-loop", 2.0, 0, 2),
        ("stream open-loop", 2.0, 1, 2),
        ("stream open-loop", 4.0, 0, 4),
        ("stream open-loop", 4.0, 1, 4),
    ]
    assert meta["order"] == [{"rate": r, "seed": s, "system": "cosystream"} for _, r, s, _ in runs]
    for lv in levels:
        assert lv["arrival_s"] == pytest.approx(1.0) and len(lv["windows"]) == 2
        assert sum(w["requests"] for w in lv["windows"]) == lv["requests"]
        assert [w["start_s"] for w in lv["windows"]] == [0.0, 0.5]
        assert lv["failed"] == 0 and lv["concurrency"] == lv["active_max"] >= 1
        assert 0 < lv["active_mean"] <= lv["active_max"]
        t = lv["ttfa_ms"]
        assert 0 < t["p50"] <= t["p95"] <= t["p99"] <= t["max"]
        lengths = {round(r["audio_s"] * 25) for r in lv["per_request"]}  # 20-60 tokens, v3 may thin silence
        assert max(lengths) <= 60 and len(lengths) > 1
    md = paths["markdown"].read_text()
    assert "## cosystream · stream open-loop" in md and "| 4.00 | 1 | 4 | 0 |" in md and "Poisson" in md
    assert "TTFA p50/p95 ms per window" in md and "seeds 0, 1" in md
    assert paths["open_plot"].read_bytes()[:4] == b"\x89PNG" and "plot" not in paths


def level_at(rate: float, p95: float, failed: int = 0, underran: int = 0, seed: int | None = None) -> Level:
    """An open-loop level with only what the SLO reads set."""
    ttfa = {"mean": p95, "p50": p95, "p95": p95, "p99": p95, "max": p95}
    return Level(
        "cosystream", "stream open-loop", 8, 100, failed, 1.0, 1.0, 1.0, ttfa, {}, {}, underran, underran,
        0.0, None, 0.0, {}, {}, [], [], rate=rate, seed=seed,
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
    argv += [
        "--arrivals",
        "poisson",
        "--find-capacity",
        "--rate",
        "2,4",
        "--duration-s",
        "0.5",
        "--seeds",
        "0",
    ]
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
    argv += [
        "--arrivals",
        "poisson",
        "--find-capacity",
        "--rate",
        "2,4",
        "--duration-s",
        "0.5",
        "--seeds",
        "0",
    ]
    # offline: one chunk a request, so no underrun on a slow machine stops an arm's search (and no TTFA
    # misses a 1e9 ms SLO): the test is about the switching, not the speed
    argv += ["--min-requests", "3", "--slo-ttfa-ms", "1e9", "--tokens", "40", "--modes", "offline"]
    paths = main(
        [
            *argv,
            "--ab",
            "relaxed-cap",
            "--warmup",
            "0",
            "--warmup-arrival-s",
            "0",
            "--out",
            str(tmp_path / "out"),
        ]
    )
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
    argv += [
        "--arrivals",
        "poisson",
        "--find-capacity",
        "--rate",
        "2,4",
        "--duration-s",
        "0.5",
        "--seeds",
        "0",
    ]
    argv += ["--min-requests", "2", "--slo-ttfa-ms", "0.001", "--tokens", "30", "--modes", "stream"]
    paths = main(
        [
            *argv,
            "--ab",
            "relaxed-cap",
            "--warmup",
            "0",
            "--warmup-arrival-s",
            "0",
            "--out",
            str(tmp_path / "out"),
        ]
    )
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
        ("quiet-first", ["--t2w-quiet-first"]),
        ("quiet-first", ["--t2w-fifo"]),
        ("quiet-first", ["--url", "http://127.0.0.1:9"]),
        ("first-lane", ["--t2w-first-lane"]),
        ("first-lane", ["--no-t2w-first-lane"]),
        ("lane-priority", ["--t2w-lane-priority"]),
        ("lane-priority", ["--no-t2w-first-lane"]),
        ("short-split", ["--fast-start", "off"]),
        ("prompt-trim", ["--fast-start", "on"]),
        ("prompt-trim", ["--fast-start-trim", "6"]),
        ("short-split", ["--fast-start-trim", "12"]),
        ("first-lane", ["--arrivals", "closed"]),
    ],
)
def test_ab_refuses_what_it_cannot_switch(ab, flags, capsys):
    with pytest.raises(SystemExit):
        main(["--random-tiny", "v3", "--arrivals", "poisson", *flags, "--ab", ab])
    assert "--ab" in capsys.readouterr().err


def ab_arms(tmp_path, ab: str, family: str = "v3") -> list[str]:
    """One rate (2/s, two tiny requests an arm) of ``--ab ab`` in process: the levels' arms, in order."""
    argv = ["--random-tiny", family, "--cache-dir", str(tmp_path / "cache"), "--concurrency", "8"]
    argv += ["--arrivals", "poisson", "--find-capacity", "--rate", "2", "--duration-s", "0.5", "--seeds", "0"]
    argv += ["--min-requests", "2", "--slo-ttfa-ms", "1e9", "--tokens", "30", "--modes", "offline"]
    paths = main(
        [*argv, "--ab", ab, "--warmup", "0", "--warmup-arrival-s", "0", "--out", str(tmp_path / "out")]
    )
    return [lv["system"] for lv in json.loads(paths["json"].read_text())["levels"]]


def test_ab_burst_start_switches_the_fast_start_rule_the_engine_reads_per_request(tmp_path, monkeypatch):
    from engine.serving.engine import TTSEngine

    seen: list[float | None] = []
    rule = TTSEngine._splits_first_chunk

    def splits(engine: TTSEngine, watch) -> bool:
        seen.append(engine.cfg.stream.fast_start_burst_s)
        return rule(engine, watch)

    monkeypatch.setattr(TTSEngine, "_splits_first_chunk", splits)
    assert ab_arms(tmp_path, "burst-start") == ["cosystream", "cosystream burst-start"]
    # the engine's warm-up request first (the configured rule, the default), then two requests an arm, each
    # reading the rule as switched: A by requests computing, B by recent starts
    assert seen[-4:] == [None, None, 0.5, 0.5] and set(seen[:-4]) <= {0.5}


def test_ab_fast_start_on_switches_v2s_rule_per_request(tmp_path, monkeypatch):
    """The fast start as a lever on v2: A, auto, splits a first chunk while few requests start at once (as
    v3's); B splits every request's where its grid offset allows (the bench's prompt: offset 13), read per
    request."""
    from engine.serving.engine import TTSEngine

    seen: list[tuple[bool | None, bool]] = []
    rule = TTSEngine._splits_first_chunk

    def splits(engine: TTSEngine, watch) -> bool:
        split = rule(engine, watch)
        seen.append((engine.cfg.stream.fast_start, split))
        return split

    monkeypatch.setattr(TTSEngine, "_splits_first_chunk", splits)
    assert ab_arms(tmp_path, "fast-start-on", "v2") == ["cosystream", "cosystream fast-start-on"]
    assert seen[-4:] == [(None, True), (None, True), (True, True), (True, True)]
    assert {fast for fast, _ in seen[:-4]} <= {None}  # the engine's warm-up: auto, as configured


def test_find_capacity_needs_open_loop_arrivals():
    with pytest.raises(SystemExit):
        main(["--random-tiny", "v3", "--find-capacity", "--rate", "1"])


def test_ab_voice_pages_switches_the_kept_voices_per_arm_and_says_where_there_is_no_pool(caplog):
    """B: the engine's Token2Wav uses the kept voices (built at load); A: not. Without a page pool (the
    CPU's eager solver) both arms are one engine, and the bench says so."""
    from types import SimpleNamespace

    from bench.__main__ import AB_SWITCHES

    for voices, warned in ((None, True), (object(), False)):
        t2w = SimpleNamespace(voice_pages=False, flow=SimpleNamespace(decoder=SimpleNamespace(voices=voices)))
        engine = SimpleNamespace(token2wav=t2w)
        caplog.clear()
        with caplog.at_level("WARNING", "bench"):
            AB_SWITCHES["voice-pages"](engine, True)
        assert t2w.voice_pages and ("one engine" in caplog.text) == warned
        AB_SWITCHES["voice-pages"](engine, False)
        assert not t2w.voice_pages


def test_ab_voice_pages_builds_the_engine_with_the_voices(tmp_path):
    from bench.__main__ import engine_config, parse_args

    argv = ["--random-tiny", "v3", "--arrivals", "poisson"]
    assert not engine_config(parse_args(argv)).flow_voice_pages
    assert engine_config(parse_args([*argv, "--ab", "voice-pages"])).flow_voice_pages
    assert engine_config(parse_args([*argv, "--flow-voice-pages"])).flow_voice_pages


def test_ab_busy_start_splits_by_recent_starts_however_many_compute():
    """B, the default: the burst rule alone (StreamConfig.fast_start_busy); A: no split from
    adaptive_min_active requests computing on. The engine's rule reads it per request."""
    from types import SimpleNamespace

    from bench.__main__ import AB_SWITCHES
    from engine.config import EngineConfig

    engine = SimpleNamespace(family="cosyvoice3", cfg=EngineConfig(model="demo-tiny"))
    rule = lambda active, recent: engine.cfg.stream.splits_first_chunk(active, recent)  # noqa: E731
    assert [rule(n, 1) for n in (7, 8, 30)] == [True, True, True]  # the default
    AB_SWITCHES["busy-start"](engine, False)
    assert [rule(n, 1) for n in (7, 8, 30)] == [True, False, False]
    AB_SWITCHES["busy-start"](engine, True)
    assert [rule(n, 1) for n in (7, 8, 30)] == [True, True, True]
    assert not rule(8, 5)  # a wave of starts still gets the reference's first chunk
    AB_SWITCHES["busy-start"](engine, False)
    assert [rule(n, 1) for n in (7, 8)] == [True, False]


@pytest.mark.parametrize("lever", ["busy-start", "fast-start-on"])
@pytest.mark.parametrize("flags", [["--fast-start", "on"], ["--fast-start", "off"]])
def test_ab_fast_start_levers_need_the_auto_rule(flags, lever, capsys):
    with pytest.raises(SystemExit):
        main(["--random-tiny", "v3", "--arrivals", "poisson", *flags, "--ab", lever])
    assert f"--ab {lever}" in capsys.readouterr().err


def test_overload_runs_past_capacity_without_then_with_each_admission_guard(tmp_path, monkeypatch):
    from engine.serving.admission import Admission

    guards: list[float | None] = []
    overloaded = Admission.overloaded

    def watch(admission: Admission) -> float | None:
        guards.append(admission.slack_guard_s)
        return overloaded(admission)

    monkeypatch.setattr(Admission, "overloaded", watch)
    argv = ["--random-tiny", "v3", "--cache-dir", str(tmp_path / "cache"), "--concurrency", "8"]
    argv += ["--arrivals", "poisson", "--find-capacity", "--rate", "2", "--duration-s", "0.5", "--seeds", "0"]
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


def test_closed_after_runs_waves_in_the_open_loops_load_outside_its_capacity_and_traces(tmp_path):
    """--closed-after 2: after the rate, closed-loop waves of 2 streams in the same load (4 waves of the
    bench's fixed length), kept as a closed level (no rate) that the capacity record and the chunk traces
    leave out."""
    argv = ["--random-tiny", "v3", "--cache-dir", str(tmp_path / "cache"), "--concurrency", "8"]
    argv += ["--arrivals", "poisson", "--find-capacity", "--rate", "2", "--duration-s", "0.5", "--seeds", "0"]
    argv += ["--min-requests", "2", "--slo-ttfa-ms", "1e9", "--tokens", "30", "--modes", "stream", "--trace"]
    paths = main([*argv, "--closed-after", "2", "--warmup", "0", "--out", str(tmp_path / "out")])
    result = json.loads(paths["json"].read_text())
    runs = [(lv["rate"], lv["concurrency"], lv["requests"], lv["failed"]) for lv in result["levels"]]
    assert runs[0][0] == 2.0 and runs[1] == (None, 2, 8, 0)
    closed = result["levels"][1]
    assert len({round(r["audio_s"], 3) for r in closed["per_request"]}) == 1  # the fixed length, no spread
    assert closed["ttfa_ms"]["p95"] > 0
    assert [r["rate"] for r in result["meta"]["capacity"]["stream open-loop"]["rates"]] == [2.0]
    traced = [json.loads(line) for line in (tmp_path / "out" / "trace.jsonl").read_text().splitlines()]
    assert traced and {row["rate"] for row in traced} == {2.0}


CLOSED_AFTER_MISUSE = [["--closed-after", "4"], ["--arrivals", "poisson", "--closed-after", "16"]]


@pytest.mark.parametrize("flags", CLOSED_AFTER_MISUSE)  # a closed sweep; more streams than --concurrency
def test_closed_after_refuses_what_it_cannot_run(flags, capsys):
    with pytest.raises(SystemExit):
        main(["--random-tiny", "v3", "--concurrency", "8", *flags])
    assert "--closed-after" in capsys.readouterr().err


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


def test_ab_quiet_first_switches_the_hold_of_the_engines_token2wav_worker(tmp_path, monkeypatch):
    """A: calls of buffered chunks run as they come (the engine's default); B: held while a first chunk is
    decoded; the worker's takes in each arm see the switch, and no first chunk is left counted."""
    from engine.serving.engine import TTSEngine
    from engine.serving.job_queue import DeadlineQueue

    seen: list[bool] = []
    held_s, close = DeadlineQueue._held_s, TTSEngine.close
    closed: list[int] = []

    def spy(queue: DeadlineQueue, batch, now: float, since: float) -> float:
        seen.append(queue.hold is not None)  # each batch the worker takes
        return held_s(queue, batch, now, since)

    def closing(engine: TTSEngine) -> None:
        closed.append(engine.token2wav.scheduler.decoding)
        close(engine)

    monkeypatch.setattr(DeadlineQueue, "_held_s", spy)
    monkeypatch.setattr(TTSEngine, "close", closing)
    assert ab_arms(tmp_path, "quiet-first") == ["cosystream", "cosystream quiet-first"]
    assert seen[0] is False and False in seen[1:] and seen[-1] is True  # warm-up, A, then B
    assert closed == [0]


def test_the_first_lane_ab_builds_the_lane_and_opens_it_for_the_b_arm_only(tmp_path, monkeypatch):
    """--ab first-lane: the engine loads with the first-chunk lane (both arms share its graphs), each arm
    switches it: closed for A, open for B."""
    from bench import __main__ as bench_main
    from engine.serving.engine import TTSEngine

    switched: list[tuple[bool, bool]] = []
    real = bench_main.AB_SWITCHES["first-lane"]

    def spy(engine: TTSEngine, on: bool) -> None:
        real(engine, on)
        switched.append((on, engine.token2wav.first_lane))

    monkeypatch.setitem(bench_main.AB_SWITCHES, "first-lane", spy)
    assert ab_arms(tmp_path, "first-lane") == ["cosystream", "cosystream first-lane"]
    assert (False, False) in switched and (True, True) in switched


def test_the_lane_priority_ab_opens_the_lane_and_switches_its_stream_per_arm(tmp_path, monkeypatch):
    """--ab lane-priority: the lane opens at load (also where auto would not: the CPU) and each arm sets
    which of its streams it runs on: the normal one for A, the high-priority one for B."""
    from bench import __main__ as bench_main
    from engine.serving.engine import TTSEngine

    switched: list[tuple[bool, bool, bool]] = []
    real = bench_main.AB_SWITCHES["lane-priority"]

    def spy(engine: TTSEngine, on: bool) -> None:
        real(engine, on)
        switched.append((on, engine.token2wav.lane_urgent, engine.token2wav.first_lane))

    monkeypatch.setitem(bench_main.AB_SWITCHES, "lane-priority", spy)
    assert ab_arms(tmp_path, "lane-priority") == ["cosystream", "cosystream lane-priority"]
    assert (False, False, True) in switched and (True, True, True) in switched


def test_a_joined_arm_turns_its_levers_on_together_and_builds_the_lane_for_v2(tmp_path, monkeypatch):
    """--ab first-lane+fast-start-on: one B arm with both levers on (v2's levers at once), A with both off;
    the lane is built at load although auto keeps it closed for v2."""
    from bench import __main__ as bench_main
    from engine.serving.engine import TTSEngine

    seen: list[tuple[bool, bool | None]] = []
    rule = TTSEngine._splits_first_chunk

    def splits(engine: TTSEngine, watch) -> bool:
        seen.append((engine.token2wav.first_lane, engine.cfg.stream.fast_start))
        return rule(engine, watch)

    monkeypatch.setattr(TTSEngine, "_splits_first_chunk", splits)
    arms = ab_arms(tmp_path, "first-lane+fast-start-on", "v2")
    assert arms == ["cosystream", "cosystream first-lane+fast-start-on"]
    assert seen[-4:] == [(False, None), (False, None), (True, True), (True, True)]
    assert bench_main.ab_lever_set(("first-lane+fast-start-on", "yield")) == {
        "first-lane", "fast-start-on", "yield"
    }  # fmt: skip


@pytest.mark.parametrize("ab", ["yield+yield", "yield,yield+seam", "first-lane+", "+yield", "yield,yield"])
def test_ab_refuses_a_lever_twice_or_unknown_in_a_joined_arm(ab, capsys):
    with pytest.raises(SystemExit):
        main(["--random-tiny", "v3", "--arrivals", "poisson", "--ab", ab])
    assert "a+b: one arm" in capsys.readouterr().err


def test_a_joined_arm_is_checked_lever_by_lever(capsys):
    with pytest.raises(SystemExit):
        argv = ["--random-tiny", "v3", "--arrivals", "poisson", "--fast-start", "on"]
        main([*argv, "--ab", "yield+fast-start-on"])
    assert "--ab fast-start-on" in capsys.readouterr().err


def test_the_quiet_first_flag_needs_the_deadline_order(capsys):
    with pytest.raises(SystemExit):
        main(["--random-tiny", "v3", "--t2w-fifo", "--t2w-quiet-first"])
    assert "--t2w-quiet-first" in capsys.readouterr().err


# ---------------------------------------------------------------- the steady state: windows, seeds, order


def sent_at(
    times: list[float], ttfa_ms: list[float], total_ms: float = 2000.0
) -> list[tuple[float, RequestResult]]:
    """(send s, result) pairs of streams that each lasted ``total_ms``."""
    return [
        (t, RequestResult(i, None, 0.0, ttfa, 0.1, 1.0, total_ms, 2, 0, 0.0))
        for i, (t, ttfa) in enumerate(zip(times, ttfa_ms, strict=True))
    ]


def test_windows_of_a_steady_load_are_flat_and_of_a_drifting_one_rise():
    times = [float(i) for i in range(40)]  # one a second for 40 s, each stream 2 s long
    steady = windows(sent_at(times, [100.0] * 40), span_s=40.0, window_s=10.0)
    assert [(w.start_s, w.end_s, w.requests) for w in steady] == [
        (0, 10, 10),
        (10, 20, 10),
        (20, 30, 10),
        (30, 40, 10),
    ]
    assert {(w.ttfa_p50_ms, w.ttfa_p95_ms) for w in steady} == {(100.0, 100.0)}
    # two streams in flight once the first has run 1 s; the first window starts empty
    assert [w.active_mean for w in steady] == pytest.approx([1.9, 2.0, 2.0, 2.0])
    drifting = windows(sent_at(times, [100.0 + 10 * i for i in range(40)]), span_s=40.0, window_s=10.0)
    p95 = [w.ttfa_p95_ms for w in drifting]
    assert p95 == sorted(p95) and len(set(p95)) == 4 and p95[-1] - p95[0] == pytest.approx(300.0)


def test_windows_fit_the_nominal_span_and_the_last_takes_the_stragglers():
    sent = sent_at([0.0, 5.0, 12.0, 41.5], [100.0, 200.0, 300.0, 400.0])
    failed = (3.0, RequestResult(9, "Busy: full", None, None, None, 0.0, 0.0, 0, 0, 0.0))
    underran = (31.0, RequestResult(8, None, 0.0, 50.0, 0.3, 1.0, 2000.0, 3, 1, 0.2))
    found = windows([*sent, failed, underran], span_s=40.0, window_s=15.0)  # 40 / 15 -> 3 windows
    assert [(w.start_s, w.end_s, w.requests) for w in found] == [(0, 15, 4), (15, 30, 0), (30, 41.5, 2)]
    assert (found[0].failed, found[0].ttfa_p50_ms) == (1, 200.0)  # a failed request has no TTFA
    assert found[1].ttfa_p95_ms is None and found[2].underrun_requests == 1
    (whole,) = windows(sent, span_s=5.0, window_s=30.0)  # shorter than a window: one, all of it
    assert whole.requests == 4


def test_a_rate_is_met_only_when_every_seed_meets_the_slo():
    levels = [
        level_at(2.0, 200.0, seed=0), level_at(2.0, 250.0, seed=1),
        level_at(3.0, 280.0, seed=0), level_at(3.0, 320.0, seed=1),  # seed 1 misses: 3 is missed
        level_at(4.0, 290.0, seed=0), level_at(4.0, 299.0, seed=1),
    ]  # fmt: skip
    found = capacity(levels, Slo(300.0))
    assert found["capacity_rate"] == 2.0
    assert [(r["rate"], r["met"]) for r in found["rates"]] == [(2.0, True), (3.0, False)]
    three = found["rates"][1]
    assert three["misses"] == ["seed 1: TTFA p95 320 ms > 300"] and three["requests"] == 200
    assert [(s["seed"], s["met"], s["ttfa_p95_ms"]) for s in three["seeds"]] == [
        (0, True, 280.0),
        (1, False, 320.0),
    ]
    # a fixed list measured whole: every rate listed, the capacity still below the first miss
    every = capacity(levels, Slo(300.0), all_rates=True)
    assert [(r["rate"], r["met"]) for r in every["rates"]] == [(2.0, True), (3.0, False), (4.0, True)]
    assert every["capacity_rate"] == 2.0


def test_arrival_seconds_make_the_request_count_with_min_requests_as_a_floor():
    from bench.__main__ import open_load, parse_args

    args = parse_args(["--random-tiny", "v3", "--arrivals", "poisson", "--find-capacity", "--rate", "0.5,3"])
    assert (args.arrival_s, args.window_s, args.seeds, args.warmup_arrival_s) == (120.0, 30.0, [0, 1], 0.0)
    assert open_load(args, 3.0).requests == 360  # 3/s x 120 s
    assert open_load(args, 0.5).requests == 100  # 60 arrivals, raised to --min-requests
    ab = parse_args(["--random-tiny", "v3", "--arrivals", "poisson", "--ab", "yield", "--seeds", "1,0,1"])
    assert ab.warmup_arrival_s == 20.0 and ab.seeds == [1, 0]  # an A/B warms up first; seeds once each


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--all-rates"], "--all-rates"),
        (["--seeds", "-1"], "seeds"),
        (["--arrival-s", "0"], "--arrival-s"),
        (["--window-s", "-3"], "--window-s"),
        (["--warmup-arrival-s", "-1"], "--warmup-arrival-s"),
    ],
)
def test_bad_steady_state_settings_are_refused(flags, message, capsys):
    with pytest.raises(SystemExit):
        main(["--random-tiny", "v3", "--arrivals", "poisson", *flags])
    assert message in capsys.readouterr().err


class FakeTarget:
    """A server that answers each request with one 0.5-s chunk after ``delay(n)`` s (n: requests so far),
    noting each request's seed and the A/B switch as it was when the request came."""

    name = "fake"

    def __init__(self, delay=lambda n: 0.0):
        self.delay = delay
        self.engine = types.SimpleNamespace(arm=None)
        self.seen: list[tuple[int, bool | None]] = []

    async def run(self, req, rec) -> None:
        self.seen.append((req.seed, self.engine.arm))
        await asyncio.sleep(self.delay(len(self.seen)))  # its compute time
        rec.started(0.0)
        rec.chunk(0.5)

    def peak_memory_mb(self) -> None:
        return None

    def reset_peak_memory(self) -> None:
        """Nothing to reset."""

    async def server_ttfa(self) -> None:
        return None


def fake_sweep(target: FakeTarget, flags: list[str]) -> list[Level]:
    from bench.__main__ import open_sweep, parse_args

    args = parse_args(
        ["--random-tiny", "v3", "--arrivals", "poisson", "--modes", "stream", "--warmup", "0", *flags]
    )
    return asyncio.run(open_sweep(target, args, lambda levels: None))


def test_ab_warms_up_first_then_alternates_the_first_arm_per_rate_and_seed(monkeypatch):
    from bench.__main__ import AB_SWITCHES, run_order

    monkeypatch.setitem(AB_SWITCHES, "fake", lambda engine, on: setattr(engine, "arm", on))
    target = FakeTarget()
    flags = ["--ab", "fake", "--rate", "100,200", "--arrival-s", "0.05", "--warmup-arrival-s", "0.04"]
    levels = fake_sweep(target, [*flags, "--find-capacity", "--min-requests", "1", "--slo-ttfa-ms", "1e9"])
    runs = [(lv.rate, lv.seed, lv.system) for lv in levels]
    a, b = "fake", "fake fake"
    assert runs == [
        (100.0, 0, a), (100.0, 0, b), (100.0, 1, b), (100.0, 1, a),
        (200.0, 0, a), (200.0, 0, b), (200.0, 1, b), (200.0, 1, a),
    ]  # fmt: skip
    assert run_order(levels)["order"] == [{"rate": r, "seed": s, "system": sys} for r, s, sys in runs]
    # the warm-up load (4 arrivals at the first rate, seeds 10^6 + i) came before any measured request
    assert [seed for seed, _ in target.seen[:4]] == [10**6 + i for i in range(4)]
    assert all(seed < 10**6 for seed, _ in target.seen[4:])
    # then each level's requests (its seed + i) with its arm switched: 5 a level at 100/s, 10 at 200/s
    measured = target.seen[4:]
    expect = [(lv.seed + i, lv.system == b) for lv in levels for i in range(lv.requests)]
    assert [lv.requests for lv in levels] == [5] * 4 + [10] * 4 and sorted(measured) == sorted(expect)
    assert [arm for _, arm in measured] == [arm for _, arm in expect]


def test_ab_of_two_levers_runs_a_then_each_lever_alone_reversed_every_other_run(monkeypatch):
    """--ab a,b: three arms a rate and seed (neither, a alone, b alone), the order reversed every other run
    so each arm's mean place is the same; each arm's requests see only its own lever on."""
    from bench.__main__ import AB_SWITCHES

    monkeypatch.setitem(AB_SWITCHES, "fake", lambda engine, on: setattr(engine, "fake", on))
    monkeypatch.setitem(AB_SWITCHES, "other", lambda engine, on: setattr(engine, "other", on))
    target = FakeTarget()
    seen: list[tuple[bool, bool]] = []
    run = target.run

    async def spy(req, rec) -> None:
        seen.append((target.engine.fake, target.engine.other))
        await run(req, rec)

    target.run = spy
    flags = ["--ab", "fake,other", "--rate", "100", "--arrival-s", "0.03", "--warmup-arrival-s", "0"]
    levels = fake_sweep(target, [*flags, "--find-capacity", "--min-requests", "1", "--slo-ttfa-ms", "1e9"])
    a, f, o = "fake", "fake fake", "fake other"
    assert [(lv.seed, lv.system) for lv in levels] == [(0, a), (0, f), (0, o), (1, o), (1, f), (1, a)]
    want = {a: (False, False), f: (True, False), o: (False, True)}
    assert seen == [want[lv.system] for lv in levels for _ in range(lv.requests)]


def test_closed_after_an_ab_runs_each_arms_waves_alternating_which_first_by_level(monkeypatch):
    """--closed-after with --ab: each level's waves once per arm (an untimed wave, then the timed ones),
    the arm named as in the open loop, A first at the first level and last at the next; every request of
    an arm's waves sees only its lever."""
    from bench.__main__ import AB_SWITCHES

    monkeypatch.setitem(AB_SWITCHES, "fake", lambda engine, on: setattr(engine, "fake", on))
    target = FakeTarget()
    seen: list[bool] = []
    run = target.run

    async def spy(req, rec) -> None:
        seen.append(target.engine.fake)
        await run(req, rec)

    target.run = spy
    flags = ["--ab", "fake", "--rate", "100", "--arrival-s", "0.03", "--warmup-arrival-s", "0"]
    levels = fake_sweep(target, [*flags, "--closed-after", "2,3", "--requests", "4"])
    closed = [(lv.concurrency, lv.system, lv.requests) for lv in levels if lv.rate is None]
    a, b = "fake", "fake fake"
    assert closed == [(2, a, 8), (2, b, 8), (3, b, 12), (3, a, 12)]
    waves = seen[-sum(c + n for c, _, n in closed) :]  # each arm's untimed wave (c requests), then its n
    assert waves == [arm == b for c, arm, n in closed for _ in range(c + n)]


@pytest.mark.parametrize("ab", ["fake,fake", "fake,nope", ""])
def test_ab_refuses_an_unknown_or_repeated_lever(ab, monkeypatch, capsys):
    from bench.__main__ import AB_SWITCHES

    monkeypatch.setitem(AB_SWITCHES, "fake", lambda engine, on: None)
    with pytest.raises(SystemExit):
        main(["--random-tiny", "v3", "--arrivals", "poisson", "--ab", ab])
    assert "--ab" in capsys.readouterr().err


def test_a_missed_rate_still_runs_every_seed_and_all_rates_goes_on_past_it():
    slow = ["--rate", "100,200", "--arrival-s", "0.03", "--find-capacity", "--min-requests", "1"]
    slow += ["--slo-ttfa-ms", "0.5"]  # every request takes 2 ms: every rate misses
    levels = fake_sweep(FakeTarget(lambda n: 0.002), slow)
    assert [(lv.rate, lv.seed) for lv in levels] == [(100.0, 0), (100.0, 1)]  # both seeds, then it stops
    levels = fake_sweep(FakeTarget(lambda n: 0.002), [*slow, "--all-rates"])
    assert [(lv.rate, lv.seed) for lv in levels] == [(100.0, 0), (100.0, 1), (200.0, 0), (200.0, 1)]


def test_the_prompt_spread_steps_the_requests_through_every_offset_of_the_chunk_grid():
    """--prompt-spread: 25 voices 40 ms (one speech token) apart, so the tokens from a prompt's end to the
    flow's next 25-token grid line (where the first chunk ends) take every value 0-24 once: the fast start
    (offset >= 12 at the default) then splits about half, as for random visitors; the bench's one prompt
    has offset 13. Request i clones the (i mod 25)-th; without the flag every request the one prompt."""
    from bench.load import PROMPT_SPREAD, prompt_set

    def offset(prompt: np.ndarray) -> int:  # v3's speech tokens: 25 a second (87 for 3.5 s)
        return -(len(prompt) * 25 // 24000) % 25

    assert [offset(p) for p in prompt_set()] == [13]
    spread = prompt_set(True)
    assert len(spread) == len(PROMPT_SPREAD) == 25 and sorted(offset(p) for p in spread) == list(range(25))
    assert len({round(float(np.abs(np.fft.rfft(p[:24000])).argmax())) for p in spread}) == 25  # own f0s

    class Prompts(FakeTarget):
        async def run(self, req, rec) -> None:
            self.lengths.append((req.seed, len(req.prompt_audio[0])))
            await super().run(req, rec)

    for flags, want in (([], {len(prompt_set()[0])}), (["--prompt-spread"], {len(p) for p in spread})):
        target = Prompts()
        target.lengths = []
        fake_sweep(
            target,
            ["--rate", "1000", "--arrival-s", "0.05", "--seeds", "0", "--warmup-arrival-s", "0", *flags],
        )
        assert {n for _, n in target.lengths} == want
        if flags:  # request i: seed 0 + i, the (i mod 25)-th voice
            assert all(n == len(spread[seed % 25]) for seed, n in target.lengths if seed < 10**6)


def test_the_prompt_spread_is_the_open_loops(capsys):
    with pytest.raises(SystemExit):
        main(["--random-tiny", "v3", "--prompt-spread"])
    assert "--prompt-spread" in capsys.readouterr().err


def test_ab_short_split_lowers_the_fast_starts_least_grid_offset():
    """B: the split also where the first chunk's grid offset is 8-11 tokens (min_first_hop 8); A: 12."""
    from types import SimpleNamespace

    from bench.__main__ import AB_SWITCHES
    from engine.config import EngineConfig

    engine = SimpleNamespace(family="cosyvoice3", cfg=EngineConfig(model="demo-tiny"))
    AB_SWITCHES["short-split"](engine, True)
    assert engine.cfg.stream.min_first_hop == 8
    AB_SWITCHES["short-split"](engine, False)
    assert engine.cfg.stream.min_first_hop == StreamConfig.min_first_hop == 12


def test_ab_prompt_trim_lets_every_prompt_length_split():
    """B: the flow's prompt cut by up to 12 tokens where its offset is short (fast_start_trim 12); A: 0."""
    from types import SimpleNamespace

    from bench.__main__ import AB_SWITCHES
    from engine.config import EngineConfig

    engine = SimpleNamespace(family="cosyvoice3", cfg=EngineConfig(model="demo-tiny"))
    AB_SWITCHES["prompt-trim"](engine, True)
    assert engine.cfg.stream.fast_start_trim == engine.cfg.stream.min_first_hop == 12
    AB_SWITCHES["prompt-trim"](engine, False)
    assert engine.cfg.stream.fast_start_trim == StreamConfig.fast_start_trim == 0


def test_the_trim_flag_is_checked_as_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        main(["--random-tiny", "v3", "--fast-start-trim", "13"])
    assert "--fast-start-trim" in capsys.readouterr().err


def test_a_server_that_falls_behind_shows_rising_windows():
    """Each request takes 30 ms longer than the one before: the last window's TTFA is far above the first's,
    as a queue that builds up makes it (the pure test above: a steady load's windows are flat). The level
    also records its seed and its arrivals' span."""
    prompt, workload = prompt_audio(0.1), Workload(tokens=40)
    asyncio.run(run_open_level(FakeTarget(), workload, OpenLoop(200.0, 2), prompt))  # one-time costs paid
    target = FakeTarget(lambda n: 0.03 * n)
    level = asyncio.run(run_open_level(target, workload, OpenLoop(200.0, 20), prompt, seed=3, window_s=0.025))
    assert level.seed == 3 and level.arrival_s == pytest.approx(0.1)  # 20 arrivals at 200/s
    assert len(level.windows) == 4 and sum(w.requests for w in level.windows) == 20
    assert sorted(seed for seed, _ in target.seen) == list(range(3, 23))  # request i: seed + i
    first, last = level.windows[0], level.windows[-1]
    assert first.requests and last.requests
    assert last.ttfa_p50_ms > first.ttfa_p50_ms + 200  # ~16 requests later: ~480 ms more


def test_ab_own_stream_moves_the_main_workers_calls_per_arm():
    """B: the main token2wav worker's calls on its own stream (read per batch); A: the default stream."""
    from types import SimpleNamespace

    from bench.__main__ import AB_SWITCHES, parse_args

    engine = SimpleNamespace(token2wav=SimpleNamespace(own_stream=False))
    AB_SWITCHES["own-stream"](engine, True)
    assert engine.token2wav.own_stream
    AB_SWITCHES["own-stream"](engine, False)
    assert not engine.token2wav.own_stream
    assert parse_args(["--random-tiny", "v3", "--arrivals", "poisson", "--ab", "own-stream"]).ab == (
        "own-stream",
    )


def test_ab_host_prefix_builds_the_hosts_table_for_both_arms_and_switches_its_use():
    """--ab host-prefix: the engine is built with the LM's host table (EngineConfig.lm_host_prefix, the
    default), even where --no-lm-host-prefix came before; then B gathers from it and A looks up on the
    device."""
    from types import SimpleNamespace

    from bench.__main__ import AB_SWITCHES, engine_config, parse_args

    argv = ["--random-tiny", "v3", "--arrivals", "poisson"]
    assert engine_config(parse_args(argv)).lm_host_prefix
    assert not engine_config(parse_args([*argv, "--no-lm-host-prefix"])).lm_host_prefix
    assert engine_config(parse_args([*argv, "--no-lm-host-prefix", "--ab", "host-prefix"])).lm_host_prefix
    engine = SimpleNamespace(host_prefix=False)
    AB_SWITCHES["host-prefix"](engine, True)
    assert engine.host_prefix
    AB_SWITCHES["host-prefix"](engine, False)
    assert not engine.host_prefix


def test_ab_gil_switch_sets_the_interpreters_interval_per_arm():
    """B: 1 ms; A: the engine's configured interval, else Python's 5 ms; --gil-switch-ms reaches it."""
    import sys
    from types import SimpleNamespace

    from bench.__main__ import AB_SWITCHES, engine_config, parse_args

    before = sys.getswitchinterval()
    try:
        for configured, a_ms in ((None, 5.0), (2.0, 2.0)):
            engine = SimpleNamespace(cfg=SimpleNamespace(gil_switch_ms=configured))
            AB_SWITCHES["gil-switch"](engine, True)
            assert sys.getswitchinterval() == pytest.approx(0.001)
            AB_SWITCHES["gil-switch"](engine, False)
            assert sys.getswitchinterval() == pytest.approx(a_ms / 1000.0)
    finally:
        sys.setswitchinterval(before)
    argv = ["--random-tiny", "v3", "--arrivals", "poisson"]
    assert engine_config(parse_args(argv)).gil_switch_ms is None
    assert engine_config(parse_args([*argv, "--gil-switch-ms", "0.5"])).gil_switch_ms == 0.5


def test_ab_kept_prompts_keeps_voices_in_b_and_the_engines_setting_in_a():
    from types import SimpleNamespace

    import torch

    from bench.__main__ import AB_SWITCHES, KEPT_PROMPTS_AB, engine_config, parse_args
    from engine.serving.kept_prompts import KeptPrompts

    for configured in (0, 8):
        prompts = KeptPrompts(torch.device("cpu"), configured)
        engine = SimpleNamespace(
            token2wav=SimpleNamespace(prompts=prompts), cfg=SimpleNamespace(t2w_kept_prompts=configured)
        )
        AB_SWITCHES["kept-prompts"](engine, True)
        assert prompts.size == KEPT_PROMPTS_AB
        AB_SWITCHES["kept-prompts"](engine, False)
        assert prompts.size == configured
    argv = ["--random-tiny", "v3", "--arrivals", "poisson"]
    assert engine_config(parse_args(argv)).t2w_kept_prompts == 0
    assert engine_config(parse_args([*argv, "--t2w-kept-prompts", "16"])).t2w_kept_prompts == 16


def test_ab_prompt_in_frontend_moves_the_copies_in_b_and_keeps_the_engines_setting_in_a():
    from types import SimpleNamespace

    from bench.__main__ import AB_SWITCHES, engine_config, parse_args

    for configured in (False, True):
        engine = SimpleNamespace(
            prompt_in_frontend=configured, cfg=SimpleNamespace(t2w_prompt_in_frontend=configured)
        )
        AB_SWITCHES["prompt-in-frontend"](engine, True)
        assert engine.prompt_in_frontend
        AB_SWITCHES["prompt-in-frontend"](engine, False)
        assert engine.prompt_in_frontend is configured
    argv = ["--random-tiny", "v3", "--arrivals", "poisson"]
    assert not engine_config(parse_args(argv)).t2w_prompt_in_frontend
    assert engine_config(parse_args([*argv, "--t2w-prompt-in-frontend"])).t2w_prompt_in_frontend
