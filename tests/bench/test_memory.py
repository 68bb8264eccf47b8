"""bench/memory.py: the soak's memory sample, read beside the engine's threads."""

from __future__ import annotations

import gc
import threading
import time
from types import SimpleNamespace

import torch

from bench.memory import python_blocks, sample
from engine.serving.metrics import ServerStats


def idle_engine() -> SimpleNamespace:
    return SimpleNamespace(stats=ServerStats, model=SimpleNamespace(device=torch.device("cpu")))


def test_sampling_beside_a_thread_building_tuples_breaks_none_of_them():
    """The sampler runs on the event loop beside the engine's worker threads, so reading it must take no
    reference to an object another thread is still building: ``len(gc.get_objects())`` did, and a
    ``tuple(generator)`` on another thread (as the flow's, on the token2wav worker) failed its resize with
    SystemError, hundreds of times a second in this race, once a request in a CI soak test."""
    errors: list[SystemError] = []
    stop = threading.Event()

    def build() -> None:
        while not stop.is_set():
            try:
                tuple(x for x in range(50))
            except SystemError as err:
                errors.append(err)

    worker = threading.Thread(target=build)
    worker.start()
    engine, samples = idle_engine(), 0
    try:
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            sample(engine, 0.0)
            samples += 1
    finally:
        stop.set()
        worker.join()
    assert errors == [] and samples >= 20


def test_python_blocks_grow_with_what_python_keeps_and_fall_when_it_is_freed():
    """The count is the whole process's, so threads left by earlier tests (an engine's workers winding
    down) can free blocks meanwhile (2.4 M once in a full CI run): the collector is held off and a window
    that such a thread disturbed is tried again, at most three times."""

    def window() -> tuple[int, int, int]:
        before = python_blocks()
        kept = [[i] for i in range(50_000)]
        grown = python_blocks()
        del kept
        return before, grown, python_blocks()

    gc.collect()
    gc.disable()
    try:
        windows = [window() for _ in range(3)]
    finally:
        gc.enable()
    assert any(grown - before >= 50_000 and after < grown - 40_000 for before, grown, after in windows)
