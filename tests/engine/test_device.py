"""The platform branch on a CPU-only machine (the CUDA/NPU sides run on GPU hosts and in bench/)."""

from __future__ import annotations

import pytest
import torch

from engine import device


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
