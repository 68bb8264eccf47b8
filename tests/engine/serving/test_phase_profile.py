"""The start-up phases' sampler: one thread's stacks while a phase runs, its summary and files."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest

from engine.serving import phase_profile
from engine.serving.startup import Timeline


def _spin(seconds: float) -> None:
    """Busy Python for ``seconds`` (the frame the sampler must find)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(range(200))


def _sleeper(stop: threading.Event) -> None:
    stop.wait()


def test_samples_the_named_thread_only():
    stop = threading.Event()
    other = threading.Thread(target=_sleeper, args=(stop,))
    other.start()
    sampler = phase_profile.PhaseProfile(threading.get_ident(), interval_s=0.002)
    sampler.start()
    _spin(0.3)
    stacks = sampler.stop()
    stop.set()
    other.join()
    assert sum(stacks.values()) >= 20
    # every sample is this thread's (this test on its stack, never the other thread's _sleeper), and
    # nearly all were taken in _spin (the rest: the sampler's start and stop around it)
    assert all(any("test_samples_the_named_thread_only (" in f for f in s) for s in stacks)
    assert not any("_sleeper (" in f for s in stacks for f in s)
    spinning = sum(n for s, n in stacks.items() if any("_spin (" in f for f in s))
    assert spinning >= 0.8 * sum(stacks.values())
    assert all(s[0] != s[-1] for s in stacks)  # outermost first: the test runner, then down to _spin


def test_summary_counts_a_function_once_per_sample_and_its_own_lines():
    stacks = Counter(
        {
            ("main (a.py:1)", "f (a.py:5)", "f (a.py:7)"): 3,  # f recursing: counted once per sample
            ("main (a.py:1)", "g (b.py:2)"): 1,
        }
    )
    text = phase_profile.summary(stacks, interval_s=0.5)
    assert text.startswith("4 samples, 2.0 s")
    inclusive, own = text.split("own (innermost line):")
    assert "2.00 s 100.0 %  main (a.py)" in inclusive
    assert "1.50 s  75.0 %  f (a.py)" in inclusive
    assert "0.50 s  25.0 %  g (b.py)" in inclusive
    assert "1.50 s  75.0 %  f (a.py:7)" in own and "main" not in own


def test_short_paths_keep_the_package():
    assert (
        phase_profile._short("/usr/lib/python3/dist-packages/torch/cuda/graphs.py") == "torch/cuda/graphs.py"
    )
    assert phase_profile._short("/x/venv/lib/python3.12/site-packages/vllm/v1/a.py") == "vllm/v1/a.py"
    assert phase_profile._short("/work/main/engine/flow/graphs.py") == "engine/flow/graphs.py"


def test_interval_must_be_positive():
    with pytest.raises(ValueError, match="interval_s"):
        phase_profile.PhaseProfile(threading.get_ident(), interval_s=0)


def test_a_timeline_with_a_folder_writes_each_phase_s_profile(tmp_path):
    timeline = Timeline(profile_to=tmp_path / "profiles")
    with timeline.phase("Flow compile"):
        _spin(0.2)
    with pytest.raises(RuntimeError), timeline.phase("broken"):
        _spin(0.05)
        raise RuntimeError("the load failed")
    names = {p.name.split("-", 1)[1] for p in (tmp_path / "profiles").iterdir()}
    assert names == {"broken.folded", "broken.txt", "flow-compile.folded", "flow-compile.txt"}
    text = next((tmp_path / "profiles").glob("*flow-compile.txt")).read_text()
    assert "_spin (engine/serving/test_phase_profile.py)" in text  # a path's last three parts
    folded = next((tmp_path / "profiles").glob("*flow-compile.folded")).read_text().splitlines()
    assert all(line.rsplit(" ", 1)[1].isdigit() for line in folded)
    assert sum(int(line.rsplit(" ", 1)[1]) for line in folded) >= 5  # 0.2 s at 10 ms
    assert [p.name for p in timeline.phases] == ["Flow compile"]  # the failed phase is not recorded


def test_without_a_folder_nothing_is_sampled(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(phase_profile.PhaseProfile, "start", lambda self: started.append(self))
    with Timeline().phase("weights"):
        pass
    assert started == []


def test_a_folder_that_cannot_be_written_leaves_the_phase_recorded(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    timeline = Timeline(profile_to=blocker / "profiles")
    with timeline.phase("weights"):
        _spin(0.02)
    assert [p.name for p in timeline.phases] == ["weights"]
    assert "profile not written" in caplog.text
