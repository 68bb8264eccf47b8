"""engine.lm.vllm_session without vLLM: a fake backend answers each round's request."""

from __future__ import annotations

import threading
from collections.abc import AsyncGenerator
from typing import Any

import torch

from engine.lm import vllm_session
from engine.lm.backend import LMRequest
from engine.lm.bistream import Feed, Layout, Round, Table
from engine.lm.speech_lm import SpeechLM, SpeechLMConfig


class Backend:
    """vLLM as the session uses it: every round answers two speech ids; the prompts it was sent, kept."""

    dtype = torch.bfloat16

    def __init__(self) -> None:
        self.prompts: list[torch.Tensor] = []

    def params(self, req: LMRequest, sampling: Any = None) -> Any:
        return sampling

    async def tokens(self, prompt: dict[str, Any], params: Any, req: LMRequest) -> AsyncGenerator[int, None]:
        self.prompts.append(prompt["prompt_embeds"])
        for tok in (3, 5):
            yield tok


async def test_a_rounds_embeddings_are_made_off_the_event_loop_and_reach_vllm_on_the_host(monkeypatch):
    """Each round's feeds and the speech ids fed back are embedded on a worker thread, not on the loop that
    carries every stream (a host copy there waited for the device behind the flow's calls); the prompt that
    reaches vLLM is all fed so far, on the host in vLLM's dtype."""
    config = SpeechLMConfig(
        family="cosyvoice2", hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
        intermediate_size=32, text_vocab_size=64,
    )  # fmt: skip
    lm = SpeechLM(config)
    threads: list[int] = []
    real = vllm_session.embed

    def recorded(model: SpeechLM, feeds: tuple[Feed, ...]) -> torch.Tensor:
        threads.append(threading.get_ident())
        return real(model, feeds)

    monkeypatch.setattr(vllm_session, "embed", recorded)
    backend = Backend()
    session = vllm_session.VLLMSession(backend, lm, "bi", seed=0)
    ids = [t async for t in session.round(Round((Feed(Table.TEXT, (1, 2, 3, 4)),), budget=2, final=False))]
    assert ids == [3, 5, Layout.of(config).fill_id]  # the budget's two speech ids, then the forced fill
    await session.aclose()
    assert len(threads) == 2 and threading.get_ident() not in threads  # the text, then the ids fed back
    (prompt,) = backend.prompts
    assert prompt.device.type == "cpu" and prompt.dtype == torch.bfloat16 and prompt.shape == (4, 16)


async def test_a_prefix_made_on_a_device_reaches_the_host_off_the_event_loop(monkeypatch):
    """A segment's prompt embeddings made on a device (the GPU's prefix) are copied to the host on a worker
    thread (the copy waits for the device); a prefix already on the host is cast where it is."""
    threads: list[int] = []
    real = vllm_session.on_host

    def recorded(embeds: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        threads.append(threading.get_ident())
        return torch.zeros(embeds.shape, dtype=dtype) if embeds.device.type == "meta" else real(embeds, dtype)

    monkeypatch.setattr(vllm_session, "on_host", recorded)
    for device in ("meta", "cpu"):  # meta: a device tensor that no host copy can read, standing in for CUDA
        backend = Backend()
        req = LMRequest(f"seg-{device}", torch.ones(3, 16, device=device), 0, 1, 4, (7,))
        assert [t async for t in vllm_session.generate(backend, req)] == [3, 5]
        (prompt,) = backend.prompts
        assert prompt.device.type == "cpu" and prompt.dtype == torch.bfloat16 and prompt.shape == (3, 16)
    device_thread, host_thread = threads
    assert device_thread != threading.get_ident() and host_thread == threading.get_ident()
