"""The client's playback clock on a fake clock: deadlines before, during and after a stall."""

from __future__ import annotations

from engine.serving.playback import Playback


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_before_any_audio_there_is_no_deadline_and_nothing_is_buffered():
    """None: the first audio is due as it is queued (the token2wav queue marks it a first chunk)."""
    clock = FakeClock()
    p = Playback(clock)
    assert p.deadline() is None and p.buffered_s() == 0.0
    clock.now = 101.5
    assert p.deadline() is None
    p.delivered(0.5)
    assert p.deadline() == 102.0


def test_audio_extends_the_deadline_by_its_length_from_the_first_arrival():
    clock = FakeClock()
    p = Playback(clock)
    p.delivered(1.0)  # plays 100 -> 101
    clock.now = 100.4
    p.delivered(2.0)  # queued behind it: 101 -> 103
    assert p.deadline() == 103.0
    assert abs(p.buffered_s() - 2.6) < 1e-9


def test_after_a_stall_playback_resumes_from_the_late_arrival():
    clock = FakeClock()
    p = Playback(clock)
    p.delivered(1.0)
    clock.now = 102.0  # ran dry at 101
    assert p.buffered_s() == 0.0 and p.deadline() == 101.0  # overdue: the earliest deadline there is
    p.delivered(0.5)
    assert p.deadline() == 102.5


def test_empty_audio_changes_nothing():
    p = Playback(FakeClock())
    p.delivered(0.0)
    assert p.runs_out_at is None


def test_slack_is_said_past_the_first_chunk_until_the_last_audio():
    now = [0.0]
    pb = Playback(lambda: now[0])
    assert pb.slack_s() is None
    pb.delivered(1.0)
    assert pb.slack_s() is None  # right after its first chunk every stream has little buffered
    pb.delivered(1.0)
    now[0] = 0.5
    assert pb.slack_s() == 1.5
    now[0] = 3.0
    assert pb.slack_s() == -1.0  # it ran dry a second ago
    pb.finished = True
    assert pb.slack_s() is None  # its buffer runs out as it should
