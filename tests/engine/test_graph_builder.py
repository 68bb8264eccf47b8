"""Serve first, polish in the background: graphs past the first of each kind are captured on the builder's
thread while calls of their shapes run uncaptured (exactly, as after a precapture), then replay them.

The capture is emulated on the CPU (``Recorded`` runs the recorded function eagerly): one that blocks on an
event holds the builder mid-capture while a call of that very bucket is served."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from engine.graph_builder import GraphBuilder
from engine.graph_cache import GraphCache, first_keys, serving_order
from engine.serving.startup import Timeline
from engine.vocoder.graphs import GraphedHiFT
from tests.engine.test_graph_cache import Recorded, emulate_capture
from tests.engine.vocoder.test_graphs import hift, mels  # noqa: F401  (the module's tiny v3 HiFT fixture)

CPU = torch.device("cpu")
WAIT_S = 120.0  # generous: the machine is slow and shared


def test_first_keys_hold_each_kinds_batch_1_and_batch_2_programs_and_the_rest_go_small_first():
    keys = [(b, t, s) for b in (4, 2, 1) for t in (300, 200, 100) for s in (True, False)]
    assert first_keys(keys) == [(2, 100, True), (2, 100, False), (1, 100, True), (1, 100, False)]
    rest = [k for k in keys if k not in first_keys(keys)]
    order = serving_order(rest)
    assert order[:4] == [(1, 200, True), (1, 200, False), (1, 300, True), (1, 300, False)]
    assert order[-6:] == [k for k in keys if k[0] == 4] and sorted(order) == sorted(rest)


def test_where_graphs_cover_each_batchs_widest_bucket_comes_before_the_small_first_order():
    """v2's flow: batches 1-16, 100-1000 frames, streaming or not; the widest of batch 1 and 16 of each kind
    are captured before serving. A burst of 2-8 streams must not pad into the 16-row graph for minutes."""
    keys = [(b, t, s) for b in (16, 8, 4, 2, 1) for t in range(1000, 0, -100) for s in (True, False)]
    first = first_keys(keys, covers=True)
    assert first == [(16, 1000, True), (16, 1000, False), (1, 1000, True), (1, 1000, False)]
    rest = [k for k in keys if k not in first]
    order = serving_order(rest, covers=True)
    cover = [(b, 1000, s) for b in (8, 4, 2) for s in (True, False)]
    assert order[:6] == cover
    assert order[6:8] == [(1, 100, True), (1, 100, False)]  # then a single stream's, shortest first
    assert sorted(order) == sorted(rest) and len(order) == len(set(order))
    assert serving_order(rest)[:2] == [(1, 100, True), (1, 100, False)]  # no graph covers: no cover pass


def test_a_call_during_a_background_capture_is_served_exactly_and_the_same_after(hift, monkeypatch):  # noqa: F811
    made = emulate_capture(monkeypatch)
    monkeypatch.setattr("engine.graph_cache.devices.empty_cache", lambda dev: None)
    inside, release = threading.Event(), threading.Event()

    class Blocking(Recorded):
        def __init__(self, fn, inputs, *args, **kwargs):
            if tuple(inputs[0].shape) == (2, 80, 200):  # a background key: hold the builder here
                inside.set()
                assert release.wait(WAIT_S)
            super().__init__(fn, inputs, *args, **kwargs)

    monkeypatch.setattr("engine.device.CapturedCall", Blocking)
    timeline = Timeline()
    builder = GraphBuilder(timeline)
    graphed = GraphedHiFT(hift, frame_bucket=100, max_frames=200)
    assert graphed.precapture(4, 200, CPU, builder.add) == 6
    assert made == [((4, 80, 200),), ((1, 80, 200),)]  # before serving: the widest, at batch 4 and 1
    mel = mels(2, 150, seed=3)  # bucket (2, 200): the capture the builder is held in
    with torch.inference_mode():
        want = hift.inference(mel, False)
    builder.start()
    assert inside.wait(WAIT_S)
    assert [p.name for p in timeline.phases] == [] and timeline.pending() == ["vocoder graphs"]
    with torch.inference_mode():
        during = graphed(mel, False)  # the builder is mid-capture of this very bucket: (4, 200) serves it
    for got, exact in zip(during, want):
        torch.testing.assert_close(got, exact, atol=1e-5, rtol=0)
    release.set()
    assert builder.wait(WAIT_S) and builder.pending == 0
    assert len(graphed.graphs) == 6 and (2, 200) in graphed.graphs._graphs
    with torch.inference_mode():
        after = graphed(mel, False)  # replays its own graph now
    for got, exact in zip(after, want):
        torch.testing.assert_close(got, exact, atol=1e-5, rtol=0)
    # the widest bucket of batch 2 first (a cover: until then a pair pads into batch 4), then small first
    assert made[2:] == [((2, 80, 200),), ((1, 80, 100),), ((2, 80, 100),), ((4, 80, 100),)]
    (phase,) = timeline.phases
    assert phase.name == "vocoder graphs" and phase.background


def test_stop_ends_the_background_captures_between_two_of_them(monkeypatch):
    emulate_capture(monkeypatch)
    monkeypatch.setattr("engine.graph_cache.devices.empty_cache", lambda dev: None)
    cache = GraphCache("test", max_graphs=1)
    builder = GraphBuilder(Timeline())
    started, go = threading.Event(), threading.Event()

    def capture(key: tuple) -> object:
        if key == (1, 200):
            started.set()
            assert go.wait(WAIT_S)
        return cache.get(key, lambda x: x, lambda: (torch.zeros(key[0], key[1]),))

    keys = [(b, t) for b in (2, 1) for t in (300, 200, 100)]
    assert cache.precapture(keys, capture, CPU, builder.add) == 6 and len(cache) == 2
    builder.start()
    assert started.wait(WAIT_S)
    threading.Timer(0.2, go.set).start()  # let stop() find the capture in flight
    builder.stop()
    assert builder.wait(WAIT_S)
    assert sorted(cache._graphs) == [(1, 100), (1, 200), (2, 100)]  # the one in flight ended; no more


def test_a_failing_background_job_is_logged_and_the_rest_still_run(caplog):
    timeline = Timeline()
    builder = GraphBuilder(timeline)
    ran: list[str] = []

    def broken(stop: threading.Event) -> None:
        raise RuntimeError("capture failed")

    builder.add("flow solver graphs", broken)
    builder.add("vocoder graphs", lambda stop: ran.append("vocoder"))
    with caplog.at_level("ERROR", "engine.graph_builder"):
        builder.start()
        assert builder.wait(WAIT_S)
    assert ran == ["vocoder"] and [p.name for p in timeline.phases] == ["vocoder graphs"]
    assert "flow solver graphs failed in the background" in caplog.text
    with pytest.raises(RuntimeError, match="started"):
        builder.add("late", lambda stop: None)


def test_a_builder_begun_early_runs_its_queue_and_later_jobs_until_start_ends_it():
    """``begin``: the jobs run while the load waits for the LM backend's start; a job added after (the
    first-chunk lane's, once the engine exists) joins the queue; only ``start`` (ready) lets the thread
    end, and no job is added after it."""
    timeline = Timeline()
    builder = GraphBuilder(timeline)
    ran: list[str] = []
    first_ran = threading.Event()
    builder.add("vocoder graphs", lambda stop: (ran.append("vocoder"), first_ran.set()))
    builder.begin()
    assert first_ran.wait(WAIT_S)  # before start: the load's wait for vLLM
    builder.add("first-chunk lane graphs", lambda stop: ran.append("lane"))
    assert not builder.wait(0.2) and "lane" in timeline.pending() + ran  # the thread waits for more
    builder.start()
    assert builder.wait(WAIT_S) and ran == ["vocoder", "lane"] and timeline.pending() == []
    builder.begin()  # later calls do nothing
    with pytest.raises(RuntimeError, match="started"):
        builder.add("late", lambda stop: None)


def test_a_builder_begun_early_and_waiting_for_jobs_ends_at_a_stop():
    """A failed load stops a builder that began beside the LM's start: its thread ends, no job runs."""
    builder = GraphBuilder(Timeline())
    builder.begin()
    builder.stop()
    assert builder.wait(WAIT_S)
    builder.add("vocoder graphs", lambda stop: pytest.fail("ran after the stop"))
    builder.start()
    assert builder.wait(WAIT_S)


def test_queued_jobs_are_pending_from_load_until_each_has_run():
    """/ready's "pending" lists the builder's jobs from the moment they are queued (before ``start`` and
    between two jobs it would otherwise read empty, and a bench would take the engine for finished)."""
    timeline = Timeline()
    builder = GraphBuilder(timeline)
    seen: dict[str, list[str]] = {}
    builder.add("flow compile", lambda stop: seen.setdefault("compile", timeline.pending()))
    builder.add("flow solver graphs", lambda stop: seen.setdefault("graphs", timeline.pending()))
    assert timeline.pending() == ["flow compile", "flow solver graphs"]  # queued, not started
    builder.start()
    assert builder.wait(WAIT_S) and timeline.pending() == []
    assert seen == {"compile": ["flow compile", "flow solver graphs"], "graphs": ["flow solver graphs"]}


def test_serving_threads_get_the_interpreter_sooner_while_the_jobs_run_and_as_before_after():
    """The builder's jobs (Dynamo/Inductor: pure Python) share the GIL with the serving threads: while they
    run, a waiting thread gets it after ``BACKGROUND_SWITCH_S``; after them, Python's own interval again."""
    import sys

    from engine.graph_builder import BACKGROUND_SWITCH_S

    before = sys.getswitchinterval()
    assert before > BACKGROUND_SWITCH_S  # Python's default 5 ms
    builder = GraphBuilder(Timeline())
    seen: list[float] = []
    builder.add("flow compile", lambda stop: seen.append(sys.getswitchinterval()))
    builder.start()
    assert builder.wait(WAIT_S)
    assert seen == [pytest.approx(BACKGROUND_SWITCH_S)] and sys.getswitchinterval() == before


def test_captures_wait_for_the_engines_pace_between_each_other_up_to_a_bound(monkeypatch):
    """Polish where it harms nobody: before each background capture the job asks the engine's pace to
    wait, at most ``CAPTURE_WAIT_S``, until no stream can stall for it; before ``yield_to`` nothing waits."""
    from engine.graph_builder import CAPTURE_WAIT_S, PACE_SLICE_S

    emulate_capture(monkeypatch)
    monkeypatch.setattr("engine.graph_cache.devices.empty_cache", lambda dev: None)
    cache = GraphCache("test", max_graphs=1)
    builder = GraphBuilder(Timeline())
    events: list[object] = []

    def capture(key: tuple) -> object:
        events.append(key)
        return cache.get(key, lambda x: x, lambda: (torch.zeros(key[0], key[1]),))

    def clear(timeout_s: float) -> bool:
        events.append(timeout_s)
        return True

    keys = [(b, t) for b in (2, 1) for t in (200, 100)]
    assert cache.precapture(keys, capture, CPU, builder.add) == 4
    assert events == [(2, 100), (1, 100)]  # now: no pacing before serving
    builder.yield_to(clear)
    builder.start()
    assert builder.wait(WAIT_S)
    assert events[2:] == [PACE_SLICE_S, (1, 200), PACE_SLICE_S, (2, 200)]  # a wait before each capture
    assert PACE_SLICE_S < CAPTURE_WAIT_S


def test_a_capture_waiting_for_its_pace_goes_ahead_at_the_bound_or_stops_with_the_engine(monkeypatch):
    """The pace is asked in slices until it says clear or ``CAPTURE_WAIT_S`` has passed (then the capture
    goes ahead: the engine reaches full speed under any load); ``stop`` ends the wait within a slice."""
    import engine.graph_builder as gb

    emulate_capture(monkeypatch)
    monkeypatch.setattr("engine.graph_cache.devices.empty_cache", lambda dev: None)
    monkeypatch.setattr(gb, "CAPTURE_WAIT_S", 0.3)
    monkeypatch.setattr(gb, "PACE_SLICE_S", 0.05)
    cache = GraphCache("test", max_graphs=1)
    builder = GraphBuilder(Timeline())
    asked: list[float] = []

    def never_clear(timeout_s: float) -> bool:
        asked.append(timeout_s)
        time.sleep(timeout_s)  # a busy engine: the slice passes
        return False

    def capture(key: tuple) -> object:
        return cache.get(key, lambda x: x, lambda: (torch.zeros(key[0], key[1]),))

    assert cache.precapture([(1, 100), (1, 200)], capture, CPU, builder.add) == 2
    builder.yield_to(never_clear)
    t0 = time.monotonic()
    builder.start()
    assert builder.wait(WAIT_S) and (1, 200) in cache._graphs  # captured after the bound
    assert 0.3 <= time.monotonic() - t0 < 5.0 and len(asked) >= 5 and max(asked) <= 0.05 + 1e-9

    monkeypatch.setattr(gb, "CAPTURE_WAIT_S", 60.0)
    cache, builder = GraphCache("test", max_graphs=1), GraphBuilder(Timeline())
    assert cache.precapture([(1, 100), (1, 200)], capture, CPU, builder.add) == 2
    builder.yield_to(never_clear)
    builder.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    builder.stop()  # the engine closing while a capture waits for its pace
    assert builder.wait(1.0) and time.monotonic() - t0 < 1.0 and (1, 200) not in cache._graphs
