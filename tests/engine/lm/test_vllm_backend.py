"""vLLM backend on a GPU (marked gpu: skipped without CUDA; vLLM itself must be importable).

On the H200: ``python3 -m pytest -m gpu tests/engine/lm/test_vllm_backend.py``;
bench/vllm_check.py runs the same checks at full size.
"""

from __future__ import annotations

import asyncio
import importlib.util

import numpy as np
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]


@pytest.fixture(scope="module", params=["cosyvoice2", "cosyvoice3"])
def model_dir(request, tmp_path_factory):
    """v2 carries the decoder bias our logits processor adds; v3 has none. "small": vLLM compiles its
    float32 attention only for head dims >= 16 (tiny has 8: the H200 run failed to start the engine)."""
    from bench.make_model import build_model_dir

    return build_model_dir(tmp_path_factory.mktemp(request.param), request.param, "small")


def test_greedy_tokens_match_the_native_backend_in_float32(model_dir, tmp_path):
    from bench.vllm_check import FP32_TIE_NATS, native_greedy, parity, prefix_of
    from engine.checkpoint import load_model
    from engine.config import SamplingConfig
    from engine.hub import validate_model_dir
    from engine.lm.backend import LMRequest
    from engine.lm.vllm_backend import VLLMBackend, export_hf

    files = validate_model_dir(model_dir)
    model = load_model(files, torch.device("cuda"))
    prefix, stop = prefix_of(model), tuple(sorted(model.lm.config.stop_ids))
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # true fp32: an engine loaded earlier turned TF32 on
    try:
        native, rows = native_greedy(model, prefix, 50)
    finally:
        torch.set_float32_matmul_precision(precision)
    backend = VLLMBackend(
        export_hf(model.lm, model.qwen_config, files.llm, tmp_path, "float32"),
        SamplingConfig(),
        0.1,
        dtype="float32",
    )
    try:
        got = asyncio.run(backend.greedy(LMRequest("g", prefix, 0, 50, 50, stop)))
    finally:
        backend.close()
    assert parity(native, rows, got, FP32_TIE_NATS)["within_tolerance"]  # only a float near-tie may differ


def test_engine_streams_with_the_vllm_backend(model_dir):
    from engine.config import EngineConfig, Limits
    from engine.engine import TTSEngine
    from engine.request import Mode, SynthesisRequest
    from tests.sounds import speech_like

    engine = TTSEngine.load(
        EngineConfig(
            model=str(model_dir),
            backend="vllm",
            gpu_memory_utilization=0.1,
            limits=Limits(max_concurrency=16),
        )
    )
    engine.ready = True
    prompt = (speech_like(3.0, 24000), 24000)

    async def one(i: int) -> np.ndarray:
        req = SynthesisRequest(
            text="Hello there.", mode=Mode.CROSS_LINGUAL, prompt_audio=prompt, seed=i, forced_tokens=100
        )
        return np.concatenate([c.pcm async for c in engine.stream(req)])

    async def run() -> list[np.ndarray]:
        return await asyncio.gather(*(one(i) for i in range(16)))

    try:
        outs = asyncio.run(run())
    finally:
        engine.close()
    # 100 tokens -> up to 4 s (v3 drops silent tokens past a run of 5 before the flow)
    assert all(0 < o.size <= 100 * 960 and o.size % 480 == 0 and np.isfinite(o).all() for o in outs)
