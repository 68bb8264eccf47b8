"""GPU check of the vLLM backend against the native one (run on a CUDA machine with vLLM installed).

    python -m bench.vllm_check --model DIR [--dtype float32|bfloat16] [--steps 50] [--ras-arms graphs,eager]
        --out result.json

1. greedy parity: the native LM (float32) and vLLM decode ``steps`` argmax tokens from the same prefix
   embeddings with stop ids masked; reports the common prefix length and, where they part, the native
   log-prob gap between the two picks (a near-tie is a precision effect, a large gap a bug);
2. RAS parity: both backends sample with the same seed through the shared sampler; reports agreement;
3. LM throughput on vLLM: tokens/s at batch 1, 16 and 64 (forced lengths).

``--ras-arms graphs,eager`` does 1-3 once per arm (a vLLM start each): the per-step RAS replayed from graphs
against launched op by op, and the two arms' ids at the same seed; ``--lm-profile DIR`` adds vLLM's profiler
over one round of 1 and of 16 decodes per arm (its engine core's ops and kernels: where a step goes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

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
    from engine.lm.vllm_backend import export_hf

    files = validate_model_dir(args.model)
    model = load_model(files, torch.device("cuda"))
    prefix, stop = prefix_of(model), tuple(sorted(model.lm.config.stop_ids))
    native, rows = native_greedy(model, prefix, args.steps)
    nat = NativeLM(model.lm, SamplingConfig())
    try:
        native_ras = await sampled(nat, prefix, args.steps, 7, stop)
    finally:
        nat.close()
    hf_dir = export_hf(model.lm, model.qwen_config, files.llm, Path(args.cache), args.dtype)
    result: dict = {"family": model.family, "dtype": args.dtype, "arms": {}}
    for arm in args.ras_arms:  # one vLLM start each, one after another
        result["arms"][arm] = await check_arm(args, hf_dir, arm, prefix, stop, (native, rows, native_ras))
        log.info("vllm check, arm %s: %s", arm, json.dumps(result["arms"][arm]))
        if args.out:  # kept if a later arm's start fails
            Path(args.out).write_text(json.dumps(result, indent=2))
    ids = {arm: out.pop("ras_ids") for arm, out in result["arms"].items()}
    first = args.ras_arms[0]
    for arm in args.ras_arms[1:]:  # the same seed through each arm's RAS step
        result[f"ras_same_seed_{first}_vs_{arm}"] = {"common_prefix": common_prefix(ids[first], ids[arm])}
    return result


async def check_arm(
    args: argparse.Namespace, hf_dir: Path, arm: str, prefix: torch.Tensor, stop: tuple[int, ...],
    native: tuple[list[int], list[torch.Tensor], list[int]],
) -> dict:  # fmt: skip
    """One vLLM start with the arm's RAS step (``graphs``: replayed; ``eager``: op by op): greedy parity
    with the native LM, RAS agreement with it at one seed, tokens/s at batch 1, 16 and 64."""
    from engine.lm.vllm_backend import VLLMBackend

    greedy_ids, rows, native_ras = native
    profile_dir = str(Path(args.lm_profile) / f"traces_{arm}") if args.lm_profile else None
    vllm = VLLMBackend(
        hf_dir, SamplingConfig(), 0.3, dtype=args.dtype, ras_graphs=arm == "graphs", profile_dir=profile_dir
    )
    out: dict = {}
    try:
        greedy = await vllm.greedy(LMRequest("greedy", prefix, 0, args.steps, args.steps, stop))
        tie = BF16_TIE_NATS if args.dtype == "bfloat16" else FP32_TIE_NATS
        out["greedy"] = parity(greedy_ids, rows, greedy, tie) | {"tie_nats": tie}
        out["ras_ids"] = await sampled(vllm, prefix, args.steps, 7, stop)
        out["ras_same_seed_as_native"] = {"common_prefix": common_prefix(native_ras, out["ras_ids"])}
        await throughput(vllm, prefix, 4, 50, stop)  # warm up CUDA graphs
        for batch in (1, 16, 64):
            out[f"vllm_tokens_per_s_batch{batch}"] = await throughput(vllm, prefix, batch, 250, stop)
        if args.lm_profile:
            out["lm_profiles"] = [
                await profiled(vllm, prefix, b, stop, Path(args.lm_profile), arm) for b in (1, 16)
            ]
    finally:
        vllm.close()
    return out


async def profiled(
    vllm: Any, prefix: torch.Tensor, batch: int, stop: tuple[int, ...], out: Path, arm: str
) -> dict:  # fmt: skip
    """One round of ``batch`` decodes of 250 tokens under vLLM's profiler -> its kernel table, copied to
    OUT/lm_profile_ARM_cBATCH.txt (its totals over the round's 250 steps), and the round's tokens/s."""
    await vllm.start_profile()
    try:
        rate = await throughput(vllm, prefix, batch, 250, stop)
    finally:
        table = await vllm.stop_profile()
    kept = out / f"lm_profile_{arm}_c{batch}.txt"
    shutil.copyfile(table, kept)
    return {"decodes": batch, "steps": 250, "table": kept.name, "tokens_per_s_profiled": rate}


def arm_list(text: str) -> list[str]:
    arms = [a for a in text.split(",") if a]
    if not arms or any(a not in ("graphs", "eager") for a in arms) or len(set(arms)) != len(arms):
        raise argparse.ArgumentTypeError(f"arms: graphs and/or eager, each once, got {text!r}")
    return arms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--cache", default="/tmp/cosystream-vllm")
    parser.add_argument("--out")
    parser.add_argument(
        "--lm-profile", metavar="DIR",
        help="each arm: vLLM's profiler over a round of 1 and of 16 decodes -> DIR/lm_profile_ARM_cN.txt",
    )  # fmt: skip
    parser.add_argument(
        "--ras-arms", type=arm_list, default=["graphs"],
        help="the LM's per-step RAS: graphs (replayed, the default), eager (op by op), or both: graphs,eager",
    )  # fmt: skip
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    result = asyncio.run(run(args))
    text = json.dumps(result, indent=2)
    log.info("vllm check:\n%s", text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
