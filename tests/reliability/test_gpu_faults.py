"""Engine faults on a GPU with vLLM (marked gpu: skipped without CUDA or vLLM). On the H200:
``python3 -m pytest -m gpu -s tests/reliability/test_gpu_faults.py`` (prints the measured times).

vLLM's engine core killed mid-stream: the stream ends with an error within ``WAIT_S`` (never a hang) and
the engine reports itself unhealthy (the server then exits with status 3 for its supervisor:
server/shutdown.py). CUDA's out-of-memory error in one flow batch fails that request alone; the next is
served (a batch of several is retried request by request, so at most the request that was alone in its
batch fails). Every wait is bounded, so a hang fails its test instead of eating the GPU session."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import multiprocessing
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine.errors import SynthesisFailed
from engine.request import Mode, SynthesisRequest
from tests.sounds import speech_like

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]
WAIT_S = 180.0


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Any]:
    """A ready engine on vLLM, the bench's full-size random-weight v3 model, bfloat16 as served."""
    from bench.__main__ import random_model
    from engine.config import EngineConfig, Limits
    from engine.serving.engine import TTSEngine

    model = random_model("cosyvoice3", "full", Path.home() / ".cache" / "cosystream")
    cfg = EngineConfig(
        model=str(model), backend="vllm", gpu_memory_utilization=0.2, limits=Limits(max_concurrency=4),
        graph_warmup_s=2.0, voices_dir=str(tmp_path / "voices"),
    )  # fmt: skip
    eng = TTSEngine.load(cfg)
    eng.ready = True
    yield eng
    eng.close()


def request(seed: int, tokens: int = 400) -> SynthesisRequest:
    prompt = (speech_like(3.0, 24000), 24000)
    return SynthesisRequest(
        text="Hello there.", mode=Mode.CROSS_LINGUAL, prompt_audio=prompt, seed=seed, forced_tokens=tokens
    )


async def healthy_within(engine: Any, want: bool, limit_s: float) -> float | None:
    """Seconds until ``engine.healthy`` is ``want`` (None: not within ``limit_s``), on the caller's loop:
    vLLM's ``AsyncLLM`` runs its output handler on the loop of its first request and reports itself dead
    once that loop is gone, so every check stays inside one ``asyncio.run``."""
    t0 = time.perf_counter()
    while engine.healthy != want:
        if time.perf_counter() - t0 > limit_s:
            return None
        await asyncio.sleep(0.05)
    return time.perf_counter() - t0


def test_killing_the_engine_core_mid_stream_ends_the_stream_and_marks_the_engine_unhealthy(engine) -> None:
    async def run() -> tuple[BaseException | None, float, float | None]:
        got: list[np.ndarray] = []
        killed = time.perf_counter()
        error: BaseException | None = None
        async with contextlib.aclosing(engine.stream(request(1))) as chunks:
            try:
                async for chunk in chunks:
                    got.append(chunk.pcm)
                    if len(got) == 1:
                        assert engine.healthy, "healthy while its first chunk streams"
                        cores = multiprocessing.active_children()
                        assert cores, "vLLM's engine core runs in a child process"
                        for core in cores:
                            core.kill()
                        killed = time.perf_counter()
            except Exception as err:  # the error the stream ends with is the test's subject
                error = err
        ended_s = time.perf_counter() - killed
        return error, ended_s, await healthy_within(engine, False, WAIT_S)

    error, ended_s, unhealthy_s = asyncio.run(asyncio.wait_for(run(), WAIT_S * 2))
    assert error is not None, "the stream completed although its engine core was killed"
    assert unhealthy_s is not None, "the engine still says it is healthy"
    print(f"engine core killed: stream ended in {ended_s:.2f} s ({type(error).__name__}: {error}); "
          f"unhealthy {unhealthy_s:.2f} s after that")  # fmt: skip


def test_out_of_memory_in_a_flow_batch_fails_that_request_alone(engine, monkeypatch) -> None:
    real, raised = engine.token2wav._flow, []

    def flow(utts: Any, chunks: Any) -> Any:  # the first flow batch runs out of memory, once
        if not raised:
            raised.append(True)
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real(utts, chunks)

    monkeypatch.setattr(engine.token2wav, "_flow", flow)

    async def one(seed: int) -> np.ndarray | BaseException:
        try:
            return np.concatenate([c.pcm async for c in engine.stream(request(seed, 100))])
        except SynthesisFailed as err:
            return err

    async def run() -> tuple[list[np.ndarray | BaseException], np.ndarray | BaseException, bool]:
        first = await asyncio.gather(*(one(seed) for seed in (5, 6, 7, 8)))
        after = await one(7)  # the same request again, on the same loop: served
        # health read on this loop too: vLLM's output handler ends with the loop of its first request,
        # after which its AsyncLLM reads errored whatever happened before
        return first, after, engine.healthy

    results, after, healthy = asyncio.run(asyncio.wait_for(run(), WAIT_S))
    failed = [r for r in results if isinstance(r, BaseException)]
    assert raised and len(failed) <= 1 and all("out of memory" in str(f) for f in failed)
    assert sum(isinstance(r, np.ndarray) and np.isfinite(r).all() for r in results) >= 3
    assert isinstance(after, np.ndarray) and after.size > 0 and healthy
    assert engine.token2wav.healthy  # the worker that met the OOM is still running
