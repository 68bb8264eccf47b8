"""``python -m bench.aot_check``: can the flow estimator be served from an AOTInductor package instead of
``torch.compile`` in the serving process? (Dynamo's tracing there stalls the first requests: BENCHMARKS.md,
"Start-up".) For one family's estimator (random weights at the released or a tiny size) it times
``torch.export`` with dynamic batch and frames, the AOTInductor compile into a package, the package's load,
and checks the package against the eager estimator at shapes other than the exported one, with each one's
ms per call.

    python -m bench.aot_check --family v3 --size tiny --device cpu --out /tmp/aot      # CPU (needs g++)
    python -m bench.aot_check --family v3 --size full --device cuda --out $OUT/aot_v3  # the H200

Writes OUT/aot_check.json. The page-window program (``forward_paged``) is not covered here; on the tiny v3
model on a CPU it exported with dynamic batch, frames and page widths and matched to 1e-6 (2026-12-02).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from bench.__main__ import FAMILIES
from bench.flow_kernels import build_cfm
from engine import device as devices

log = logging.getLogger("bench.aot_check")
SHAPES = ((2, 100), (1, 300), (16, 400))  # (batch, frames): exported at the first, checked at all


class FullSolve(nn.Module):
    """The estimator's streaming forward with positional tensors only, as export takes them."""

    def __init__(self, estimator: nn.Module):
        super().__init__()
        self.estimator = estimator

    def forward(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor) -> Tensor:
        return self.estimator(x, mask, mu, t, spks, cond, True)


@dataclass(frozen=True)
class ShapeCheck:
    batch: int
    frames: int
    max_abs_diff: float  # package vs eager
    eager_ms: float
    package_ms: float


def inputs(batch: int, frames: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, ...]:
    """x, mask, mu [B,80,T], t [B], spks [B,80], cond [B,80,T] (t float32, as the solver passes it)."""
    g = torch.Generator().manual_seed(batch * 10_000 + frames)
    mel = [torch.randn(batch, 80, frames, generator=g) for _ in range(3)]
    x, mu, cond = (m.to(device, dtype) for m in mel)
    mask = torch.ones(batch, 1, frames, device=device, dtype=dtype)
    t, spks = torch.rand(batch, generator=g).to(device), torch.randn(batch, 80, generator=g).to(device, dtype)
    return x, mask, mu, t, spks, cond


def ms_per_call(fn: Any, args: tuple[Tensor, ...], device: torch.device, calls: int = 5) -> float:
    fn(*args)  # warm
    devices.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    devices.synchronize(device)
    return (time.perf_counter() - t0) / calls * 1e3


def check(args: argparse.Namespace) -> dict[str, Any]:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    # the estimator alone, randomly initialised at the family's size: no model directory to write and load
    solve = FullSolve(build_cfm(args.family, args.size, device).estimator.to(dtype)).eval()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with torch.inference_mode():
        runner, timings = export_and_load(solve, device, dtype, out / "estimator.pt2")
        checks = [shape_check(solve, runner, b, f, device, dtype) for b, f in SHAPES]
    result = {"family": FAMILIES[args.family], "size": args.size, "device": str(device), "dtype": args.dtype}
    result |= {"torch": torch.__version__, **{k: round(v, 3) for k, v in timings.items()}}
    result["shapes"] = [asdict(c) for c in checks]
    (out / "aot_check.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def export_and_load(
    solve: nn.Module, device: torch.device, dtype: torch.dtype, package: Path
) -> tuple[Any, dict[str, float]]:
    """Export with dynamic batch and frames, compile into ``package``, load it -> (runner, seconds each)."""
    batch, frames = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("frames", min=2, max=4096)
    mel = {0: batch, 2: frames}
    dims = {"x": mel, "mask": mel, "mu": mel, "t": {0: batch}, "spks": {0: batch}, "cond": mel}
    timings, t0 = {}, time.perf_counter()
    program = torch.export.export(solve, inputs(*SHAPES[0], device, dtype), dynamic_shapes=dims)
    timings["export_s"], t0 = time.perf_counter() - t0, time.perf_counter()
    path = torch._inductor.aoti_compile_and_package(program, package_path=str(package))
    timings["aoti_compile_s"], t0 = time.perf_counter() - t0, time.perf_counter()
    runner = torch._inductor.aoti_load_package(path)
    timings["load_s"] = time.perf_counter() - t0
    return runner, timings


def shape_check(
    solve: nn.Module, runner: Any, batch: int, frames: int, device: torch.device, dtype: torch.dtype
) -> ShapeCheck:
    args = inputs(batch, frames, device, dtype)
    diff = (runner(*args).float() - solve(*args).float()).abs().max().item()
    return ShapeCheck(
        batch, frames, diff, ms_per_call(solve, args, device), ms_per_call(runner, args, device)
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.aot_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--family", choices=sorted(FAMILIES), default="v3")
    p.add_argument("--size", choices=("tiny", "full"), default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    result = check(parse_args(argv))
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
