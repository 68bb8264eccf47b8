"""The flow solver alone, per kernel variant: device ms per 10-step solve at graph-bucket shapes, first-call
(compile + capture) seconds, and fidelity against the float32 eager solve. Random weights at the released
architecture (or tiny); no LM, no checkpoint on disk. A GPU tool; the CPU runs it at tiny size (tests).

    python -m bench.flow_kernels --family v3 --device cuda --out DIR [--shapes 1x200,16x400] [--variants ...]

Variants: ``autocast`` (fp32 weights under bf16 autocast: the solver before compiled estimators), ``bf16``
(weights held in bf16, eager estimator) and ``compiled`` (weights in bf16, TorchInductor). On CUDA each is
replayed as a CUDA graph, as the engine does.

``--stream-calls``: one stream's non-final flow calls (their total frames, e.g. the bench request's
250,350,550) at ``--stream-batches`` streams, through the engine's graphed compiled solver recomputing every
call (``full``) and reusing finished frames from its page pool (``reuse``): device ms per stream's calls,
and the reused mel's error against the recomputed one.

``--sdpa``: the attention kernels SDPA may pick, in order (e.g. ``cudnn`` or ``flash,efficient``; default:
torch's own choice, which with the estimators' dense chunk mask is the memory-efficient kernel on the H200).
The choice holds while the variants compile and capture, and its compiled kernels get a cache of their own.
``--attention``: the engine's choices (``EngineConfig.flow_attention``): ``mask``, ``folded`` or ``cudnn``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from engine import device as devices
from engine.config import FLOW_ATTENTION
from engine.flow.cfm import CausalCFM, CfmConfig, CfmInputs
from engine.flow.compiled_estimator import use_compile_cache
from engine.flow.dit import DiT, DiTConfig
from engine.flow.graphs import GraphedCFM
from engine.flow.unet import CausalConditionalDecoder, UNetConfig

log = logging.getLogger(__name__)
VARIANTS = ("autocast", "bf16", "compiled")
SDPA_BACKENDS = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                 "math": "MATH"}  # fmt: skip
Solve = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class Timing:
    variant: str
    batch: int
    frames: int
    first_call_s: float  # the variant's first call at this shape: compile (if any) + capture
    ms_per_solve: float  # one 10-step CFG solve of the whole batch
    frames_per_s: float  # mel frames solved per second (batch x frames / time)


@dataclass(frozen=True)
class StreamCalls:
    batch: int  # streams, each one row of every call
    calls: tuple[int, ...]  # each call's total frames (prompt included)
    full_ms: float  # device ms of the calls recomputing every frame
    reuse_ms: float  # the same calls reusing finished frames
    relative_rms: float  # RMS(reused - recomputed) / std(recomputed), over the frames each call adds


@dataclass(frozen=True)
class Fidelity:
    variant: str
    streaming: bool
    relative_rms: float  # RMS(mel - fp32 eager mel) / std(fp32 eager mel), valid frames


def build_cfm(family: str, size: str, dev: torch.device) -> CausalCFM:
    """The CFM solver around a randomly initialised estimator of the released (or a tiny) size."""
    torch.manual_seed(0)
    estimator: nn.Module
    if family == "v3":
        cfg = DiTConfig() if size == "full" else DiTConfig(dim=64, depth=2, heads=4, dim_head=16)
        estimator = DiT(cfg)
    else:
        unet = UNetConfig() if size == "full" else UNetConfig(channels=(64,), n_blocks=1, num_mid_blocks=1)
        estimator = CausalConditionalDecoder(unet)
    return CausalCFM(CfmConfig(), estimator).to(dev).eval()


def solver(cfm: CausalCFM, variant: str, streaming: bool) -> Solve:
    """The variant's solve on the bucket tensors (mu, mask, spks, cond) -> mel [B,80,T] float32."""
    if variant == "autocast":
        fast = cfm
    else:
        low = torch.float32 if device_of(cfm).type == "cpu" else torch.bfloat16
        fast = GraphedCFM(cfm, low, compiled=variant == "compiled").solver
    dev = device_of(cfm)

    def run(mu: Tensor, mask: Tensor, spks: Tensor, cond: Tensor) -> Tensor:
        zero = torch.zeros(mu.size(0), dtype=torch.long, device=mu.device)
        use_autocast = variant == "autocast" and dev.type == "cuda"
        with torch.autocast(dev.type, torch.bfloat16, enabled=use_autocast):
            return fast(CfmInputs(mu, mask, spks, cond, zero, zero), streaming).float()

    return run


def bucket_inputs(batch: int, frames: int, dev: torch.device, seed: int = 0) -> tuple[Tensor, ...]:
    """mu, mask, spks, cond of a batch whose rows end at different frames (as a bucket's real rows do)."""
    g = torch.Generator().manual_seed(seed)
    mu = torch.randn(batch, 80, frames, generator=g)
    mask = torch.ones(batch, 1, frames)
    for row in range(batch):
        mask[row, :, frames - (row * 37) % (frames // 2) :] = 0
    cond = torch.zeros(batch, 80, frames)
    cond[:, :, : frames // 4] = torch.randn(batch, 80, frames // 4, generator=g)
    spks = torch.randn(batch, 80, generator=g)
    return tuple(t.to(dev) for t in (mu, mask, spks, cond))


def sdpa_backends(names: str) -> contextlib.AbstractContextManager[object]:
    """``--sdpa`` ("cudnn", "flash,efficient", ...; "" = torch's choice) -> the context that restricts it."""
    if not names:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, SDPA_BACKENDS[n]) for n in names.split(",")])


def device_of(cfm: CausalCFM) -> torch.device:
    """Where the weights are (the noise buffer is a plain attribute that stays on the CPU)."""
    return next(cfm.parameters()).device


def time_variant(cfm: CausalCFM, variant: str, batch: int, frames: int, repeats: int) -> Timing:
    dev = device_of(cfm)
    run = solver(cfm, variant, streaming=True)
    inputs = bucket_inputs(batch, frames, dev)
    t0 = time.perf_counter()
    with torch.inference_mode():
        call: Solve = devices.CapturedCall(run, inputs) if dev.type == "cuda" else run
        call(*inputs)
        devices.synchronize(dev)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(repeats):
            call(*inputs)
        devices.synchronize(dev)
    ms = 1000 * (time.perf_counter() - t0) / repeats
    return Timing(variant, batch, frames, round(first, 2), round(ms, 2), round(batch * frames / ms * 1000))


def fidelity(cfm: CausalCFM, variant: str, streaming: bool, batch: int = 2, frames: int = 400) -> Fidelity:
    inputs = bucket_inputs(batch, frames, device_of(cfm), seed=1)
    with torch.inference_mode():
        ref = _reference(cfm, inputs, streaming)
        low = solver(cfm, variant, streaming)(*inputs)
    valid = inputs[1].bool().expand_as(ref)
    rel = (ref[valid] - low[valid]).pow(2).mean().sqrt() / ref[valid].std()
    return Fidelity(variant, streaming, round(float(rel), 5))


def _reference(cfm: CausalCFM, inputs: tuple[Tensor, ...], streaming: bool) -> Tensor:
    """The float32 eager solve with TF32 off: the reference's arithmetic, on the kernels torch picks for it
    whatever ``--sdpa`` allows the variant (cuDNN's and flash's take no float32: with ``--sdpa cudnn`` the
    reference had no kernel on the H200)."""
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        mu, mask, spks, cond = inputs
        zero = torch.zeros(mu.size(0), dtype=torch.long, device=mu.device)
        with sdpa_backends("efficient,math"):
            return cfm(CfmInputs(mu, mask, spks, cond, zero, zero), streaming).float()
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def time_stream_calls(cfm: CausalCFM, batch: int, calls: list[int], repeats: int) -> StreamCalls:
    """``calls`` for ``batch`` streams in step (one flow call each), full and reusing, as CUDA graphs."""
    dev = device_of(cfm)
    low = torch.float32 if dev.type == "cpu" else torch.bfloat16
    full, reuse = GraphedCFM(cfm, low, compiled=True), GraphedCFM(cfm, low, compiled=True)
    reuse.enable_reuse(batch * (max(calls) // 50 + 1) * 100e6, 800, dev)
    if not devices.graphs_supported(dev):  # CPU: the same calls uncaptured
        full.graphs.frozen = reuse.graphs.frozen = True
    steps = [stream_call_inputs(batch, frames, dev) for frames in calls]

    def stream(graphed: GraphedCFM, reusing: bool) -> list[Tensor]:
        caches = [reuse.frame_cache(None) for _ in range(batch)] if reusing else []  # type: ignore[arg-type]
        with torch.inference_mode():
            return [graphed.forward_cached(x, caches) if reusing else graphed(x, True) for x in steps]

    ms = []
    for graphed, reusing in ((full, False), (reuse, True)):
        stream(graphed, reusing)  # compile and capture
        devices.synchronize(dev)
        t0 = time.perf_counter()
        for _ in range(repeats):
            mels = stream(graphed, reusing)
        devices.synchronize(dev)
        ms.append(1000 * (time.perf_counter() - t0) / repeats)
    want, got = stream(full, False), stream(reuse, True)
    new = [(w[..., a:b], g[..., a:b]) for w, g, a, b in zip(want, got, [0, *calls], calls)]
    ref, err = torch.cat([w for w, _ in new], 2), torch.cat([g - w for w, g in new], 2)
    rel = float(err.pow(2).mean().sqrt() / ref.std())
    del mels
    return StreamCalls(batch, tuple(calls), round(ms[0], 2), round(ms[1], 2), float(f"{rel:.3g}"))


def stream_call_inputs(batch: int, frames: int, dev: torch.device) -> CfmInputs:
    """A non-final call of ``frames`` frames for every stream: the first 200 frames are the prompt; the
    same mu, cond and speaker per frame in every call (as a request's calls see them)."""
    g = torch.Generator().manual_seed(2)
    mu = torch.randn(batch, 80, 2000, generator=g)[:, :, :frames]
    cond = torch.zeros(batch, 80, frames)
    cond[:, :, :200] = torch.randn(batch, 80, 200, generator=g)
    spks = torch.randn(batch, 80, generator=g)
    mask = torch.ones(batch, 1, frames)
    prompt, total = torch.full((batch,), 200), torch.full((batch,), frames)
    return CfmInputs(*(t.to(dev) for t in (mu, mask, spks, cond, prompt, total)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.flow_kernels", description=__doc__)
    p.add_argument("--family", choices=("v2", "v3"), default="v3")
    p.add_argument("--size", choices=("full", "tiny"), default="full")
    p.add_argument("--device", default="cuda")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {VARIANTS}")
    p.add_argument("--shapes", default="1x200,16x400,16x800,32x400", help="batch x frames buckets")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "cosystream" / "compile"))
    p.add_argument("--no-fidelity", dest="fidelity", action="store_false", help="timings only")
    p.add_argument("--stream-calls", default="", help="one stream's call frames, e.g. 250,350,550")
    p.add_argument("--stream-batches", default="1,16", help="streams for --stream-calls")
    p.add_argument(
        "--sdpa", default="", help=f"attention kernels SDPA may use, comma list of {sorted(SDPA_BACKENDS)}"
    )
    p.add_argument(
        "--attention", choices=FLOW_ATTENTION, default="mask",
        help="the estimator's attention (EngineConfig.flow_attention): a dense mask, folded into q/k dims "
        "(no mask tensor), or the dense mask with cuDNN's kernel tried first",
    )  # fmt: skip
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    unknown = set(args.variants.split(",")) - set(VARIANTS) - {""}
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}")
    if set(args.sdpa.split(",")) - set(SDPA_BACKENDS) - {""}:
        p.error(f"--sdpa takes a comma list of {sorted(SDPA_BACKENDS)}, got {args.sdpa!r}")
    return args


def main(argv: list[str] | None = None) -> dict[str, object]:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    # kernels compiled under another SDPA choice call other attention ops: a cache of their own
    cache = Path(args.cache_dir)
    if args.sdpa or args.attention == "cudnn":
        cache = cache / (f"sdpa-{args.sdpa}" if args.sdpa else "attention-cudnn")
    use_compile_cache(cache)
    with sdpa_backends(args.sdpa), kernel_order(args.attention, torch.device(args.device)):
        return _measure(args)


def kernel_order(attention: str, dev: torch.device) -> contextlib.AbstractContextManager[object]:
    """``--attention cudnn``: the engine's kernel order (cuDNN first, then torch's; falls back silently,
    unlike ``--sdpa cudnn``, which fails where cuDNN cannot run)."""
    return devices.cudnn_attention(dev) if attention == "cudnn" else contextlib.nullcontext()


def _measure(args: argparse.Namespace) -> dict[str, object]:
    dev = torch.device(args.device)
    cfm = build_cfm(args.family, args.size, dev)
    if args.attention == "folded":
        cfm.fold_attention()
    shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",")]
    timings: list[dict[str, object]] = []
    checks: list[dict[str, object]] = []
    report = {"family": args.family, "size": args.size, "sdpa": args.sdpa or "default",
              "attention": args.attention, "timings": timings, "fidelity": checks}  # fmt: skip
    out = Path(args.out) / f"flow_kernels_{args.family}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    streams: list[dict[str, object]] = []
    report["stream_calls"] = streams
    for batch in [int(b) for b in args.stream_batches.split(",")] if args.stream_calls else []:
        calls = [int(n) for n in args.stream_calls.split(",")]
        streams.append(asdict(time_stream_calls(cfm, batch, calls, args.repeats)))
        log.info("%s", streams[-1])
        out.write_text(json.dumps(report, indent=1))
    for variant in args.variants.split(",") if args.variants else []:
        for batch, frames in shapes:
            timings.append(asdict(time_variant(cfm, variant, batch, frames, args.repeats)))
            log.info("%s", timings[-1])
            out.write_text(json.dumps(report, indent=1))  # after every step: a cut-short run keeps its part
        for streaming in (True, False) if args.fidelity else ():
            checks.append(asdict(fidelity(cfm, variant, streaming)))
            log.info("%s", checks[-1])
            out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
