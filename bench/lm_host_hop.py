"""``python -m bench.lm_host_hop``: what the LM host's hop (``engine.lm.lm_host``: a Unix-socket connection
per request, one frame per id) adds on each id's way from vLLM's stream to the server's consumer, against the
same stream consumed in the server's process (vLLM's client there, today's default).

A stand-in stream (``Clock``) emits STEPS ids per request, one at once and then one every STEP_MS (a decode
step), each id the monotonic clock in microseconds modulo 2^31: CLOCK_MONOTONIC is one clock for every process
of a host, so the consumer reads each id's age on arrival. N streams run at once. Per arm and N: the ages'
p50 / p99 / max, and a request's start to its first id (the hop's connection and its ASK frame, pickled
embeddings included, on the way of every first chunk). vLLM itself is not involved: this is the hop alone.

    python -m bench.lm_host_hop --streams 1,16,64 --out /tmp/hop
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.config import SamplingConfig
from engine.lm import lm_host
from engine.lm.backend import LMRequest
from engine.lm.vllm_session import PromptBackend, generate

log = logging.getLogger("bench.lm_host_hop")
WRAP = 2**31  # ids are int32 on the wire
PROMPT_ROWS, HIDDEN = 200, 896  # a first segment's prompt embeddings [P, H], as vLLM gets them (bf16)


def clock_us() -> int:
    return time.monotonic_ns() // 1000 % WRAP


class Clock:
    """The stand-in stream: ``req.max_len`` ids, each the clock when it is emitted; ``req.seed`` is the step
    in ms (the host builds it from a spec, which has no field for it)."""

    dtype = torch.bfloat16

    def __init__(self, spec: Any = None):
        self.healthy = True

    def params(self, req: LMRequest, sampling: Any = None) -> None:
        return None

    async def tokens(self, prompt: dict[str, Any], params: Any, req: LMRequest) -> AsyncGenerator[int, None]:
        for i in range(req.max_len):
            if i:
                await asyncio.sleep(req.seed / 1000)
            yield clock_us()

    def close(self) -> None:
        pass


async def one(backend: PromptBackend, rid: str, steps: int, step_ms: int) -> tuple[float, list[int]]:
    """(ms from the request's start to its first id, every id's age on arrival in µs)."""
    req = LMRequest(rid, torch.zeros(PROMPT_ROWS, HIDDEN), step_ms, 0, steps, (-1,))
    began, first, ages = time.monotonic(), None, []
    async for tok in generate(backend, req):
        ages.append((clock_us() - tok) % WRAP)
        first = first if first is not None else (time.monotonic() - began) * 1000
    assert first is not None, "the stream emitted nothing"
    return first, ages


async def wave(backend: PromptBackend, n: int, steps: int, step_ms: int) -> dict[str, float]:
    done = await asyncio.gather(*(one(backend, f"r{n}-{i}", steps, step_ms) for i in range(n)))
    ages = np.array([a for _, got in done for a in got], dtype=float) / 1000  # ms
    firsts = np.array([f for f, _ in done])
    return {
        "streams": n,
        "age_p50_ms": float(np.percentile(ages, 50)),
        "age_p99_ms": float(np.percentile(ages, 99)),
        "age_max_ms": float(ages.max()),
        "first_id_p50_ms": float(np.percentile(firsts, 50)),
        "first_id_max_ms": float(firsts.max()),
    }


async def run(levels: Sequence[int], steps: int, step_ms: int) -> list[dict[str, object]]:
    """Both arms at every level, warmed first; which goes first alternates by level."""
    spec = lm_host.HostSpec(Path("."), SamplingConfig(), 0.0, factory=f"{__name__}:Clock")
    hosted = await asyncio.to_thread(lm_host.HostedLM, spec)
    arms: dict[str, PromptBackend] = {"in_process": Clock(), "lm_host": hosted}
    rows: list[dict[str, object]] = []
    try:
        for backend in arms.values():
            await wave(backend, 4, 5, step_ms)  # the connection path, the host's pickling: warm
        for k, n in enumerate(levels):
            order = list(arms) if k % 2 == 0 else list(reversed(arms))
            for arm in order:
                rows.append({"arm": arm, **await wave(arms[arm], n, steps, step_ms)})
                log.info("%s", rows[-1])
    finally:
        hosted.close()
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", default="1,16,64", help="concurrent streams per wave (default: 1,16,64)")
    p.add_argument("--steps", type=int, default=100, help="ids per stream (default: 100)")
    p.add_argument("--step-ms", type=int, default=20, help="ms between a stream's ids (default: 20)")
    p.add_argument("--out", required=True, help="a folder: lm_host_hop.json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    levels = [int(x) for x in args.streams.split(",")]
    rows = asyncio.run(run(levels, args.steps, args.step_ms))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"steps": args.steps, "step_ms": args.step_ms, "prompt_rows": PROMPT_ROWS, "hidden": HIDDEN}
    (out / "lm_host_hop.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    for row in rows:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
