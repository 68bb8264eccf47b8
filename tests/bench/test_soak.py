"""bench/soak.py: a short CPU smoke of the soak CLI on a tiny model, the memory-trend verdict, and error
accounting against an engine that fails some requests."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from bench import soak
from engine.demo.make_model import build_model_dir
from engine.errors import SynthesisFailed
from engine.request import AudioChunk, SynthesisRequest
from engine.serving.metrics import RequestMetrics, ServerStats


def test_cpu_smoke_writes_a_passing_report(tmp_path):
    model = build_model_dir(tmp_path / "model", "cosyvoice3", "tiny")
    out = tmp_path / "soak"
    argv = ["--model", str(model), "--streams", "4", "--minutes", "0.2", "--tokens", "30", "--sample-s", "2"]
    assert soak.main([*argv, "--device", "cpu", "--backend", "native", "--out", str(out)]) == 0
    data = json.loads((out / "soak.json").read_text())
    summary = data["summary"]
    assert summary["requests"] == summary["completed"] > 4 and summary["errors"] == 0
    assert 0 < summary["ttfa_ms"]["p50"] <= summary["ttfa_ms"]["p95"] <= summary["ttfa_ms"]["max"]
    assert summary["audio_s_total"] == pytest.approx(sum(r["audio_s"] for r in data["requests"]))
    assert {r["stream"] for r in data["requests"]} == {0, 1, 2, 3}
    assert len(data["samples"]) >= 6  # every 2 s over 12 s, plus the end state
    assert summary["rss_mb"]["flat"] and summary["rss_mb"]["first"] > 0
    end = summary["end_state"]
    assert (end["active"], end["queued"], end["failed"]) == (0, 0, 0)
    assert end["completed"] == summary["requests"] + 1  # + the warm-up request
    assert max(r["start_s"] for r in data["requests"]) < 0.2 * 60  # none started after the deadline
    report = (out / "soak.md").read_text()
    assert "# Soak: 4 streams for 0.2 min" in report and "**PASS**" in report and "process RSS" in report
    (out / "soak.md").unlink()  # --rescore rebuilds the report from soak.json alone, running nothing
    assert soak.main(["--rescore", "--out", str(out)]) == 0
    assert json.loads((out / "soak.json").read_text())["summary"] == summary
    assert (out / "soak.md").read_text() == report


def test_rescore_rewrites_a_verdict_from_the_samples(tmp_path):
    """A soak.json whose device memory grows 10 MiB/min is scored FAIL again, whatever verdict it held."""
    samples = [
        soak.Sample(t, 3000.0, 3700.0 + t / 6, 5000.0, 4, 0, int(t), 0, 1000) for t in np.arange(0, 601, 10.0)
    ]
    run = soak.SoakRun(
        soak.SoakConfig(streams=4, minutes=10), samples, [soak.Request(0, 0.0, 1.0, 2.0, 90.0)], 600.0
    )
    soak.write_report(run, tmp_path, "cuda", "m")
    data = json.loads((tmp_path / "soak.json").read_text())
    data["summary"]["device_mb"]["flat"] = True
    (tmp_path / "soak.json").write_text(json.dumps(data))
    assert soak.main(["--rescore", "--out", str(tmp_path)]) == 1
    assert json.loads((tmp_path / "soak.json").read_text())["summary"]["device_mb"]["flat"] is False
    assert "**FAIL**" in (tmp_path / "soak.md").read_text()


@pytest.mark.parametrize(
    ("mb_per_min", "flat"), [(0.0, True), (1.0, True), (3.0, False), (-3.0, False)], ids=str
)
def test_memory_trend_verdict(mb_per_min, flat):
    """30 min sampled every 10 s from 1000 MiB: flat while the late trend adds < max(64 MiB, 2 %)."""
    ts = np.arange(0, 1801, 10.0)
    noise = np.random.default_rng(0).normal(0, 2.0, ts.size)
    trend = soak.memory_trend(list(ts), list(1000 + mb_per_min * ts / 60 + noise), 1800.0)
    assert trend["late_slope_mb_per_min"] == pytest.approx(mb_per_min, abs=0.2)
    assert trend["slope_mb_per_min"] == pytest.approx(mb_per_min, abs=0.2)
    assert trend["flat"] is flat


def test_growth_that_stops_after_warm_up_is_flat():
    ts = list(np.arange(0, 1801, 10.0))
    ys = [1000 + min(t, 300) / 3 for t in ts]  # +100 MiB in the first 5 min, then level
    trend = soak.memory_trend(ts, ys, 1800.0)
    assert trend["flat"] and trend["late_slope_mb_per_min"] == pytest.approx(0.0, abs=1e-9)
    assert (trend["first"], trend["max"]) == (1000, 1100)


def test_one_late_spike_does_not_make_flat_memory_grow():
    """The H200 soak's device series: level, then one transient sample 800 MiB up in the second half."""
    ts = list(np.arange(0, 1201, 10.0))
    ys = [3770.0 + (800.0 if t == 1000 else 0.0) for t in ts]
    trend = soak.memory_trend(ts, ys, 1200.0)
    assert trend["flat"] and trend["late_slope_mb_per_min"] == pytest.approx(0.0, abs=1e-9)
    assert trend["max"] == 4570.0


def test_a_steady_leak_under_spikes_is_still_caught():
    ts = np.arange(0, 1201, 10.0)
    ys = 3770.0 + 5.0 * ts / 60 + np.where(np.arange(ts.size) % 7 == 0, 600.0, 0.0)  # 5 MiB/min + spikes
    trend = soak.memory_trend(list(ts), list(ys), 1200.0)
    assert trend["late_slope_mb_per_min"] == pytest.approx(5.0, abs=0.3) and trend["flat"] is False


class FlakyEngine:
    """Every third request fails mid-stream; the rest stream two chunks of 0.1 s."""

    model = SimpleNamespace(device=torch.device("cpu"))  # what soak reads of ``TTSEngine.model``

    def __init__(self) -> None:
        self.calls = 0

    def stats(self) -> ServerStats:
        return ServerStats()

    async def stream(self, req: SynthesisRequest) -> AsyncIterator[AudioChunk]:
        self.calls += 1
        fail = self.calls % 3 == 0
        for i in range(2):
            await asyncio.sleep(0.01)
            if fail and i == 1:
                raise SynthesisFailed("the vocoder produced non-finite audio; this request was stopped")
            yield AudioChunk(np.zeros(2400, np.float32), 24000, i, i == 1, RequestMetrics())


async def test_failed_requests_are_counted_and_fail_the_soak(tmp_path):
    run = await soak.soak(FlakyEngine(), soak.SoakConfig(streams=2, minutes=0.01, tokens=5, sample_s=0.2))
    summary = soak.write_report(run, tmp_path, "cpu", "fake")
    assert summary["requests"] > 6 and summary["errors"] == summary["requests"] // 3
    assert summary["error_kinds"] == {"SynthesisFailed": summary["errors"]}
    assert summary["audio_s_total"] == pytest.approx(0.2 * summary["completed"])
    assert not soak.passed(summary)
    assert (
        "**FAIL**" in (tmp_path / "soak.md").read_text()
        and "SynthesisFailed x" in (tmp_path / "soak.md").read_text()
    )


def test_config_is_checked():
    with pytest.raises(ValueError, match="streams and tokens"):
        soak.SoakConfig(streams=0)
    with pytest.raises(ValueError, match="minutes and sample_s"):
        soak.SoakConfig(minutes=0)


def test_trim_option_is_recorded_and_python_blocks_are_counted(tmp_path):
    model = build_model_dir(tmp_path / "model", "cosyvoice3", "tiny")
    out = tmp_path / "soak"
    argv = ["--model", str(model), "--streams", "2", "--minutes", "0.05", "--tokens", "30", "--sample-s", "1"]
    soak.main([*argv, "--device", "cpu", "--backend", "native", "--trim", "--out", str(out)])
    data = json.loads((out / "soak.json").read_text())
    # not the verdict: 3 s is too short to judge memory flat on a loaded machine (the warm-up's growth
    # then looks like a trend); the verdict's rules have tests of their own above
    assert data["summary"]["errors"] == 0 and data["summary"]["completed"] > 0
    assert data["summary"]["config"]["trim"] is True
    assert all(s["py_blocks"] > 1000 for s in data["samples"])
    assert data["summary"]["py_blocks"]["first"] > 0
    assert "process RSS (after malloc_trim)" in (out / "soak.md").read_text()


@pytest.mark.parametrize("at_ready", [True, False])
def test_start_at_ready_sends_while_the_background_work_still_runs(tmp_path, monkeypatch, caplog, at_ready):
    """``--start-at-ready``: the requests go out while a background job (a stand-in for the graphs still
    being captured) has not finished, and the soak ends without waiting for it; without the flag the soak
    waits for that job before its first request."""
    import threading

    model = build_model_dir(tmp_path / "model", "cosyvoice3", "tiny")
    release, first_request_pending = threading.Event(), []
    real_load = soak.load_engine

    def load_with_slow_graphs(args, slots, longest):
        engine = real_load(args, slots, longest)
        real_stream = engine.stream

        def stream(req):
            first_request_pending.append(engine.graph_builder.pending)
            return real_stream(req)

        engine.graph_builder.add("flow solver graphs", lambda stop: release.wait(5.0))
        engine.stream = stream  # the warm-up's stream() runs before the builder starts: read after it
        return engine

    monkeypatch.setattr(soak, "load_engine", load_with_slow_graphs)
    argv = ["--model", str(model), "--streams", "1", "--minutes", "0.03", "--tokens", "25", "--sample-s", "1"]
    argv += ["--start-at-ready"] if at_ready else []
    with caplog.at_level("INFO", "bench.soak"):
        rc = soak.main([*argv, "--device", "cpu", "--backend", "native", "--out", str(tmp_path / "s")])
    release.set()
    assert rc == 0
    # [the warm-up's request (the builder not started: 1 job), then the soak's]
    assert first_request_pending[0] == 1 and len(first_request_pending) >= 2
    assert first_request_pending[1] == (1 if at_ready else 0)
    assert ("the soak starts at ready" in caplog.text) == at_ready


def test_the_bench_modules_import_one_way():
    """No bench module imports one that imports it back (the soaks shared their memory sampling both ways
    once: it lives in bench.memory, below both)."""
    from tests.test_import_graph import ROOT, cycle_from, import_graph

    graph = import_graph(sorted((ROOT / "bench").rglob("*.py")))
    assert {"bench.soak", "bench.soak_open", "bench.memory"} <= set(graph)
    assert "bench.memory" in graph["bench.soak_open"] and "bench.soak" not in graph["bench.soak_open"]
    cycles = [c for m in sorted(graph) if (c := cycle_from(graph, m))]
    assert not cycles, " ; ".join(" -> ".join(c) for c in cycles)
