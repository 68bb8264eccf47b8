"""Stopwatch snapshots with a fake clock: queue wait, time to first audio, RTF, tokens/s, stages."""

from __future__ import annotations

import pytest

from engine.serving.metrics import Stopwatch


def test_snapshot_figures_follow_the_clock():
    now = [10.0]
    watch = Stopwatch("r1", seed=7, clock=lambda: now[0])
    now[0] = 10.5
    watch.started()  # 0.5 s in the queue
    now[0] = 10.6
    watch.add_tokens(10)
    now[0] = 10.8
    watch.add_audio(0.0)  # an empty chunk is not the first audio
    now[0] = 11.0
    watch.add_audio(2.0)
    watch.add_stage("flow", 0.25)
    watch.add_tokens(40)
    m = watch.snapshot(done=True)
    assert m.queue_wait_ms == 500.0 and m.ttfa_ms == 1000.0
    assert m.elapsed_ms == 500.0 and m.rtf == 0.25 and m.audio_s == 2.0
    assert m.lm_tokens == 50 and round(m.lm_tokens_per_s) == 125 and m.stage_ms["flow"] == 250.0
    assert m.done and m.seed == 7 and m.request_id == "r1"


def test_no_audio_no_rtf():
    m = Stopwatch("r", 0, clock=lambda: 1.0).snapshot()
    assert m.rtf is None and m.ttfa_ms is None


def test_ttfa_parts_split_the_ttfa_at_its_milestones():
    now = [100.0]
    watch = Stopwatch("r", 0, clock=lambda: now[0])
    steps = [(100.5, "started"), (100.6, "frontend_done"), (101.0, "first_chunk_ready")]
    for t, milestone in steps:
        now[0] = t
        watch.started() if milestone == "started" else watch.mark(milestone)
        assert watch.ttfa_parts_ms() == {}  # not all there yet
    watch.mark("first_chunk_started", at=101.25)  # taken by the worker thread
    watch.mark("frontend_done", at=999.0)  # only the first time counts
    now[0] = 101.5
    watch.add_audio(0.4)
    parts = watch.snapshot().ttfa_parts_ms
    assert list(parts) == ["queue", "frontend", "lm", "t2w_wait", "t2w_compute"]
    assert [round(v) for v in parts.values()] == [500, 100, 400, 250, 250]
    assert sum(parts.values()) == pytest.approx(watch.snapshot().ttfa_ms)
    with pytest.raises(ValueError, match="milestone"):
        watch.mark("lunch")


def test_a_chunks_trace_gives_the_first_tokens_wait_in_parts():
    """frontend_ms (the frontend done), flow_prompt_ms (the flow's prompt made) and prefix_ms (the LM's prompt
    embeddings made; the first segment's of each counts), lm_first_token_ms: ms after submit on the request's
    clock; None where a part never happened."""
    from engine.serving.metrics import ChunkTimes

    now = [50.0]
    watch = Stopwatch("r", 0, clock=lambda: now[0])
    for t, step in [(50.01, watch.started), (50.03, lambda: watch.mark("frontend_done"))]:
        now[0] = t
        step()
    now[0] = 50.032
    watch.flow_prompt_made()
    now[0] = 50.034
    watch.prefix_made()
    now[0] = 50.06
    watch.add_tokens(1)
    watch.flow_prompt_made()  # a later segment's: not the first token's wait
    watch.prefix_made()
    watch.chunk_computed(ChunkTimes(ready=50.1, due=50.1), tokens=16)
    now[0] = 50.2
    trace = watch.chunk_sent(0.64)
    assert trace is not None
    got = (trace.frontend_ms, trace.flow_prompt_ms, trace.prefix_ms, trace.lm_first_token_ms)
    assert got == (pytest.approx(30.0), pytest.approx(32.0), pytest.approx(34.0), pytest.approx(60.0))
    assert {"frontend_ms", "flow_prompt_ms", "prefix_ms"} <= set(trace.row())
    bare = Stopwatch("b", 0, clock=lambda: 1.0)
    bare.chunk_computed(ChunkTimes(ready=1.0, due=1.0), tokens=1)
    trace = bare.chunk_sent(0.04)
    assert trace is not None and (trace.frontend_ms, trace.flow_prompt_ms, trace.prefix_ms) == (None,) * 3
