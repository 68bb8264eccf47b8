"""bench.overlap: its arithmetic on hand-made timelines, and a whole run on a tiny model (CPU, native LM)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.__main__ import engine_config, random_model
from bench.overlap import (
    Both,
    Call,
    FlowRun,
    LmRun,
    Timing,
    calls_of,
    flow_run,
    lm_profiles,
    lm_run,
    main,
    markdown,
    parse_args,
    slowdowns,
)
from engine.serving.metrics import ChunkTimes


def test_an_lm_level_gives_each_decodes_step_the_gaps_and_tokens_per_second():
    # round 1 starts at 0 s: decode a gets tokens at 10, 12, 14 ms, decode b at 11 and 15 ms;
    # round 2 starts at 1 s: a single token for a (no step), three for b 3 ms apart
    rounds = [(0.0, [[0.010, 0.012, 0.014], [0.011, 0.015]]), (1.0, [[1.020], [1.005, 1.008, 1.011]])]
    run = lm_run(2, rounds)
    assert (run.sessions, run.rounds, run.tokens) == (2, 2, 9)
    assert run.step_ms.n == 3 and run.step_ms.mean == pytest.approx((2.0 + 4.0 + 3.0) / 3)
    assert run.gap_ms.n == 5 and run.gap_ms.max == pytest.approx(4.0)
    assert run.first_token_ms.p50 == pytest.approx(10.5)  # 10, 11, 20, 5 ms after their round's start
    assert run.wall_s == pytest.approx(0.015 + 0.020)  # each round to its last token
    assert run.tokens_per_s == pytest.approx(9 / 0.035)


def test_flow_rows_taken_together_make_one_call():
    def row(joined: float, flow_done: float, vocoded: float) -> ChunkTimes:
        return ChunkTimes(0.0, 0.0, joined=joined, flow_done=flow_done, vocoded=vocoded)

    times = [row(1.0, 1.10, 1.20), row(1.0, 1.10, 1.25), row(2.0, 2.05, 2.08), ChunkTimes(0.0, 0.0)]
    calls = calls_of(times)  # the last row never ran: no call
    assert calls == [Call(1.0, 1.10, 1.25, 2), Call(2.0, 2.05, 2.08, 1)]
    run = flow_run(2, 250, calls)
    assert (run.batch, run.tokens, run.calls, run.rows) == (2, 250, 2, 1.5)
    assert run.call_ms.mean == pytest.approx((250 + 80) / 2) and run.call_ms.max == pytest.approx(250)
    assert run.flow_ms.p50 == pytest.approx((100 + 50) / 2)
    assert run.vocoder_ms.mean == pytest.approx((150 + 30) / 2)


def lm(sessions: int, step: float) -> LmRun:
    t = Timing.of([step])
    return LmRun(sessions, 1, 250 * sessions, 1.0, 250.0 * sessions, t, t, t)


def flow(batch: int, call: float) -> FlowRun:
    t = Timing.of([call])
    return FlowRun(batch, 250, 3, float(batch), t, t, t)


def test_slowdowns_compare_each_pair_with_its_parts_alone_and_the_report_shows_them():
    alone_lm, alone_flow = [lm(1, 2.0), lm(16, 4.0)], [flow(1, 50.0), flow(16, 300.0)]
    pairs = [Both(lm(1, 5.0), flow(16, 330.0)), Both(lm(16, 4.4), flow(1, 100.0))]
    rows = slowdowns(alone_lm, alone_flow, pairs)
    assert [(r.sessions, r.batch) for r in rows] == [(1, 16), (16, 1)]
    assert rows[0].lm_ratio == pytest.approx(2.5) and rows[0].flow_ratio == pytest.approx(1.1)
    assert rows[1].lm_ratio == pytest.approx(1.1) and rows[1].flow_ratio == pytest.approx(2.0)
    missing = slowdowns([], alone_flow, pairs[:1])[0]  # no LM-alone run at that level: no ratio
    assert missing.lm_step_alone is None and missing.lm_ratio is None and missing.flow_ratio is not None
    no_flow = slowdowns(alone_lm, [], pairs[:1])[0]
    assert no_flow.flow_call_alone is None and no_flow.flow_rows_alone is None and no_flow.flow_ratio is None
    result = {
        "meta": {"arm": "mps", "model": "m", "tokens": 250, "flow_tokens": 250},
        "slowdowns": [r.row() for r in rows],
    }
    text = markdown(result)
    assert "arm mps" in text
    assert "| 1 | 16 | 2.0 | 5.0 | 2.50x | 300.0 | 330.0 | 1.10x | 16.0 / 16.0 |" in text
    assert "| 16 | 1 | 4.0 | 4.4 | 1.10x | 50.0 | 100.0 | 2.00x | 1.0 / 1.0 |" in text


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        parse_args(["--random-tiny", "v2", "--concurrency", "1,4", "--flow-batches", "1,16"])  # > slots
    with pytest.raises(SystemExit):
        parse_args(["--random-tiny", "v2", "--url", "http://127.0.0.1:1"])
    with pytest.raises(SystemExit):
        parse_args(["--random-tiny", "v2", "--rounds", "0"])
    args = parse_args(["--random-tiny", "v2", "--concurrency", "1,16", "--tokens", "100", "--cuda-mps"])
    assert args.modes == ["stream"] and args.cuda_mps and args.lm_levels == [1, 16]
    assert args.graph_warmup_s >= 250 / 25  # the flow rows' call is captured too


def test_a_tiny_run_measures_every_phase_and_writes_the_report(tmp_path: Path):
    cache = tmp_path / "cache"
    random_model("cosyvoice2", "tiny", cache)
    out = tmp_path / "out"
    argv = [
        "--random-tiny", "v2", "--device", "cpu", "--backend", "native", "--cache-dir", str(cache),
        "--concurrency", "1,2", "--tokens", "20", "--requests", "2", "--lm-levels", "1,2", "--flow-batches",
        "1,2", "--flow-tokens", "20", "--rounds", "2", "--flow-calls", "2", "--arm", "tiny",
        "--out", str(out),
    ]  # fmt: skip
    main(argv)
    result = json.loads((out / "results.json").read_text())
    assert result["meta"]["complete"] and result["meta"]["arm"] == "tiny"
    for run in result["lm_alone"] + [b["lm"] for b in result["both"]]:
        assert run["tokens"] == run["sessions"] * run["rounds"] * 20  # forced length: every token came
        assert run["step_ms"]["n"] == run["sessions"] * run["rounds"] and run["tokens_per_s"] > 0
    for run in result["flow_alone"] + [b["flow"] for b in result["both"]]:
        assert run["calls"] >= 2 and 1 <= run["rows"] <= run["batch"] and run["call_ms"]["mean"] > 0
    assert [(r["sessions"], r["batch"]) for r in result["slowdowns"]] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert all(r["lm_ratio"] > 0 and r["flow_ratio"] > 0 for r in result["slowdowns"])
    assert all(r["flow_rows_alone"] == r["flow_rows_with_lm"] == r["batch"] for r in result["slowdowns"])
    assert [lv["concurrency"] for lv in result["e2e"]] == [1, 2] and not any(
        lv["failed"] for lv in result["e2e"]
    )
    text = (out / "results.md").read_text()
    assert text.count("\n| 1 | ") >= 3 and "stream bench: streams" in text  # pairs, LM, flow and e2e rows


def test_lm_profile_needs_vllm_and_lands_beside_the_results(tmp_path: Path):
    base = ["--random-tiny", "v2", "--out", str(tmp_path / "o")]
    with pytest.raises(SystemExit):
        parse_args([*base, "--lm-profile"])  # the native LM has no engine core to profile
    args = parse_args([*base, "--lm-profile", "--backend", "vllm"])
    assert args.lm_profile_dir == str(tmp_path / "o" / "lm_profile")
    assert engine_config(args).lm_profile_dir == args.lm_profile_dir
    assert engine_config(parse_args(base)).lm_profile_dir is None


async def test_each_lm_level_is_profiled_alone_and_its_table_kept(tmp_path: Path):
    """Around one round of each level: the profiler on, the round, the profiler off; vLLM's table copied
    to OUT/lm_profile_cN.txt with the round's engine steps beside it."""
    events: list[str] = []

    class Backend:  # stands in for VLLMBackend's profiler hooks
        async def start_profile(self) -> None:
            events.append("start")

        async def stop_profile(self) -> Path:
            events.append("stop")
            table = tmp_path / "lm_profile" / "profiler_out_0.txt"
            table.parent.mkdir(exist_ok=True)
            table.write_text(f"kernels after {events.count('stop')} rounds")
            return table

    class Probe:
        async def lm_level(self, sessions: int, tokens: int, rounds: int, seed: int) -> LmRun:
            events.append(f"round {sessions}x{tokens}x{rounds}")
            stamps = [[0.01 + 0.003 * i for i in range(tokens)] for _ in range(sessions)]
            return lm_run(sessions, [(0.0, stamps)])

    args = parse_args(["--random-tiny", "v2", "--tokens", "30", "--lm-levels", "1,2", "--out", str(tmp_path)])
    got = await lm_profiles(Backend(), Probe(), args)
    assert events == ["start", "round 1x30x1", "stop", "start", "round 2x30x1", "stop"]
    assert [(p["decodes"], p["table"], p["steps"]) for p in got] == [
        (1, "lm_profile_c1.txt", 30), (2, "lm_profile_c2.txt", 30)
    ]  # fmt: skip
    assert (tmp_path / "lm_profile_c2.txt").read_text() == "kernels after 2 rounds"
