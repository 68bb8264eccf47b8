"""vLLM backend on a GPU (marked gpu: skipped without CUDA; vLLM itself must be importable).

On the H200: ``python3 -m pytest -m gpu tests/engine/lm/test_vllm_backend.py``. The models are the bench's
full-size random-weight ones (built once into ~/.cache/cosystream/bench, shared with ``python -m bench``), in
bfloat16 as served: the configuration bench/vllm_check.py passed on the H200. The float32 variant on a small
model hung there (2026-11-30: vLLM's flex attention engine started, the first request never returned).
Every wait is bounded, so a hang fails its test instead of eating the GPU session.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util

import numpy as np
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]


WAIT_S = 180.0  # one greedy run or one 16-stream wave; the engine start is not inside it


@pytest.fixture(scope="module", params=["cosyvoice2", "cosyvoice3"])
def model_dir(request):
    """v2 carries the decoder bias our logits processor adds; v3 has none."""
    from pathlib import Path

    from bench.__main__ import random_model

    return random_model(request.param, "full", Path.home() / ".cache" / "cosystream")


def bounded(coro):
    return asyncio.run(asyncio.wait_for(coro, WAIT_S))


def test_greedy_tokens_match_the_native_backend_to_the_bf16_tolerance(model_dir, tmp_path):
    from bench.vllm_check import BF16_TIE_NATS, native_greedy, parity, prefix_of
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
        export_hf(model.lm, model.qwen_config, files.llm, tmp_path, "bfloat16"), SamplingConfig(), 0.2
    )
    try:
        got = bounded(backend.greedy(LMRequest("g", prefix, 0, 50, 50, stop)))
    finally:
        backend.close()
    # the native reference runs in true float32; bf16 may part from it only at a near-tie
    assert parity(native, rows, got, BF16_TIE_NATS)["within_tolerance"]


def vllm_engine(model_dir, max_concurrency: int, handover: bool = False, lm_host: bool = False):
    """A ready TTSEngine on vLLM; graphs pre-captured for mel up to 100 frames only, so these requests'
    longer flow calls take the uncaptured path. Without ``handover`` every request runs on vLLM; with
    ``lm_host`` vLLM's client runs in a host process of its own (engine.lm.lm_host)."""
    from engine.config import EngineConfig, Limits
    from engine.serving.engine import TTSEngine

    cfg = EngineConfig(
        model=str(model_dir),
        backend="vllm",
        gpu_memory_utilization=0.2,
        limits=Limits(max_concurrency=max_concurrency),
        graph_warmup_s=2.0,
        lm_handover=handover,
        lm_host=lm_host,
    )
    engine = TTSEngine.load(cfg)
    engine.ready = True
    return engine


@pytest.mark.parametrize("lm_host", [False, True], ids=["in_process", "lm_host"])
def test_engine_streams_with_the_vllm_backend(model_dir, lm_host):
    from engine.request import Mode, SynthesisRequest
    from tests.sounds import speech_like

    engine = vllm_engine(model_dir, max_concurrency=16, lm_host=lm_host)
    assert type(engine.backend).__name__ == ("HostedLM" if lm_host else "VLLMBackend")
    prompt = (speech_like(3.0, 24000), 24000)

    async def one(i: int) -> np.ndarray:
        req = SynthesisRequest(
            text="Hello there.", mode=Mode.CROSS_LINGUAL, prompt_audio=prompt, seed=i, forced_tokens=100
        )
        return np.concatenate([c.pcm async for c in engine.stream(req)])

    async def run() -> list[np.ndarray]:
        return await asyncio.gather(*(one(i) for i in range(16)))

    async def leave_after_the_first_chunk() -> int:
        req = SynthesisRequest(
            text="Hello there.", mode=Mode.CROSS_LINGUAL, prompt_audio=prompt, seed=99, forced_tokens=400
        )
        async with contextlib.aclosing(engine.stream(req)) as chunks:
            async for _ in chunks:
                break
        return engine.backend.active  # the vLLM request was aborted when the stream closed

    try:
        outs = bounded(run())
        assert bounded(leave_after_the_first_chunk()) == 0
    finally:
        engine.close()
    # 100 tokens -> up to 4 s (v3 drops silent tokens past a run of 5 before the flow)
    assert all(0 < o.size <= 100 * 960 and o.size % 480 == 0 and np.isfinite(o).all() for o in outs)


@pytest.mark.parametrize("lm_host", [False, True], ids=["in_process", "lm_host"])
def test_text_streaming_requests_run_on_the_vllm_backend(model_dir, lm_host):
    """Bistream on vLLM (a new request per round, prefix caching): 4 live requests, words as they come."""
    from engine.request import Mode, SynthesisRequest
    from tests.sounds import speech_like

    engine = vllm_engine(model_dir, max_concurrency=4, lm_host=lm_host)
    prompt = (speech_like(2.0, 24000), 24000)
    text = "Text written by a language model arrives here one word after another, and we speak it."
    words = text.split(" ")

    async def pieces():
        for i, word in enumerate(words):
            await asyncio.sleep(0.02)
            yield word if i == 0 else " " + word

    async def one(i: int):
        req = SynthesisRequest(
            mode=Mode.CROSS_LINGUAL, prompt_audio=prompt, seed=i, forced_tokens=150, text_stream=pieces()
        )
        return [c async for c in engine.stream(req)]

    async def run():
        return await asyncio.gather(*(one(i) for i in range(4)))

    try:
        results = bounded(run())
    finally:
        engine.close()
    for chunks in results:
        audio = np.concatenate([c.pcm for c in chunks])
        assert chunks[-1].is_last and chunks[-1].metrics.lm_tokens >= 150
        assert audio.size > 0 and np.isfinite(audio).all() and chunks[-1].metrics.ttfa_ms is not None


def test_the_engine_serves_on_native_while_vllm_starts_and_hands_over(model_dir):
    """The handover on the real pair: ready before vLLM is up, a stream in flight at the switch finishes
    on the native loop, new ones go to vLLM, the native loop is then closed."""
    from engine.request import Mode, SynthesisRequest
    from tests.sounds import speech_like

    engine = vllm_engine(model_dir, max_concurrency=4, handover=True)
    prompt = (speech_like(3.0, 24000), 24000)

    async def one(seed: int) -> np.ndarray:
        req = SynthesisRequest(
            text="Hello there.", mode=Mode.CROSS_LINGUAL, prompt_audio=prompt, seed=seed, forced_tokens=100
        )
        return np.concatenate([c.pcm async for c in engine.stream(req)])

    async def on_vllm() -> tuple[np.ndarray, bool]:
        # health read on the loop that served: vLLM's output handler is a task of that loop, and a loop
        # closed under it (each asyncio.run) reads as an errored engine; a server keeps one loop
        audio = await one(1)
        return audio, engine.healthy

    try:
        assert engine.lm_backend == "native"  # vLLM's start takes tens of seconds: it is still on
        before = bounded(one(0))
        assert engine.backend.wait_settled(WAIT_S) and engine.lm_backend == "vllm"
        assert not engine.backend.first.healthy  # retired: its decode thread has ended
        after, healthy = bounded(on_vllm())
        assert engine.backend.active == 0 and healthy
    finally:
        engine.close()
    assert all(0 < o.size <= 100 * 960 and np.isfinite(o).all() for o in (before, after))
