"""The start-up timeline: phases in the order they ended, with seconds since launch; /ready's JSON."""

from __future__ import annotations

import threading

import pytest

from engine.startup import Phase, Timeline


class Clock:
    """A clock the test moves by hand (seconds)."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_phases_are_recorded_in_order_with_their_seconds_since_launch():
    clock = Clock()
    timeline = Timeline(origin=100.0, clock=clock)
    with timeline.phase("weights"):
        clock.t += 2.0
    clock.t += 0.5
    with timeline.phase("LM backend"):
        assert timeline.pending() == ["LM backend"]
        clock.t += 3.0
    timeline.mark_ready()
    clock.t += 1.0
    timeline.mark_ready()  # a second warm-up does not move it
    with timeline.phase("flow graphs", background=True):
        clock.t += 4.0
    assert timeline.phases == [
        Phase("weights", 0.0, 2.0),
        Phase("LM backend", 2.5, 3.0),
        Phase("flow graphs", 6.5, 4.0, background=True),
    ]
    body = timeline.as_dict()
    assert body["ready_s"] == 5.5 and body["now_s"] == 10.5 and body["pending"] == []
    assert [p["name"] for p in body["phases"]] == ["weights", "LM backend", "flow graphs"]  # type: ignore[union-attr]


def test_a_phase_that_fails_is_not_recorded_and_not_left_pending():
    timeline = Timeline()
    with pytest.raises(RuntimeError), timeline.phase("weights"):
        raise RuntimeError("no such file")
    assert timeline.phases == [] and timeline.pending() == [] and timeline.ready_s is None


def test_phases_from_threads_all_land(caplog):
    timeline = Timeline()
    gate = threading.Barrier(4)

    def work(n: int) -> None:
        with timeline.phase(f"part {n}"):
            gate.wait(30)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    with caplog.at_level("INFO", "engine.startup"):
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert sorted(p.name for p in timeline.phases) == [f"part {n}" for n in range(4)]
    assert sum("start-up: part" in r.getMessage() for r in caplog.records) == 8  # started, took


def test_a_phase_needs_a_name_and_no_negative_seconds():
    with pytest.raises(ValueError):
        Phase("", 0.0, 1.0)
    with pytest.raises(ValueError):
        Phase("weights", 0.0, -1.0)
