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
