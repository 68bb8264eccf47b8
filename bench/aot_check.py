"""``python -m bench.aot_check``: can the flow estimator be served from an AOTInductor package instead of
``torch.compile`` in the serving process? (Dynamo's tracing there stalls the first requests: BENCHMARKS.md,
"Start-up".) For one family's estimator (random weights at the released or a tiny size) it times
``torch.export`` with dynamic batch and frames, the AOTInductor compile into a package, the package's load,
and checks the package against the eager estimator at shapes other than the exported one, with each one's
ms per call.

    python -m bench.aot_check --family v3 --size tiny --device cpu --out /tmp/aot      # CPU (needs g++)
    python -m bench.aot_check --family v3 --size full --device cuda --out $OUT/aot_v3  # the H200

Then the same for the page-window program (``forward_paged``: a streaming call that reuses a stream's
finished frames, the serving path of v3's streams): its inputs are recorded from two real calls of one
stream through ``GraphedCFM.forward_cached`` (a first call, and a later one with a wider prefix), exported
at the first with every size left to ``torch.export`` (``Dim.AUTO``: rows, frames, page-table width and the
pool's pages dynamic where the program allows), compiled, loaded, and checked against eager at the second.

Writes OUT/aot_check.json (``paged`` holds the page-window program's part; null for an estimator without
page windows).
"""

from __future__ import annotations

import argparse
import faulthandler
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
from engine.flow.aot_build import record_calls
from engine.flow.aot_package import PagedWindow, WholeCall, export_and_load
from engine.flow.cfm import CausalCFM
from engine.flow.graphs import _page_sizes

log = logging.getLogger("bench.aot_check")
SHAPES = ((2, 100), (1, 300), (16, 400))  # (batch, frames): exported at the first, checked at all


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
    cfm = build_cfm(args.family, args.size, device)
    solve = WholeCall(cfm.estimator.to(dtype), streaming=True).eval()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with torch.inference_mode():
        example = inputs(*SHAPES[0], device, dtype)
        runner, timings = export_and_load(solve, example, full_solve_dims(), out / "estimator.pt2")
        checks = [shape_check(solve, runner, b, f, device, dtype) for b, f in SHAPES]
    result = {"family": FAMILIES[args.family], "size": args.size, "device": str(device), "dtype": args.dtype}
    result |= {"torch": torch.__version__, **timings}
    result["shapes"] = [asdict(c) for c in checks]
    result["paged"] = paged_check(cfm, dtype, out / "paged.pt2")
    (out / "aot_check.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def full_solve_dims() -> dict[str, dict[int, Any]]:
    """The streaming ``WholeCall``'s dynamic sizes: batch and frames, shared by every input that has them."""
    batch, frames = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("frames", min=2, max=4096)
    mel = {0: batch, 2: frames}
    return {"x": mel, "mask": mel, "mu": mel, "t": {0: batch}, "spks": {0: batch}, "cond": mel}


def paged_calls(cfm: CausalCFM, dtype: torch.dtype) -> list[tuple[Tensor, ...]] | None:
    """The estimator's ``forward_paged`` inputs, every solver step's, as the engine's solver passes them
    (``aot_build.record_calls``: a stream's first streaming call, then two streams' first two, the second
    reading the first's pages through a wider page table); None for an estimator without windows."""
    if _page_sizes(cfm) is None:
        return None
    with torch.inference_mode():
        return record_calls(cfm, dtype, ("paged",))["paged"]


def paged_check(cfm: CausalCFM, dtype: torch.dtype, package: Path) -> dict[str, Any] | None:
    """Export the page-window program at the first call's inputs (every size ``Dim.AUTO``), compile,
    load, and compare it with eager at the last call's (twice the rows, a wider prefix, other frames)."""
    calls = paged_calls(cfm, dtype)
    if calls is None:
        return None
    window = PagedWindow(cfm.estimator.to(dtype)).eval()
    first, last = calls[0], calls[-1]
    dims = tuple({d: torch.export.Dim.AUTO for d in range(a.dim())} for a in first)
    with torch.inference_mode():
        runner, timings = export_and_load(window, first, dims, package)
        got, want = runner(*last), window(*last)
        diff = max((g.float() - w.float()).abs().max().item() for g, w in zip(got, want) if w.numel())
        dev = first[0].device
        eager_ms, package_ms = ms_per_call(window, last, dev), ms_per_call(runner, last, dev)
    shapes = {"exported_at": [list(a.shape) for a in first], "checked_at": [list(a.shape) for a in last]}
    return {**timings, "max_abs_diff": diff, "eager_ms": eager_ms, "package_ms": package_ms, **shapes}


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
    faulthandler.enable()  # a native crash prints every thread's Python stack (aot_package logs each step)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    result = check(parse_args(argv))
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
