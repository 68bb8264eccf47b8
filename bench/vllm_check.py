"""GPU check of the vLLM backend against the native one (run on a CUDA machine with vLLM installed).

    python -m bench.vllm_check --model DIR [--dtype float32|bfloat16] [--steps 50] --out result.json

1. greedy parity: the native LM (float32) and vLLM decode ``steps`` argmax tokens from the same prefix
   embeddings with stop ids masked; reports the common prefix length and, where they part, the native
   log-prob gap between the two picks (a near-tie is a precision effect, a large gap a bug);
2. RAS parity: both backends sample with the same seed through the shared sampler; reports agreement;
3. LM throughput on vLLM: tokens/s at batch 1 and at batch 64 (forced lengths).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from pathlib import Path

import torch

from engine.checkpoint import LoadedModel, load_model
from engine.config import SamplingConfig
from engine.hub import validate_model_dir
from engine.lm.backend import LMBackend, LMRequest
from engine.lm.native import NativeLM

log = logging.getLogger(__name__)


def prefix_of(model: LoadedModel, seed: int = 0) -> torch.Tensor:
    """A zero-shot-shaped prefix: 30 text ids and 50 prompt speech ids, fixed by ``seed``."""
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(0, 150000, (30,), generator=g)
    speech = torch.randint(0, 6561, (50,), generator=g)
    with torch.inference_mode():
        return model.lm.prefix_embeds(text, None, speech).float()


@torch.inference_mode()
def native_greedy(
    model: LoadedModel, prefix: torch.Tensor, steps: int
) -> tuple[list[int], list[torch.Tensor]]:
    lm, stop = model.lm, sorted(model.lm.config.stop_ids)
    cache = lm.new_cache()
    hidden = lm.prefill(prefix.to(model.device), cache)
    tokens, rows = [], []
    for _ in range(steps):
        logp = lm.logprobs(hidden[None])[0]
        logp[stop] = -float("inf")
        tokens.append(int(logp.argmax()))
        rows.append(logp.cpu())
        hidden = lm.decode(lm.speech_embeds(torch.tensor([tokens[-1]])), [cache])[0]
    return tokens, rows


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# Greedy sequences of two precisions may part only at a near-tie: where they split, the reference (fp32)
# log-prob of its own pick may exceed that of the other pick by less than this (nats). bf16 keeps ~3
# significant digits, so logits of a few units carry errors of a few hundredths; a real export or prefix
# bug shows as a split at a clear winner (gaps of tenths or more).
BF16_TIE_NATS = 0.05
FP32_TIE_NATS = 1e-3


def parity(
    native: list[int], rows: list[torch.Tensor], other: list[int], tie_nats: float = BF16_TIE_NATS
) -> dict:
    """Compare ``other``'s greedy ids with the native ones; ``rows`` are the native log-probs per step."""
    same = common_prefix(native, other)
    gap = None if same >= len(native) else float(rows[same][native[same]] - rows[same][other[same]])
    ok = gap is None or gap < tie_nats
    return {"steps": len(native), "common_prefix": same, "logp_gap_at_split": gap, "within_tolerance": ok}


async def sampled(
    backend: LMBackend, prefix: torch.Tensor, n: int, seed: int, stop: tuple[int, ...]
) -> list[int]:
    req = LMRequest(f"ras-{backend.name}-{seed}", prefix, seed, n, n, stop)
    return [t async for t in backend.generate(req)]


async def throughput(
    backend: LMBackend, prefix: torch.Tensor, batch: int, n: int, stop: tuple[int, ...]
) -> float:
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(sampled(backend, prefix, n, 1000 + i, stop) for i in range(batch)))
    return sum(len(o) for o in outs) / (time.perf_counter() - t0)


async def run(args: argparse.Namespace) -> dict:
    from engine.lm.vllm_backend import VLLMBackend, export_hf

    files = validate_model_dir(args.model)
    model = load_model(files, torch.device("cuda"))
    prefix, stop = prefix_of(model), tuple(sorted(model.lm.config.stop_ids))
    native, rows = native_greedy(model, prefix, args.steps)
    hf_dir = export_hf(model.lm, model.qwen_config, files.llm, Path(args.cache), args.dtype)
    vllm = VLLMBackend(hf_dir, SamplingConfig(), 0.3, dtype=args.dtype)
    result: dict = {"family": model.family, "dtype": args.dtype}
    try:
        greedy = await vllm.greedy(LMRequest("greedy", prefix, 0, args.steps, args.steps, stop))
        tie = BF16_TIE_NATS if args.dtype == "bfloat16" else FP32_TIE_NATS
        result["greedy"] = parity(native, rows, greedy, tie) | {"tie_nats": tie}
        nat = NativeLM(model.lm, SamplingConfig())
        a, b = (
            await sampled(nat, prefix, args.steps, 7, stop),
            await sampled(vllm, prefix, args.steps, 7, stop),
        )
        nat.close()
        result["ras_same_seed"] = {"common_prefix": common_prefix(a, b)}
        await throughput(vllm, prefix, 4, 50, stop)  # warm up CUDA graphs
        for batch in (1, 16, 64):
            result[f"vllm_tokens_per_s_batch{batch}"] = await throughput(vllm, prefix, batch, 250, stop)
    finally:
        vllm.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--cache", default="/tmp/cosystream-vllm")
    parser.add_argument("--out")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    result = asyncio.run(run(args))
    text = json.dumps(result, indent=2)
    log.info("vllm check:\n%s", text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
