"""Built by the LM host in tests/engine/lm/test_lm_host.py in place of vLLM (not installed here): a vLLM
backend's surface, its ids telling what reached it. Seeds pick behaviours: 7 slow (10 ms an id), 13 a request
that fails, 66 an engine that dies with its request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import torch

SLOW, FAILS, DIES = 7, 13, 66
FIRST_ID = 100  # the counted ids start here


class StandIn:
    """``tokens`` yields the prompt's rows, len(history), then FIRST_ID, FIRST_ID + 1, ...: max_len ids, as
    vLLM stops at max_tokens. Notes ``aborted-<id>`` and ``closed`` in its folder."""

    dtype = torch.float32

    def __init__(self, spec: Any):
        if spec.export.name == "missing":
            raise FileNotFoundError(f"no model at {spec.export}")
        self.folder: Path = spec.export
        self.healthy = True

    def params(self, req: Any, sampling: Any = None) -> dict[str, Any]:
        return {"history": list(sampling.history) if sampling else []}

    async def tokens(
        self, prompt: dict[str, Any], params: dict[str, Any], req: Any
    ) -> AsyncGenerator[int, None]:
        finished = False
        try:
            if req.seed == FAILS:
                raise ValueError(f"seed {FAILS} is refused")
            if req.seed == DIES:
                self.healthy = False
                raise RuntimeError("the engine core died")
            told = [prompt["prompt_embeds"].shape[0], len(params["history"])]
            for tok in [*told, *range(FIRST_ID, FIRST_ID + req.max_len - 2)][: req.max_len]:
                if req.seed == SLOW:
                    await asyncio.sleep(0.01)
                yield tok
            finished = True
        finally:
            if not finished:
                (self.folder / f"aborted-{req.request_id}").touch()

    def close(self) -> None:
        (self.folder / "closed").touch()
