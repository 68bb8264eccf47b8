"""The token2wav worker's measured call cost (seconds per padded row-frame) and the budget it gives."""

from __future__ import annotations

import math

import pytest

from engine.serving.call_cost import CallCost


def test_no_budget_until_a_call_was_measured():
    assert CallCost().row_frames_within(0.2) == math.inf


def test_the_first_call_sets_the_speed_and_later_ones_move_it_by_the_weight():
    cost = CallCost(weight=0.5)
    cost.observe(rows=4, bucket_frames=500, seconds=0.2)  # 2,000 row-frames in 0.2 s
    assert cost.unit_s == pytest.approx(1e-4)
    assert cost.row_frames_within(0.1) == pytest.approx(1000)
    cost.observe(rows=1, bucket_frames=1000, seconds=0.3)  # 3e-4 s a row-frame: halfway there
    assert cost.unit_s == pytest.approx(2e-4)
    assert cost.row_frames_within(0.1) == pytest.approx(500)


def test_calls_that_measured_nothing_leave_it_as_it_was():
    cost = CallCost()
    cost.observe(rows=0, bucket_frames=100, seconds=0.1)
    cost.observe(rows=2, bucket_frames=100, seconds=0.0)  # a fake clock that did not move
    assert cost.unit_s is None
    cost.observe(rows=2, bucket_frames=100, seconds=0.02)
    cost.observe(rows=2, bucket_frames=100, seconds=-1.0)
    assert cost.unit_s == pytest.approx(1e-4)


def test_a_bad_weight_is_refused():
    with pytest.raises(ValueError):
        CallCost(weight=0.0)
