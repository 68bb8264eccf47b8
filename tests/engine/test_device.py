"""The platform branch on a CPU-only machine (the CUDA/NPU sides run on GPU hosts and in bench/)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine import device
from tests.conftest import REPO, WAIT_S
from tests.fakes import fake_mps_control


def test_cpu_machine():
    if torch.cuda.is_available():
        pytest.skip("this test describes a machine without CUDA")
    assert device.resolve("auto").type in ("cpu", "npu")
    assert device.resolve("cpu") == torch.device("cpu")
    with pytest.raises(RuntimeError, match="CUDA"):
        device.resolve("cuda")
    cpu = torch.device("cpu")
    assert (
        device.default_dtype(cpu) == torch.float32 and device.default_dtype(cpu, "bfloat16") == torch.bfloat16
    )
    assert not device.graphs_supported(cpu) and device.memory_mb(cpu) == 0.0
    assert device.onnx_providers(cpu) == ["CPUExecutionProvider"]


def test_onnx_providers_say_when_the_gpu_provider_is_missing(monkeypatch, caplog):
    """A GPU whose onnxruntime is the CPU build: the CPU provider, and a warning naming what to install; with
    the provider there, it first; the CPU: no warning."""
    import onnxruntime

    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CPUExecutionProvider"])
    with caplog.at_level("WARNING", "engine.device"):
        assert device.onnx_providers(cpu) == ["CPUExecutionProvider"] and not caplog.records
        assert device.onnx_providers(gpu) == ["CPUExecutionProvider"]
    assert "no CUDAExecutionProvider" in caplog.text and "onnxruntime-gpu" in caplog.text
    found = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: found)
    assert device.onnx_providers(gpu) == found


def test_out_of_memory_is_recognised():
    assert device.is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert device.is_out_of_memory(RuntimeError("NPU out of memory"))
    assert not device.is_out_of_memory(ValueError("bad shape"))


def test_captured_call_records_once_after_warmup_and_replays_into_copies(monkeypatch):
    """The CUDA graph calls are replaced by recorders (no GPU here): warm-up runs come first, the capture
    lets other threads keep using the device (thread_local), and each replay returns fresh copies."""
    seen: list = []

    class Graph:
        def replay(self):
            seen.append("replay")

    class Capture:
        def __init__(self, graph, pool=None, capture_error_mode="global"):
            seen.append(("capture", capture_error_mode))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class Stream:
        def wait_stream(self, other):
            pass

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: Capture(None, capture_error_mode="side stream"))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", Capture)

    def fn(x):
        seen.append("run")
        return x * 2, x + 1

    static = torch.zeros(2)
    call = device.CapturedCall(fn, (static,), warmup=2)
    assert seen == [("capture", "side stream"), "run", "run", ("capture", "thread_local"), "run"]
    outs = call.replay(torch.ones(2))
    assert seen[-1] == "replay" and static.tolist() == [1.0, 1.0]  # new values copied into the buffer
    assert len(outs) == 2 and all(o is not s and torch.equal(o, s) for o, s in zip(outs, call.outputs))
    assert call(torch.ones(2)) is not call.output  # the single-output form: a copy of the first


def test_cudnn_attention_puts_cudnn_first_while_entered_and_only_on_cuda():
    """The order is torch state (no device is touched), so a CPU machine checks it; elsewhere than CUDA
    the choice is refused."""
    from torch.nn.attention import SDPBackend

    before = torch._C._get_sdp_priority_order()
    with device.cudnn_attention(torch.device("cuda")):
        order = torch._C._get_sdp_priority_order()
        assert order[:4] == [int(SDPBackend.CUDNN_ATTENTION), *before[:3]]  # then flash, efficient, math
        assert torch.backends.cuda.cudnn_sdp_enabled() and torch.backends.cuda.flash_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
    assert torch._C._get_sdp_priority_order() == before
    with pytest.raises(ValueError, match="CUDA"):
        device.cudnn_attention(torch.device("cpu"))


# ------------------------------------------------------------------ CUDA MPS (a stand-in control program)


@pytest.fixture
def mps_env(tmp_path, monkeypatch):
    """The stand-in nvidia-cuda-mps-control first on PATH; the MPS variables restored after the test."""
    fake_mps_control(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    for name in (device.MPS_PIPE, device.MPS_LOG, device.MPS_THREADS, device.MPS_PRIORITY):
        monkeypatch.setenv(name, "")  # recorded, so the test's value goes afterwards
        monkeypatch.delenv(name)
    return tmp_path / "mps"


def calls(root: Path) -> list[str]:
    return (root / "log" / "calls.log").read_text().split()


def test_mps_daemon_runs_in_its_own_directories_and_is_told_to_quit_on_close(mps_env: Path, monkeypatch):
    monkeypatch.setenv("HOLD_OUTPUT", "40")  # -d returns while its daemon holds the output: no waiting on it
    with device.CudaMps(mps_env, timeout_s=20.0) as mps:
        assert os.environ[device.MPS_PIPE] == str(mps_env / "pipe")  # inherited by the processes we start
        assert os.environ[device.MPS_LOG] == str(mps_env / "log")
        assert calls(mps_env) == ["-d", "get_server_list"]  # started, then asked until it answered
        assert (mps_env / "pipe" / "control").exists() and mps.servers() == []
        with pytest.raises(RuntimeError, match="no MPS server"):  # no client connected yet
            mps.check_serving()
        (mps_env / "pipe" / "server").write_text("4242\n")  # a client initialised CUDA
        assert mps.check_serving() == [4242]
        stopper = mps.stopper
        assert stopper is not None and stopper.poll() is None  # waits for close (or this process's end)
    assert device.MPS_PIPE not in os.environ and device.MPS_LOG not in os.environ
    assert stopper.wait(timeout=WAIT_S) == 0
    assert calls(mps_env)[-1] == "quit" and not (mps_env / "pipe" / "control").exists()


def test_mps_daemon_quits_when_its_process_ends_without_close(mps_env: Path):
    code = (
        "import sys, pathlib; from engine.device import CudaMps; CudaMps(pathlib.Path(sys.argv[1])).start()"
    )
    subprocess.run([sys.executable, "-c", code, str(mps_env)], check=True, timeout=WAIT_S, cwd=REPO)
    deadline = time.monotonic() + WAIT_S  # the stopper sends quit once the process's pipe end closed
    while (mps_env / "pipe" / "control").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not (mps_env / "pipe" / "control").exists() and calls(mps_env)[-1] == "quit"


def test_mps_start_failures_say_why(mps_env: Path, monkeypatch, tmp_path: Path):
    monkeypatch.setenv("FAIL_START", "An MPS daemon needs a GPU")
    with pytest.raises(RuntimeError, match=r"-d failed \(rc 1\): An MPS daemon needs a GPU"):
        device.CudaMps(mps_env).start()
    assert device.MPS_PIPE not in os.environ  # nothing set for the processes started later
    monkeypatch.delenv("FAIL_START")
    monkeypatch.setenv("SILENT_DAEMON", "1")
    silent = device.CudaMps(mps_env, timeout_s=1.0)
    with pytest.raises(RuntimeError, match="did not answer within 1 s"):
        silent.start()
    assert silent.stopper is None and device.MPS_PIPE not in os.environ  # told to quit, nothing exported
    monkeypatch.delenv("SILENT_DAEMON")
    (mps_env / "pipe" / "control").touch()  # another daemon answers there already
    with pytest.raises(RuntimeError, match="already answers"):
        device.CudaMps(mps_env).start()
    monkeypatch.setenv(device.MPS_PIPE, "/tmp/operators-mps")
    with pytest.raises(RuntimeError, match="already set"):
        device.CudaMps(tmp_path / "other").start()
    monkeypatch.delenv(device.MPS_PIPE)
    with pytest.raises(RuntimeError, match="longer than"):
        device.CudaMps(tmp_path / ("x" * 90)).start()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(RuntimeError, match="not on PATH"):
        device.CudaMps(tmp_path / "other").start()


def test_mps_connect_needs_cuda_and_leaves_no_sm_share_behind(mps_env: Path, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this test describes a machine without CUDA")
    mps = device.CudaMps(mps_env)
    with pytest.raises(RuntimeError, match="needs a CUDA device, and this engine runs on cpu"):
        mps.connect("cpu", 60)
    assert device.MPS_THREADS not in os.environ  # vLLM's engine core, started later, keeps every SM
    monkeypatch.setenv(device.MPS_THREADS, "90")  # an operator's own setting comes back afterwards
    with pytest.raises(RuntimeError, match="torch sees no CUDA"):
        mps.connect("cuda", 40)
    assert os.environ[device.MPS_THREADS] == "90"


def test_mps_connect_makes_only_this_context_below_normal(mps_env: Path, monkeypatch):
    """The priority is in the environment while this process's context is made, and gone after it, so
    vLLM's engine core, started later, connects at normal priority; without it nothing is set."""
    seen: list[str | None] = []

    def context(dev: str) -> torch.device:
        seen.append(os.environ.get(device.MPS_PRIORITY))
        return torch.device("cpu")  # no CUDA here: connect then refuses, after the context's moment

    monkeypatch.setattr(device, "resolve", context)
    mps = device.CudaMps(mps_env)
    for below in (True, False):
        with pytest.raises(RuntimeError, match="needs a CUDA device"):
            mps.connect("cuda", None, below_normal=below)
        assert device.MPS_PRIORITY not in os.environ
    assert seen == [device.MPS_BELOW_NORMAL, None]


def test_mps_auto_says_why_it_stays_off(mps_env: Path, monkeypatch, tmp_path: Path):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # a CUDA machine as NVML counts it
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert device.mps_auto_skip("auto", lm_in_own_process=True) is None  # the stand-in is on PATH
    assert device.mps_auto_skip("cuda", lm_in_own_process=True) is None
    assert "the device is cpu" in str(device.mps_auto_skip("cpu", True))
    assert "native backend" in str(device.mps_auto_skip("cuda", lm_in_own_process=False))
    monkeypatch.setenv(device.MPS_PIPE, "/tmp/operators-mps")
    assert "outside the engine" in str(device.mps_auto_skip("cuda", True))
    monkeypatch.delenv(device.MPS_PIPE)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert "no CUDA device" in str(device.mps_auto_skip("auto", True))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert "not on PATH" in str(device.mps_auto_skip("cuda", True))


def test_mps_auto_starts_where_it_can_and_goes_on_without_where_it_cannot(mps_env: Path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    with device.auto_mps(mps_env, "auto", lm_in_own_process=True) as mps:
        assert mps is not None and os.environ[device.MPS_PIPE] == str(mps_env / "pipe")
        assert mps.check_serving() == []  # auto: no server yet is a warning, not an error
    assert device.MPS_PIPE not in os.environ and calls(mps_env)[-1] == "quit"
    monkeypatch.setenv("FAIL_START", "An MPS daemon needs a GPU")
    with device.auto_mps(mps_env, "cuda", lm_in_own_process=True) as mps:
        assert mps is None and device.MPS_PIPE not in os.environ  # time-sliced, serving all the same
    with device.auto_mps(mps_env, "cpu", lm_in_own_process=True) as mps:
        assert mps is None


def test_the_staging_buffer_is_plain_host_memory_for_the_cpu():
    """Page-locked memory needs an accelerator; for the CPU the buffer is ordinary host bytes."""
    from engine.device import staging_bytes

    buf = staging_bytes(5, torch.device("cpu"))
    assert buf.dtype == torch.uint8 and buf.numel() == 5 and buf.device.type == "cpu" and not buf.is_pinned()


def test_worker_streams_exist_on_cuda_only_and_order_after_the_other():
    """The CPU has no streams: none made, the block runs as it is. On CUDA an urgent stream has a higher
    priority (a lower number) than a normal one, and entering one orders it after the other's work."""
    cpu = torch.device("cpu")
    assert device.worker_stream(cpu) is None and device.worker_stream(cpu, urgent=True) is None
    with device.on_stream(None, after=None):
        assert torch.ones(2).sum().item() == 2.0
    if not torch.cuda.is_available():
        return
    gpu = torch.device("cuda", 0)
    normal, urgent = device.worker_stream(gpu), device.worker_stream(gpu, urgent=True)
    assert urgent.priority < normal.priority == torch.cuda.default_stream(gpu).priority
    x = torch.zeros(1 << 20, device=gpu)
    with device.on_stream(normal):
        x += 1
    with device.on_stream(urgent, after=normal):
        y = x * 2  # after normal's add: 2, never 0
    torch.cuda.synchronize(gpu)
    assert y.min().item() == 2.0


REAL_MPS = shutil.which(device.MPS_CONTROL)
BELOW_NORMAL_CLIENT = """
import pathlib, sys, torch
from engine.device import CudaMps
with CudaMps(pathlib.Path(sys.argv[1])) as mps:
    dev = mps.connect("cuda", None, below_normal=True)
    assert (torch.ones(1 << 20, device=dev) * 2).sum().item() == 2 * (1 << 20)
    print("servers", mps.check_serving())
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or REAL_MPS is None, reason="needs CUDA and MPS")
def test_a_below_normal_mps_client_connects_and_computes(tmp_path):
    """The real daemon accepts this process's context at below-normal priority (a fresh process: CUDA
    connects to MPS once, when it first initialises)."""
    done = subprocess.run(
        [sys.executable, "-c", BELOW_NORMAL_CLIENT, str(tmp_path / "mps")],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "servers [" in done.stdout
