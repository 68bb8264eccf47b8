"""The bench harness on a tiny random-weight model (CPU, seconds): CLI end to end, HTTP target, baseline,
and the accounting (percentiles, underruns, client-side timing) on synthetic inputs."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from bench.__main__ import main, random_model
from bench.baseline import ReferenceStyle
from bench.load import (
    EngineTarget,
    HttpTarget,
    Recorder,
    Workload,
    paced_words,
    percentile,
    prompt_audio,
    read_events,
    run_level,
    underruns,
)
from bench.report import markdown
from engine.config import EngineConfig, Limits
from engine.serving.engine import TTSEngine
from engine.serving.metrics import TTFA_PARTS

TOKENS = 60  # streamed: a first chunk at 25 + pad + 3 tokens (pad 13 for the 3.5 s prompt), then the final
CLI_TOKENS = 30  # one chunk, or the fast start's two (13 + 17): keeps the CLI sweep (12 requests) short


# ------------------------------------------------------------------------------------------- the math


def test_percentile_interpolates_between_order_statistics():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert percentile([4.0, 1.0, 3.0, 2.0], 95) == pytest.approx(3.85)  # 1 + (n-1) * 0.95
    assert percentile([1.0, 2.0, 3.0, 4.0], 0) == 1.0 and percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    assert percentile([7.0], 99) == 7.0 and percentile([], 50) is None
    sample = list(np.random.default_rng(0).exponential(size=37))
    for q in (1, 50, 95, 99):
        assert percentile(sample, q) == pytest.approx(float(np.percentile(sample, q)))
    with pytest.raises(ValueError, match="within"):
        percentile([1.0], 101)


def test_underruns_count_stalls_of_a_player_that_waits_and_resumes():
    on_time = [(0.0, 1.0), (0.5, 1.0), (1.9, 1.0), (2.99, 1.0)]
    assert underruns(on_time) == (0, 0.0)
    count, stalled = underruns([(0.0, 1.0), (1.5, 1.0), (2.4, 1.0)])  # 2nd is 0.5 s late, 3rd then on time
    assert count == 1 and stalled == pytest.approx(0.5)
    count, stalled = underruns([(0.0, 0.5), (1.0, 0.5), (2.0, 0.5)])  # the clock restarts after each stall
    assert count == 2 and stalled == pytest.approx(1.0)
    count, _ = underruns([(0.0, 1.0), (0.2, 0.0), (9.0, 0.0)])  # empty end markers are not audio
    assert count == 0
    assert underruns([(3.0, 1.0), (3.9, 1.0)]) == (0, 0.0)  # playback starts at the first arrival


def test_recorder_times_a_request_from_the_client_side():
    ticks = iter([10.0, 10.2, 10.5, 11.0, 11.5, 11.6])
    rec = Recorder(clock=lambda: next(ticks))  # submit at 10.0
    rec.started()  # 10.2: 200 ms in the queue
    rec.chunk(0.4)  # 10.5: first audio
    rec.chunk(1.0)  # 11.0: the first 0.4 s ran out at 10.9 -> 0.1 s stall
    rec.chunk(0.0)  # 11.5: end marker
    res = rec.result(3)
    assert res.ok and res.index == 3 and res.chunks == 2
    assert res.queue_wait_ms == pytest.approx(200.0) and res.ttfa_ms == pytest.approx(500.0)
    assert res.audio_s == pytest.approx(1.4) and res.rtf == pytest.approx(1.0 / 1.4)  # queue included
    assert res.underruns == 1 and res.underrun_s == pytest.approx(0.1)


# ------------------------------------------------------------------------------------ tiny model runs


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bench-cache")
    random_model("cosyvoice2", "tiny", root)
    return root


@pytest.fixture(scope="module")
def engine(cache):
    model = random_model("cosyvoice2", "tiny", cache)  # reused: built once by the cache fixture
    cfg = EngineConfig(
        model=str(model), device="cpu", backend="native", voices_dir=str(cache / "voices"), limits=Limits()
    )
    eng = TTSEngine.load(cfg)
    eng.ready = True
    yield eng
    eng.close()


def test_cli_sweeps_both_modes_and_writes_json_markdown_and_plot(cache, tmp_path):
    out = tmp_path / "out"
    argv = [
        "--random-tiny",
        "v2",
        "--cache-dir",
        str(cache),
        "--concurrency",
        "1,2",
        "--tokens",
        str(CLI_TOKENS),
    ]
    paths = main([*argv, "--modes", "stream,offline", "--out", str(out), "--warmup", "0", "--baseline"])
    result = json.loads(paths["json"].read_text())
    assert result["meta"]["tokens"] == CLI_TOKENS and result["meta"]["device"] == "cpu"
    assert result["meta"]["complete"] is True
    assert result["meta"]["device_peak_mb_load"] == result["meta"]["device_peak_mb_warmup"] == 0.0  # CPU
    got = {(lv["system"], lv["mode"], lv["concurrency"]) for lv in result["levels"]}
    want = {(s, m, c) for s in ("cosystream", "baseline") for m in ("stream", "offline") for c in (1, 2)}
    assert got == want
    for lv in result["levels"]:
        check_level(lv)
    md = paths["markdown"].read_text()
    assert md == markdown(result) and "## cosystream · stream" in md and "Ratio to the reference" in md
    assert md.count("Where the time to first audio went") == 2  # cosystream stream and offline
    assert md.count("| 2 | 2 | 0 |") == 4  # one c=2 row per system x mode, no failures
    assert paths["plot"].stat().st_size > 10_000 and paths["plot"].read_bytes()[:4] == b"\x89PNG"


def test_offline_levels_and_profiled_levels_can_differ_from_the_streaming_ones(cache, tmp_path):
    """One process, one load: stream at 1 and 2, offline at 3, a profile at 2 only (the H200 recipe's
    arm: streaming levels, offline 64 and 128, a profile at 16)."""
    argv = ["--random-tiny", "v2", "--cache-dir", str(cache), "--tokens", str(CLI_TOKENS), "--warmup", "0"]
    prof = tmp_path / "prof"
    levels = ["--concurrency", "1,2", "--offline-concurrency", "3", "--profile-at", "2"]
    paths = main([*argv, *levels, "--out", str(tmp_path / "o"), "--profile-dir", str(prof)])
    result = json.loads(paths["json"].read_text())
    got = {(lv["mode"], lv["concurrency"]) for lv in result["levels"]}
    assert got == {("stream", 1), ("stream", 2), ("offline", 3)}
    assert next(lv for lv in result["levels"] if lv["mode"] == "offline")["failed"] == 0
    assert [p.name for p in prof.iterdir()] == ["profile_c2.md"]
    with pytest.raises(SystemExit):
        main([*argv, "--concurrency", "1", "--profile-at", "2", "--out", str(tmp_path / "x")])


def test_a_run_cut_short_keeps_the_levels_it_finished(cache, tmp_path, monkeypatch):
    """Results are written after every level: the GPU lease's time limit cut two H200 runs after levels
    that were then lost. Here the second level dies; the first is on disk, marked incomplete."""
    import bench.__main__ as bench_main

    real, calls = bench_main.run_level, []

    async def dies_on_the_second(*args, **kw):
        calls.append(args[2])
        if len(calls) == 2:
            raise RuntimeError("the lease ran out")
        return await real(*args, **kw)

    monkeypatch.setattr(bench_main, "run_level", dies_on_the_second)
    out = tmp_path / "out"
    argv = ["--random-tiny", "v2", "--cache-dir", str(cache), "--concurrency", "1,2", "--tokens", "30"]
    with pytest.raises(RuntimeError, match="lease"):
        main([*argv, "--modes", "stream", "--warmup", "0", "--out", str(out)])
    result = json.loads((out / "results.json").read_text())
    assert result["meta"]["complete"] is False and [lv["concurrency"] for lv in result["levels"]] == [1]
    assert "| 1 | 1 | 0 |" in (out / "results.md").read_text() and not (out / "results.png").exists()
    assert not (out / "results.json.tmp").exists()


def check_level(lv: dict) -> None:
    c, audio = lv["concurrency"], CLI_TOKENS / 25.0  # v2 keeps every token: 30 tokens = 1.2 s
    assert lv["requests"] == c and lv["failed"] == 0 and lv["errors"] == []
    assert lv["audio_s"] == pytest.approx(c * audio)
    assert lv["audio_s_per_s"] == pytest.approx(lv["audio_s"] / lv["wall_s"])
    t, r = lv["ttfa_ms"], lv["rtf"]
    assert 0 < t["p50"] <= t["p95"] <= t["p99"] <= t["max"] <= lv["wall_s"] * 1000
    assert 0 < r["p50"] <= r["p95"] <= r["p99"]
    assert lv["underruns"] >= lv["underrun_requests"] and lv["underrun_s"] >= 0
    assert lv["peak_device_memory_mb"] == 0.0 and lv["host_peak_rss_mb"] > 0
    for req in lv["per_request"]:
        assert req["audio_s"] == pytest.approx(audio) and req["queue_wait_ms"] >= 0
        # too short for a second chunk but for the fast start's split (the bench's prompt: offset 13), which
        # the engine's streams take (the requests of a level start within its burst rule), the baseline not;
        # a gap can only fall between two chunks (whether it does is the CPU's speed: not asserted)
        split = lv["system"] == "cosystream" and lv["mode"] == "stream"
        assert req["chunks"] == (2 if split else 1) and req["underruns"] <= req["chunks"] - 1
    if lv["system"] == "cosystream":
        assert lv["stage_ms_mean"]["flow"] > 0 and lv["stage_ms_mean"]["hift"] > 0
        parts = lv["ttfa_parts_ms_mean"]
        assert list(parts) == ["queue", "frontend", "lm", "t2w_wait", "t2w_compute"]
        ttfas = [r["ttfa_ms"] for r in lv["per_request"]]
        assert 0 < sum(parts.values()) <= sum(ttfas) / len(ttfas)  # client-side TTFA adds the hand-over
    else:
        assert lv["ttfa_parts_ms_mean"] == {}  # the baseline keeps no engine milestones


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "offline"])
async def test_baseline_computes_the_same_audio_as_the_engine(engine, stream, monkeypatch):
    """Same weights, sampler, seeds and chunk schedule: the reference-style path must match sample for
    sample, so the ratios compare the serving strategy and nothing else. (v2's split first chunk moves one
    vocoder seam, so the engine keeps the reference's first chunk here; v3's split is exact.)"""
    reference = replace(engine.cfg.stream, fast_start=False)
    monkeypatch.setattr(engine, "cfg", replace(engine.cfg, stream=reference))
    req = Workload(tokens=TOKENS, stream=stream).request(seed=7, prompt=prompt_audio())
    ours, _ = await engine.synthesize(req)
    pieces: list[np.ndarray] = []
    ReferenceStyle(engine, poll_s=0.01).synthesize(req, pieces.append)
    assert len(pieces) == (2 if stream else 1)
    np.testing.assert_allclose(np.concatenate(pieces), ours, atol=1e-5)


async def test_baseline_serves_one_request_at_a_time(engine):
    target = ReferenceStyle(engine, poll_s=0.01)
    level = await run_level(target, Workload(tokens=30, stream=False), 2, 2, prompt_audio())
    first, second = sorted(level.per_request, key=lambda r: r.queue_wait_ms or 0.0)
    assert level.failed == 0 and first.queue_wait_ms == pytest.approx(0.0, abs=50.0)
    assert second.queue_wait_ms is not None and second.queue_wait_ms >= 0.8 * first.total_ms


async def test_http_target_streams_pcm_from_a_live_server(engine):
    from api.app import build_api
    from tests.api.support import live_server

    with live_server(build_api(engine, Limits(), api_key="")) as url:
        target = HttpTarget(url, max_connections=2)
        try:
            workload = Workload(tokens=TOKENS, text="Hi there.")  # the API has no forced length: short text
            level = await run_level(target, workload, 2, 2, prompt_audio())
        finally:
            await target.aclose()
    assert level.system == "cosystream-http" and level.failed == 0, level.errors
    assert level.peak_device_memory_mb is None
    # the server's own TTFA, read from its /metrics: positive and under what the client waited
    assert level.server_ttfa_ms_mean is not None and level.ttfa_ms["mean"] is not None
    assert 0 < level.server_ttfa_ms_mean < level.ttfa_ms["mean"]
    for req in level.per_request:
        assert req.audio_s > 0 and req.audio_s * 24000 == pytest.approx(round(req.audio_s * 24000))
        assert req.queue_wait_ms is not None and req.ttfa_ms is not None and req.rtf is not None
        assert 0 <= req.queue_wait_ms <= req.ttfa_ms <= req.total_ms


async def test_a_server_allowing_forced_tokens_gives_every_http_request_the_bench_length(engine):
    """So ``bench --url`` measures fixed compute, as in process (bench/gpu/run.sh serve allows it)."""
    from api.app import build_api
    from tests.api.support import live_server

    with live_server(build_api(engine, Limits(forced_tokens=True), api_key="")) as url:
        target = HttpTarget(url, max_connections=2)
        try:
            level = await run_level(target, Workload(tokens=TOKENS), 2, 2, prompt_audio())
        finally:
            await target.aclose()
    assert level.failed == 0, level.errors
    assert [r.audio_s for r in level.per_request] == pytest.approx([TOKENS / 25] * 2, abs=0.04)


async def test_http_target_over_sse_gives_each_request_the_servers_ttfa_parts(engine):
    """``sse``: the same audio as base64 events, and the last event's metrics (what bench.startup keeps of
    each first request: where its TTFA went)."""
    from api.app import build_api
    from tests.api.support import live_server

    with live_server(build_api(engine, Limits(forced_tokens=True), api_key="")) as url:
        target = HttpTarget(url, max_connections=1, sse=True)
        try:
            level = await run_level(target, Workload(tokens=TOKENS), 2, 1, prompt_audio())
        finally:
            await target.aclose()
    assert level.failed == 0, level.errors
    for req in level.per_request:
        assert req.audio_s == pytest.approx(TOKENS / 25, abs=0.04) and req.chunks >= 2  # streamed in pieces
        assert set(req.ttfa_parts_ms) == set(TTFA_PARTS) and all(v >= 0 for v in req.ttfa_parts_ms.values())
        assert sum(req.ttfa_parts_ms.values()) <= req.ttfa_ms  # the server's part of what the client waited
        assert req.stage_ms["lm"] > 0


async def test_an_sse_stream_that_ends_in_an_error_or_without_its_last_event_fails_the_request():
    async def lines(*events: dict) -> AsyncIterator[str]:
        for event in events:
            yield f"data: {json.dumps(event)}"
            yield ""

    delta = {"type": "speech.audio.delta", "audio": base64.b64encode(bytes(480)).decode()}
    rec = Recorder()
    with pytest.raises(RuntimeError, match="engine_failed"):
        await read_events(lines(delta, {"type": "error", "error": {"code": "engine_failed"}}), rec, 24000)
    assert rec.result(0).audio_s == pytest.approx(0.01)  # what came before the error is counted
    with pytest.raises(RuntimeError, match=r"without its speech\.audio\.done"):
        await read_events(lines(delta), Recorder(), 24000)


def test_profile_dir_writes_a_stage_and_operator_summary_per_streaming_level(cache, tmp_path):
    argv = ["--random-tiny", "v2", "--cache-dir", str(cache), "--concurrency", "1,2", "--tokens"]
    prof = tmp_path / "prof"
    main(
        [
            *argv,
            str(CLI_TOKENS),
            "--modes",
            "stream",
            "--out",
            str(tmp_path / "o"),
            "--profile-dir",
            str(prof),
        ]
    )
    assert sorted(p.name for p in prof.iterdir()) == ["profile_c1.md", "profile_c2.md"]
    text = (prof / "profile_c2.md").read_text()
    assert text.startswith("# Profile: 2 streams, 2 requests, stream")
    stages = {row.split(" | ")[0].strip("| "): row for row in text.splitlines() if row.startswith("| t2w.")}
    assert {"t2w.flow", "t2w.hift"} <= set(stages)  # v2 vocodes request by request
    assert int(stages["t2w.flow"].split(" | ")[1]) >= 1
    flow_calls = next(ln for ln in text.splitlines() if ln.startswith("- t2w.flow: "))
    per_call = [float(ms) for ms in flow_calls.removeprefix("- t2w.flow: ").split(", ")]
    assert len(per_call) == int(stages["t2w.flow"].split(" | ")[1]) and min(per_call) > 0
    assert "## Top operators by self host time" in text and "aten::" in text


def test_each_level_starts_a_new_device_memory_peak(engine):
    """The level's peak is its own: the target's peak is reset before the level's first request."""
    calls = []

    class Spy(EngineTarget):
        def reset_peak_memory(self) -> None:
            calls.append("reset")
            super().reset_peak_memory()

        def peak_memory_mb(self) -> float | None:
            calls.append("peak")
            return super().peak_memory_mb()

    level = asyncio.run(run_level(Spy(engine), Workload(tokens=CLI_TOKENS), 1, 1, prompt_audio()))
    assert calls == ["reset", "peak"] and level.peak_device_memory_mb == 0.0


def test_the_engine_knob_flags_reach_the_engine_config(tmp_path):
    """Each before/after flag changes exactly its EngineConfig field; without flags, the engine's defaults."""
    from bench.__main__ import engine_config, parse_args
    from engine.config import EngineConfig

    base = ["--random-tiny", "v3", "--concurrency", "1,4", "--cache-dir", str(tmp_path)]
    plain = engine_config(parse_args(base))
    flags = ["--no-cuda-graphs", "--no-hift-graphs", "--flow-batch", "1", "--prompt-cache", "0"]
    flags += ["--no-t2w-own-stream", "--fast-start", "off", "--flow-dtype", "float32"]
    flags += ["--no-flow-compile", "--no-flow-reuse"]
    flags += ["--adaptive-hop", "on", "--text-workers", "2", "--t2w-fifo", "--t2w-relaxed-cap", "off"]
    flags += ["--cuda-mps", "--mps-flow-percent", "60", "--no-ras-graphs", "--lm-kv-cache-gib", "8"]
    flags += ["--no-t2w-yield"]
    knobs = engine_config(parse_args([*base, *flags]))
    quiet = engine_config(parse_args([*base, "--t2w-quiet-first"]))
    assert engine_config(parse_args([*base, "--t2w-first-lane"])).t2w_first_lane is True
    assert engine_config(parse_args([*base, "--no-t2w-first-lane"])).t2w_first_lane is False
    assert plain.t2w_first_lane is None is EngineConfig().t2w_first_lane  # auto: on where graphs replay
    assert engine_config(parse_args([*base, "--t2w-lane-priority"])).t2w_lane_priority
    assert not plain.t2w_lane_priority and not EngineConfig().t2w_lane_priority  # off until measured
    hosted = engine_config(parse_args([*base, "--lm-host"]))
    assert hosted.lm_host and not plain.lm_host  # off without the flag: the engine's default
    defaults = EngineConfig()
    assert (plain.cuda_graphs, plain.hift_graphs, plain.flow_batch, plain.flow_dtype) == (
        defaults.cuda_graphs, defaults.hift_graphs, defaults.flow_batch, defaults.flow_dtype
    )  # fmt: skip
    assert plain.stream.fast_start is defaults.stream.fast_start and plain.limits.max_concurrency == 4
    assert (knobs.cuda_graphs, knobs.hift_graphs, knobs.flow_batch, knobs.prompt_cache_size) == (
        False,
        False,
        1,
        0,
    )
    assert (knobs.t2w_own_stream, knobs.stream.fast_start, knobs.flow_dtype) == (False, False, "float32")
    assert plain.t2w_own_stream is defaults.t2w_own_stream is True
    assert (plain.flow_compile, knobs.flow_compile) == (defaults.flow_compile, False)
    assert (plain.flow_reuse, knobs.flow_reuse) == (defaults.flow_reuse, False)
    assert (plain.stream.adaptive_hop, plain.text_workers) == (defaults.stream.adaptive_hop, None)
    assert (knobs.stream.adaptive_hop, knobs.text_workers, knobs.t2w_fifo) == (True, 2, True)
    assert plain.t2w_fifo is defaults.t2w_fifo is False
    assert (plain.t2w_relaxed_cap, knobs.t2w_relaxed_cap) == (defaults.t2w_relaxed_cap, False)
    assert defaults.t2w_relaxed_cap is None  # auto: while a stream has little audio buffered
    assert (plain.t2w_yield_to_urgent, knobs.t2w_yield_to_urgent) == (True, False)
    assert defaults.t2w_yield_to_urgent is True
    assert (plain.t2w_quiet_first, quiet.t2w_quiet_first) == (False, True) and not defaults.t2w_quiet_first
    alone = engine_config(parse_args([*base, "--t2w-relaxed-cap"]))  # the flag alone: always
    assert alone.t2w_relaxed_cap is True
    assert (plain.cuda_mps, knobs.cuda_mps) == (defaults.cuda_mps, True) and defaults.cuda_mps is None  # auto
    assert (plain.mps_flow_percent, knobs.mps_flow_percent) == (None, 60)
    assert (plain.lm_ras_graphs, knobs.lm_ras_graphs) == (
        defaults.lm_ras_graphs,
        False,
    ) and defaults.lm_ras_graphs
    assert (plain.lm_kv_cache_gib, knobs.lm_kv_cache_gib) == (6.0, 8.0) and defaults.lm_kv_cache_gib == 6.0
    assert plain.lm_handover is False  # every request measured on vLLM (no native loop while it starts)


def test_text_stream_feeds_words_at_a_rate_and_reports_ttfa_from_the_first_word(cache, tmp_path):
    argv = ["--random-tiny", "v2", "--cache-dir", str(cache), "--concurrency", "1,2", "--tokens", "60"]
    argv += ["--modes", "stream", "--out", str(tmp_path / "out"), "--warmup", "0", "--text-stream", "40"]
    result = json.loads(main(argv)["json"].read_text())
    assert result["meta"]["text_stream_wps"] == 40.0
    assert [lv["concurrency"] for lv in result["levels"]] == [1, 2]
    for lv in result["levels"]:
        assert lv["failed"] == 0 and lv["ttfa_ms"]["p50"] > 0
        for r in lv["per_request"]:
            assert r["audio_s"] >= 60 / 25 - 0.05  # at least the forced length: bistream may speak more


async def test_paced_words_rebuild_the_text():
    workload = Workload(tokens=100, text_wps=1000)
    words = workload.live_words()
    assert len(words) == 10 and words[0] == workload.text.split()[0]
    got = [w async for w in paced_words(words, 1000)]
    assert "".join(got) == " ".join(words)
    req = workload.request(1, np.zeros(10, np.float32))
    assert req.text_stream is not None and req.text == ""


def test_graph_warmup_covers_the_longest_request_and_the_prompt_unless_given(tmp_path):
    from bench.__main__ import engine_config, parse_args
    from engine.config import EngineConfig

    base = ["--random-tiny", "v3", "--cache-dir", str(tmp_path), "--concurrency", "4"]
    closed = engine_config(parse_args(base))  # 10 s requests and a 3.5 s prompt fit the default 16 s
    assert closed.graph_warmup_s == EngineConfig.graph_warmup_s
    # open loop, 250 tokens +-50 %: the longest is 15 s of audio after the 3.5 s prompt, + a bucket of margin
    opened = engine_config(
        parse_args([*base, "--arrivals", "poisson", "--tokens", "250", "--admit-slack-s", "1.5"])
    )
    assert opened.graph_warmup_s == 15.0 + 3.5 + 1.0 and opened.limits.admit_slack_s == 1.5
    given = engine_config(parse_args([*base, "--arrivals", "poisson", "--graph-warmup-s", "16"]))
    assert given.graph_warmup_s == 16.0 and given.limits.admit_slack_s is None  # the before arm's


def test_git_commit_falls_back_to_the_named_commit_where_the_checkout_has_no_git(monkeypatch):
    import subprocess

    from bench.__main__ import git_commit

    def no_git(*args, **kwargs):
        raise subprocess.CalledProcessError(128, args[0])

    monkeypatch.setattr(subprocess, "run", no_git)
    monkeypatch.setenv("COMMIT", "abc1234")
    assert git_commit() == "abc1234"
    monkeypatch.delenv("COMMIT")
    assert git_commit() == "unknown"
