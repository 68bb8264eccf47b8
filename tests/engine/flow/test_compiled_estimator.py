"""The compile cache lands where the engine says (a restart on the same disk reuses the kernels), unless the
operator chose a place."""

from __future__ import annotations

import os

import torch._dynamo  # noqa: F401  (its import writes Inductor's default cache dir into the environment)
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from engine.flow.compiled_estimator import use_compile_cache


def test_the_cache_replaces_inductors_temp_default(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.path.abspath(default_cache_dir()))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    assert use_compile_cache(tmp_path / "compile") == tmp_path / "compile" / "inductor"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "compile" / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "compile" / "triton")


def test_an_operators_cache_dir_is_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine-triton"))
    assert use_compile_cache(tmp_path / "compile") == tmp_path / "mine"
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine-triton")
