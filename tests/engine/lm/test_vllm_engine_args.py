"""The engine arguments VLLMBackend gives vLLM: CUDA graphs captured up to max_num_seqs tokens where the
arguments have the field (nothing passed where they do not), the engine core started by spawn, the torch
profiler only when asked for, the logits processor whose RAS step replays graphs unless the eager arm is
asked for. vLLM is not installed on CPU machines: its imported modules are stubs here, and the engine
arguments are stand-in dataclasses with and without the fields."""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
import types

import pytest

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


def stub_vllm_engine(monkeypatch, module, on_start) -> None:
    """vLLM's engine arguments and AsyncLLM as stand-ins: ``on_start(kwargs)`` runs as the engine starts."""

    class Args:
        def __init__(self, **kwargs: object):
            self.kwargs = kwargs

    class Engine:
        @staticmethod
        def from_engine_args(args: Args) -> Engine:
            on_start(args.kwargs)
            return Engine()

    for name, attr, value in (
        ("vllm.engine.arg_utils", "AsyncEngineArgs", Args),
        ("vllm.v1.engine.async_llm", "AsyncLLM", Engine),
    ):
        stub = types.ModuleType(name)
        setattr(stub, attr, value)
        monkeypatch.setitem(sys.modules, name, stub)
    monkeypatch.setattr(module, "_capture_limit", lambda args, n: {})  # the stand-in is no dataclass


def test_vllm_starts_its_engine_core_by_spawn_unless_the_operator_chose(monkeypatch, tmp_path):
    """The weights load onto the GPU beside vLLM's start: a fork after CUDA came up fails in the child."""
    module = backend_module(monkeypatch)
    seen: list[str | None] = []
    stub_vllm_engine(
        monkeypatch, module, lambda kwargs: seen.append(os.environ.get("VLLM_WORKER_MULTIPROC_METHOD"))
    )
    (tmp_path / "config.json").write_text('{"vocab_size": 10}')
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    module.VLLMBackend(tmp_path, SamplingConfig(), 0.5)
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "forkserver")
    module.VLLMBackend(tmp_path, SamplingConfig(), 0.5)
    assert seen == ["spawn", "forkserver"]


def test_in_the_lm_host_vllm_forks_its_engine_core_unless_the_operator_chose(monkeypatch, tmp_path):
    """engine.lm.lm_host's process has no CUDA context and vLLM imported: its engine core forks from it;
    the spec's settings reach the engine arguments."""
    from engine.lm.lm_host import HostSpec

    module = backend_module(monkeypatch)
    seen: list[tuple[str | None, object]] = []

    def on_start(kwargs: dict[str, object]) -> None:
        seen.append((os.environ.get("VLLM_WORKER_MULTIPROC_METHOD"), kwargs["logits_processors"]))

    stub_vllm_engine(monkeypatch, module, on_start)
    (tmp_path / "config.json").write_text('{"vocab_size": 10}')
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    backend = module.hosted(HostSpec(tmp_path, SamplingConfig(), 0.5, ras_graphs=False))
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    module.hosted(HostSpec(tmp_path, SamplingConfig(), 0.5))
    eager, graphed = (
        ["engine.lm.vllm_backend:EagerRASLogitsProcessor"],
        ["engine.lm.vllm_backend:RASLogitsProcessor"],
    )
    assert seen == [("fork", eager), ("spawn", graphed)] and backend.lm is None


def test_with_the_fork_server_started_vllm_makes_its_engine_core_from_its_context(monkeypatch, tmp_path):
    """EngineConfig.lm_fork_server: vLLM 0.26 makes its engine core with vllm.v1.engine.utils'
    get_mp_context; once the fork server runs, that is engine.lm.fork_server's context as the engine
    starts; without it, vLLM's own."""
    from engine.lm import fork_server

    module = backend_module(monkeypatch)
    procs = types.ModuleType("vllm.v1.engine.utils")
    procs.get_mp_context = own = lambda: "vLLM's own"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.v1.engine", types.ModuleType("vllm.v1.engine"))
    monkeypatch.setitem(sys.modules, "vllm.v1.engine.utils", procs)
    monkeypatch.setattr(sys.modules["vllm.v1.engine"], "utils", procs, raising=False)
    seen: list[object] = []
    stub_vllm_engine(monkeypatch, module, lambda kwargs: seen.append(procs.get_mp_context))
    (tmp_path / "config.json").write_text('{"vocab_size": 10}')
    module.VLLMBackend(tmp_path, SamplingConfig(), 0.5)
    monkeypatch.setattr(fork_server, "started", lambda: True)
    module.VLLMBackend(tmp_path, SamplingConfig(), 0.5)
    assert seen == [own, fork_server.context]


def test_the_lm_profiler_is_configured_only_when_asked_for(monkeypatch, tmp_path):
    module = backend_module(monkeypatch)

    @dataclasses.dataclass
    class ProfilerConfig:  # vllm.config.ProfilerConfig's fields that the backend sets
        profiler: str | None = None
        torch_profiler_dir: str = ""
        torch_profiler_with_stack: bool = True
        ignore_frontend: bool = False

    config = types.ModuleType("vllm.config")
    config.ProfilerConfig = ProfilerConfig  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.config", config)

    @dataclasses.dataclass
    class WithField:
        profiler_config: object = None

    @dataclasses.dataclass
    class Without:
        max_num_seqs: int = 256

    assert module._profiler(WithField, None) == {} and module._profiler(Without, None) == {}
    got = module._profiler(WithField, str(tmp_path / "lm-profile"))["profiler_config"]
    assert got == ProfilerConfig("torch", str((tmp_path / "lm-profile").resolve()), False, True)
    assert (tmp_path / "lm-profile").is_dir()  # vLLM writes its traces and table there
    try:
        module._profiler(Without, str(tmp_path))
    except RuntimeError as err:
        assert "profiler_config" in str(err)
    else:
        raise AssertionError("a vLLM without profiler_config must be refused, not profiled silently")


async def test_start_and_stop_profile_drive_vllm_and_name_its_table(monkeypatch, tmp_path):
    module = backend_module(monkeypatch)
    calls: list[str] = []

    class Engine:
        async def start_profile(self) -> None:
            calls.append("start")

        async def stop_profile(self) -> None:
            calls.append("stop")

    backend = object.__new__(module.VLLMBackend)  # no vLLM here: the engine is a stand-in
    backend.engine, backend.profile_dir = Engine(), None
    with pytest.raises(RuntimeError, match="profile_dir"):
        await backend.start_profile()
    backend.profile_dir = tmp_path
    await backend.start_profile()
    assert await backend.stop_profile() == tmp_path / "profiler_out_0.txt"
    assert calls == ["start", "stop"]


def test_the_logits_processor_replays_its_ras_step_unless_the_eager_arm_is_asked_for(monkeypatch, tmp_path):
    module = backend_module(monkeypatch)
    seen: list[object] = []
    stub_vllm_engine(monkeypatch, module, lambda kwargs: seen.append(kwargs["logits_processors"]))
    (tmp_path / "config.json").write_text('{"vocab_size": 10}')
    module.VLLMBackend(tmp_path, SamplingConfig(), 0.5)
    module.VLLMBackend(tmp_path, SamplingConfig(), 0.5, ras_graphs=False)
    assert seen == [
        ["engine.lm.vllm_backend:RASLogitsProcessor"],
        ["engine.lm.vllm_backend:EagerRASLogitsProcessor"],
    ]
    assert module.RASLogitsProcessor.graphs and not module.EagerRASLogitsProcessor.graphs


def test_a_fixed_kv_cache_is_passed_in_bytes_where_the_engine_arguments_have_the_field(monkeypatch):
    """With kv_cache_memory_bytes vLLM skips profiling the device's memory: early graph captures cannot
    make its start fail. A vLLM without the field is refused, not left to size the cache otherwise."""
    module = backend_module(monkeypatch)

    @dataclasses.dataclass
    class WithField:
        kv_cache_memory_bytes: int | None = None

    @dataclasses.dataclass
    class Without:
        max_num_seqs: int = 256

    assert module._kv_cache_size(WithField, None) == {} and module._kv_cache_size(Without, None) == {}
    assert module._kv_cache_size(WithField, 6.0) == {"kv_cache_memory_bytes": 6 * 2**30}
    with pytest.raises(RuntimeError, match=r"kv_cache_memory_bytes.*--lm-kv-cache-gib 0"):
        module._kv_cache_size(Without, 6.0)
