"""The interpreter's switch interval held while the engine is open."""

from __future__ import annotations

import sys

import pytest

from engine.config import EngineConfig
from engine.serving.switch_interval import switch_interval


def test_the_interval_is_held_while_entered_and_restored_after_even_on_failure():
    before = sys.getswitchinterval()
    with switch_interval(1.0):
        assert sys.getswitchinterval() == pytest.approx(0.001)
    assert sys.getswitchinterval() == before
    with pytest.raises(RuntimeError), switch_interval(0.5):
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        raise RuntimeError("a load that fails")
    assert sys.getswitchinterval() == before


def test_none_leaves_the_interpreters_own():
    before = sys.getswitchinterval()
    with switch_interval(None):
        assert sys.getswitchinterval() == before


def test_the_config_takes_none_or_a_sane_interval():
    assert EngineConfig().gil_switch_ms is None
    assert EngineConfig(gil_switch_ms=1.0).gil_switch_ms == 1.0
    for bad in (0.0, 0.01, 500.0):
        with pytest.raises(ValueError, match="gil_switch_ms"):
            EngineConfig(gil_switch_ms=bad)
