"""What vLLM's backends (in this process, or hosted in another: ``engine.lm.lm_host``) do alike on top of
their one primitive, ``tokens`` (a whole prompt of embeddings in, the ids vLLM emits out): a segment's
``generate``, and text-streaming input as rounds (``VLLMSession``). No vLLM import here: the hosted backend
runs these in the server's process, which then never imports vLLM.

``VLLMSession``: vLLM 0.26 has no way to append input to a running request, so each round is a new request
whose prompt is everything fed so far plus the round's input; prefix caching (block hashes cover the prompt
embeddings) finds the earlier rounds' blocks, so a round prefills only ~its own input and the last partial
block. The RAS state continues across rounds (the token history travels in the request).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine.lm.backend import LMRequest
from engine.lm.bistream import Feed, Layout, Round, Table, embed
from engine.lm.speech_lm import SpeechLM


@dataclass(frozen=True)
class Sampling:
    """How one vLLM request samples beside its LMRequest: argmax (``greedy``, the parity check), the ids that
    end it (``ends``; None: its stop ids), the ids before its prompt's end that RAS's window sees
    (``history``: a text-streaming round's)."""

    greedy: bool = False
    ends: tuple[int, ...] | None = None
    history: tuple[int, ...] = ()


class PromptBackend(Protocol):
    """A vLLM backend as the session and ``generate`` use it."""

    dtype: torch.dtype  # vLLM's: prompt embeddings travel in it, on the CPU

    def params(self, req: LMRequest, sampling: Sampling | None = None) -> Any:
        """The request's sampling, as its ``tokens`` takes it (through our RAS processor)."""
        ...

    def tokens(self, prompt: dict[str, Any], params: Any, req: LMRequest) -> AsyncGenerator[int, None]:
        """Every id vLLM emits for one request; closed before its end, the request is aborted."""
        ...


async def generate(backend: PromptBackend, req: LMRequest) -> AsyncIterator[int]:
    """One segment's speech-token ids as sampled (its stop id excluded); closing it aborts the request."""
    prefix, dtype = req.prefix, backend.dtype
    # vLLM takes the prompt on the host: a device tensor's copy waits for its lookups behind whatever the
    # device runs (the flow's calls), so it is made off the event loop, which carries every stream
    on_device = prefix.device.type != "cpu"
    embeds = await asyncio.to_thread(on_host, prefix, dtype) if on_device else on_host(prefix, dtype)
    prompt = {"prompt_embeds": embeds}
    async with contextlib.aclosing(backend.tokens(prompt, backend.params(req), req)) as tokens:
        async for tok in tokens:
            if tok not in req.stop_ids:
                yield tok


def on_host(embeds: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``embeds`` [P, H] as vLLM takes prompt embeddings: on the host, in its dtype."""
    return embeds.detach().to("cpu", dtype)


class VLLMSession:
    """One bistream request on vLLM: a round = a new request over (all fed so far ++ the round's input)."""

    def __init__(self, backend: PromptBackend, lm: SpeechLM, request_id: str, seed: int):
        self.backend, self.lm, self.request_id, self.seed = backend, lm, request_id, seed
        self.layout = Layout.of(lm.config)
        self.specials = sorted(lm.config.stop_ids)
        self.fed: list[torch.Tensor] = []  # [P_i, H] in vLLM's dtype, on the CPU: the prompt so far
        self.history: list[int] = []  # every token appended (fills included): the RAS window
        self.rounds = 0

    def _embeds(self, feeds: tuple[Feed, ...]) -> torch.Tensor:
        with torch.inference_mode():
            return on_host(embed(self.lm, feeds), self.backend.dtype)

    async def _embedded(self, feeds: tuple[Feed, ...]) -> torch.Tensor:
        """``_embeds`` off the event loop: the lookups run on the LM's device, and the copy to the host waits
        for them behind whatever else that device runs (the flow's calls); the loop carries every stream."""
        return await asyncio.to_thread(self._embeds, feeds)

    def _request(self, rnd: Round) -> tuple[LMRequest, list[int]]:
        """The round as a vLLM request: (its LMRequest, the ids that end it)."""
        fill, used = self.layout.fill_id, len(self.history)
        if rnd.final:  # stop ids masked for min_tokens more steps, any of them ends it
            stops, min_len, ends = self.specials, used + rnd.min_tokens, self.specials
        else:  # every special but fill masked for good; fill ends the round
            stops, min_len, ends = [t for t in self.specials if t != fill], 1 << 30, [fill]
        prompt = torch.cat(self.fed)
        rid = f"{self.request_id}:r{self.rounds}"
        return LMRequest(rid, prompt, self.seed, min_len, rnd.budget, tuple(stops)), ends

    async def round(self, rnd: Round) -> AsyncIterator[int]:
        self.fed.append(await self._embedded(rnd.feeds))
        self.rounds += 1
        if rnd.budget == 0:  # nothing may be sampled: a forced fill right after feeding (streaming)
            if not rnd.final:
                self.history.append(self.layout.fill_id)
                yield self.layout.fill_id
            return
        req, ends = self._request(rnd)
        tokens: list[int] = []
        async for tok in self._generate(req, ends):
            tokens.append(tok)
            yield tok
        speech = [t for t in tokens if t < self.layout.speech_token_size]
        if speech:  # fed by the calls that produced the next token (the native KV cache holds them)
            self.fed.append(await self._embedded((Feed(Table.SPEECH, tuple(speech)),)))
        if not rnd.final and len(speech) == rnd.budget:  # budget reached: the loop forces the fill
            self.history.append(self.layout.fill_id)
            yield self.layout.fill_id

    async def _generate(self, req: LMRequest, ends: list[int]) -> AsyncIterator[int]:
        params = self.backend.params(req, Sampling(ends=tuple(ends), history=tuple(self.history)))
        prompt = {"prompt_embeds": req.prefix}
        async with contextlib.aclosing(self.backend.tokens(prompt, params, req)) as ids:
            async for tok in ids:
                self.history.append(tok)
                yield tok

    async def aclose(self) -> None:
        self.fed = []
