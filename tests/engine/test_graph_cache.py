"""The shape buckets and the LRU of captured graphs (capture itself replaced by a recorder: no GPU here)."""

from __future__ import annotations

import logging
import threading
import time
import types
from typing import ClassVar

import torch

from engine.graph_cache import GraphCache, bucket, largest_first


class Recorded:
    """Stands in for ``devices.CapturedCall``: keeps the function and its input buffers, runs it eagerly."""

    made: ClassVar[list[tuple]] = []

    def __init__(self, fn, inputs, pool=None, warmup=2, stream=None):
        self.fn, self.inputs = fn, inputs
        Recorded.made.append(tuple(tuple(i.shape) for i in inputs))

    def replay(self, *values):
        for static, value in zip(self.inputs, values):
            static.copy_(value)
        out = self.fn(*self.inputs)
        return tuple(o.clone() for o in (out if isinstance(out, tuple) else (out,)))

    def __call__(self, *values):
        return self.replay(*values)[0]

    @property
    def graph(self) -> types.SimpleNamespace:
        """CapturedCall's graph: ``replay()`` reruns the function on the input buffers as they are."""
        return types.SimpleNamespace(replay=lambda: self.fn(*self.inputs))


def emulate_capture(monkeypatch, stand_in: type = Recorded) -> list:
    """Route every capture through ``stand_in`` (no pool, no side stream); returns its ``made`` list, emptied
    (``Recorded``: the captured input shapes)."""
    stand_in.made = []  # type: ignore[attr-defined]
    monkeypatch.setattr("engine.device.CapturedCall", stand_in)
    monkeypatch.setattr("engine.device.graph_pool", lambda: None)
    monkeypatch.setattr("engine.device.capture_stream", lambda: None)
    return stand_in.made  # type: ignore[attr-defined]


def test_buckets_round_batch_to_a_power_of_two_and_frames_to_the_bucket():
    assert [bucket(b, 1, 100) for b in (1, 2, 3, 5, 16)] == [
        (1, 100),
        (2, 100),
        (4, 100),
        (8, 100),
        (16, 100),
    ]
    assert [bucket(1, t, 100)[1] for t in (1, 100, 101, 799)] == [100, 100, 200, 800]
    assert largest_first(4, 300, 100) == [(4, 300), (4, 200), (4, 100), (2, 300), (2, 200), (2, 100),
                                          (1, 300), (1, 200), (1, 100)]  # fmt: skip


def test_cache_captures_once_per_key_and_drops_the_least_recently_used(monkeypatch):
    made = emulate_capture(monkeypatch)
    cache = GraphCache("test", max_graphs=2)

    def get(n: int):
        return cache.get(n, lambda x: x * n, lambda: (torch.zeros(n),))

    assert get(2)(torch.ones(2)).tolist() == [2.0, 2.0]
    get(3)
    assert get(2) is cache[2] and len(made) == 2  # a hit: no new capture
    get(4)  # over the bound: 3, the least recently used, goes
    assert len(cache) == 2 and len(made) == 3
    get(3)
    assert len(made) == 4  # captured again


def test_once_precaptured_a_new_key_gets_no_graph(monkeypatch, caplog):
    """After ``precapture`` nothing is captured on a request's path: an unknown key returns None (the
    caller runs uncaptured), logged once per key."""
    made = emulate_capture(monkeypatch)
    monkeypatch.setattr("engine.graph_cache.devices.empty_cache", lambda dev: None)
    cache = GraphCache("test", max_graphs=1)

    def get(n: int):
        return cache.get(n, lambda x: x * n, lambda: (torch.zeros(n),))

    assert not cache.frozen
    assert cache.precapture([2, 3], get, torch.device("cpu")) == 2 and cache.frozen
    assert get(2) is cache[2] and get(3) is cache[3]  # room for every pre-captured key
    with caplog.at_level(logging.INFO, "engine.graph_cache"):
        assert get(4) is None and get(4) is None
    assert len(made) == 2 and len(cache) == 2
    assert sum("run uncaptured" in r.getMessage() for r in caplog.records) == 1


def test_precapture_logs_its_progress_and_each_capture_that_compiled(monkeypatch, caplog):
    """A start-up of minutes says where it is: every 20 graphs and the last, and each slow capture."""
    emulate_capture(monkeypatch)
    monkeypatch.setattr("engine.graph_cache.devices.empty_cache", lambda dev: None)
    monkeypatch.setattr("engine.graph_cache.SLOW_CAPTURE_S", 0.05)
    cache = GraphCache("test", max_graphs=1)

    def capture(key: tuple) -> object:
        if key == (7,):
            time.sleep(0.1)  # as a compile would
        return cache.get(key, lambda x: x, lambda: (torch.zeros(1),))

    with caplog.at_level(logging.INFO, "engine.graph_cache"):
        assert cache.precapture([(n,) for n in range(45)], capture, torch.device("cpu")) == 45
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(" in ")[0] for line in lines if "captured" in line] == [
        f"test graphs: {n} of 45 captured" for n in (20, 40, 45)
    ]
    assert [line for line in lines if "compiling" in line] == [lines[0]] and "(7,) took" in lines[0]


def test_a_job_between_goes_after_the_single_stream_captures_and_before_the_rest(monkeypatch):
    """``between`` (the flow's compile): the single-stream buckets not captured now become a job of their
    own ahead of it, the other buckets one after it; each job captures its keys in serving order."""
    emulate_capture(monkeypatch)
    monkeypatch.setattr("engine.graph_cache.devices.empty_cache", lambda dev: None)
    cache = GraphCache("test", max_graphs=1)
    jobs: list[tuple[str, object]] = []
    captured: list[tuple] = []

    def capture(key: tuple) -> object:
        captured.append(key)
        return cache.get(key, lambda x: x, lambda: (torch.zeros(key[0], key[1]),))

    def compile_job(stop: threading.Event) -> None:
        captured.append(("compile",))

    keys = [(b, t) for b in (4, 2, 1) for t in (300, 200, 100)]
    later = lambda name, job: jobs.append((name, job))  # noqa: E731
    assert cache.precapture(keys, capture, torch.device("cpu"), later, ("compile", compile_job)) == 9
    assert captured == [(2, 100), (1, 100)]  # now: the shortest bucket at batch 1 and at batch 2
    assert [name for name, _ in jobs] == ["test graphs (1 stream)", "compile", "test graphs"]
    for _, job in jobs:
        job(threading.Event())  # type: ignore[operator]
    assert captured[2:] == [
        (1, 200),
        (1, 300),
        ("compile",),
        (2, 200),
        (2, 300),
        (4, 300),
        (4, 200),
        (4, 100),
    ]
    assert len(cache) == 9
    cache2, jobs = GraphCache("plain", max_graphs=1), []
    cache2.precapture(keys, lambda k: None, torch.device("cpu"), later)
    assert [name for name, _ in jobs] == ["plain graphs"]  # without a job between: one job, as before


def test_a_covering_cache_starts_with_its_widest_buckets_and_lends_them_to_smaller_calls(monkeypatch):
    """A cache that ``covers`` captures first each kind's widest bucket at batch 1 and at the largest
    batch; a key not captured yet is lent the cheapest captured key of its kind at least as large in
    both; a cache that does not cover lends none."""
    emulate_capture(monkeypatch)
    monkeypatch.setattr("engine.graph_cache.devices.empty_cache", lambda dev: None)
    cache = GraphCache("test", max_graphs=1, covers=True)
    keys = [(b, t, kind) for b in (4, 2, 1) for t in (300, 200, 100) for kind in ("whole", "window")]
    stop, background = threading.Event(), []

    def capture(key: tuple) -> object:
        if cache.frozen:  # a background capture: the test stops the job after its first two
            background.append(key)
            if len(background) == 2:
                stop.set()
        return cache.get(key, lambda x: x, lambda: (torch.zeros(key[0], key[1]),))

    jobs: list[tuple[str, object]] = []
    cache.precapture(keys, capture, torch.device("cpu"), lambda name, job: jobs.append((name, job)))
    assert sorted(cache.keys()) == [
        (1, 300, "whole"), (1, 300, "window"), (4, 300, "whole"), (4, 300, "window")
    ]  # fmt: skip
    assert cache.covering((1, 100, "whole")) == (1, 300, "whole")
    assert cache.covering((2, 200, "window")) == (4, 300, "window")  # of its own kind only
    ((_, job),) = jobs
    job(stop)  # type: ignore[operator]
    # the background began with batch 2's widest bucket of each kind: a pair no longer pads into batch 4
    assert background == [(2, 300, "whole"), (2, 300, "window")]
    assert cache.covering((2, 100, "window")) == (2, 300, "window")
    job(threading.Event())  # type: ignore[operator]  # the rest
    assert cache.covering((2, 100, "whole")) == (2, 100, "whole")  # its own bucket, once captured
    assert GraphCache("plain", max_graphs=1).covering((1, 100, "whole")) is None


def test_single_stream_now_captures_every_batch_one_bucket_before_serving(monkeypatch):
    """EngineConfig.single_stream_graphs_at_load: with a builder, every batch-1 bucket is captured now beside
    the first keys (in the keys' order), so no "(1 stream)" job is left; the other buckets still go later."""
    emulate_capture(monkeypatch)
    monkeypatch.setattr("engine.graph_cache.devices.empty_cache", lambda dev: None)
    keys = [(b, t) for b in (4, 2, 1) for t in (300, 200, 100)]
    for between in (None, ("compile", lambda stop: None)):
        cache = GraphCache("test", max_graphs=1)
        cache.single_stream_now = True
        jobs: list[tuple[str, object]] = []
        captured: list[tuple] = []

        def capture(key: tuple, cache=cache, captured=captured) -> object:
            captured.append(key)
            return cache.get(key, lambda x: x, lambda: (torch.zeros(key[0], key[1]),))

        later = lambda name, job, jobs=jobs: jobs.append((name, job))  # noqa: E731
        assert cache.precapture(keys, capture, torch.device("cpu"), later, between) == 9
        assert captured == [(2, 100), (1, 300), (1, 200), (1, 100)]  # the first keys and every batch 1
        assert [name for name, _ in jobs] == ([] if between is None else ["compile"]) + ["test graphs"]
        jobs[-1][1](threading.Event())  # type: ignore[operator]
        assert sorted(captured[4:]) == [(2, 200), (2, 300), (4, 100), (4, 200), (4, 300)]
