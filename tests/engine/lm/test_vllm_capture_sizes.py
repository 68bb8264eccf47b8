"""vLLM's CUDA graphs are captured up to max_num_seqs tokens where its engine arguments have the field, and
nothing is passed where they do not. vLLM is not installed on CPU machines: its one imported module is a stub
here, and the engine arguments are stand-in dataclasses with and without the field."""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
import types

from engine.config import SamplingConfig


def backend_module(monkeypatch) -> types.ModuleType:
    """engine.lm.vllm_backend imported over a stub of vllm.v1.sample.logits_processor (undone after)."""
    stub = types.ModuleType("vllm.v1.sample.logits_processor")
    stub.BatchUpdate = object  # type: ignore[attr-defined]
    stub.LogitsProcessor = type("LogitsProcessor", (), {})  # type: ignore[attr-defined]
    stub.MoveDirectionality = types.SimpleNamespace(SWAP="swap")  # type: ignore[attr-defined]
    for name in ("vllm", "vllm.v1", "vllm.v1.sample"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.v1.sample.logits_processor", stub)
    monkeypatch.delitem(sys.modules, "engine.lm.vllm_backend", raising=False)
    module = importlib.import_module("engine.lm.vllm_backend")
    monkeypatch.setitem(sys.modules, "engine.lm.vllm_backend", module)  # dropped again at the end
    return module


def test_the_capture_limit_is_max_num_seqs_where_the_engine_arguments_have_it(monkeypatch):
    module = backend_module(monkeypatch)

    @dataclasses.dataclass
    class WithField:
        max_num_seqs: int = 256
        max_cudagraph_capture_size: int | None = None

    @dataclasses.dataclass
    class Without:
        max_num_seqs: int = 256

    assert module._capture_limit(WithField, 128) == {"max_cudagraph_capture_size": 128}
    assert WithField(**module._capture_limit(WithField, 64)).max_cudagraph_capture_size == 64
    assert module._capture_limit(Without, 128) == {}


def test_vllm_starts_its_engine_core_by_spawn_unless_the_operator_chose(monkeypatch, tmp_path):
    """The weights load onto the GPU beside vLLM's start: a fork after CUDA came up fails in the child."""
    module = backend_module(monkeypatch)
    seen: list[str | None] = []

    class Args:
        def __init__(self, **kwargs: object):
            self.kwargs = kwargs

    class Engine:
        @staticmethod
        def from_engine_args(args: Args) -> Engine:
            seen.append(os.environ.get("VLLM_WORKER_MULTIPROC_METHOD"))
            return Engine()

    for name, attr, value in (
        ("vllm.engine.arg_utils", "AsyncEngineArgs", Args),
        ("vllm.v1.engine.async_llm", "AsyncLLM", Engine),
    ):
        stub = types.ModuleType(name)
        setattr(stub, attr, value)
        monkeypatch.setitem(sys.modules, name, stub)
    monkeypatch.setattr(module, "_capture_limit", lambda args, n: {})  # the stand-in is no dataclass
    (tmp_path / "config.json").write_text('{"vocab_size": 10}')
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    module.VLLMBackend(tmp_path, SamplingConfig(), 0.5)
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "forkserver")
    module.VLLMBackend(tmp_path, SamplingConfig(), 0.5)
    assert seen == ["spawn", "forkserver"]
