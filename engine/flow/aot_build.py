"""The child process that builds the flow estimator's ahead-of-time programs (engine.flow.aot_package):
the estimator at its architecture with random weights, its calls recorded as the engine's solver makes them,
each program exported, AOTInductor-compiled without weights and checked against eager at other sizes, the
set written to its folder whole or not at all.

    python -m engine.flow.aot_build SPEC.json OUT_DIR      # what AotBuild runs
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import json
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn

from engine import device as devices
from engine.flow.aot_package import MANIFEST, TOLERANCE, AotSpec, PagedWindow, WholeCall, export_and_load
from engine.flow.cfm import CausalCFM, CfmInputs
from engine.flow.compiled_estimator import CompiledEstimator
from engine.flow.dit_pages import PageLayout
from engine.flow.graphs import GraphedCFM, _page_sizes

log = logging.getLogger(__name__)


def build(spec: AotSpec, out: Path) -> dict[str, Any]:
    """Record the estimator's calls, export, compile and check each of ``spec.programs`` into ``out``
    (built in a folder beside it and renamed, so ``out`` is complete or absent) -> the manifest."""
    cfm = spec.build_cfm()
    dev, dtype = torch.device(spec.device), getattr(torch, spec.dtype)
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    manifest: dict[str, Any] = {"spec": dataclasses.asdict(spec), "torch": torch.__version__}
    with _attention(spec, dev), torch.inference_mode():
        calls = record_calls(cfm, dtype, spec.programs)
        for name in spec.programs:
            manifest[name] = _program(name, cfm.estimator, calls[name], tmp / f"{name}.pt2", spec.dtype)
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return manifest


def _attention(spec: AotSpec, dev: torch.device) -> Any:
    return devices.cudnn_attention(dev) if spec.cudnn else contextlib.nullcontext()


def _program(
    name: str, estimator: nn.Module, calls: list[tuple[Tensor, ...]], package: Path, dtype: str
) -> dict[str, Any]:
    """Export ``name`` at its first recorded call, compile, load and compare with eager at its last."""
    module = (PagedWindow(estimator) if name == "paged" else WholeCall(estimator, name == "streaming")).eval()
    first, last = calls[0], calls[-1]
    dims = tuple({d: torch.export.Dim.AUTO for d in range(a.dim())} for a in first)  # type: ignore[attr-defined]
    runner, timings = export_and_load(module, first, dims, package, weights=False)
    got, want = _outputs(runner(*last)), _outputs(module(*last))
    scale = max(w.float().abs().max().item() for w in want if w.numel()) or 1.0
    diff = max((g.float() - w.float()).abs().max().item() for g, w in zip(got, want) if w.numel())
    if diff > TOLERANCE[dtype] * scale:
        raise ValueError(f"the {name} program differs from eager by {diff:.3g} (outputs up to {scale:.3g})")
    shapes = {"exported_at": [list(a.shape) for a in first], "checked_at": [list(a.shape) for a in last]}
    log.info("flow program %s: %s, differs from eager by %.2g of %.2g", name, timings, diff, scale)
    return {**timings, "max_abs_diff": diff, "output_scale": scale, **shapes}


def _outputs(out: Tensor | tuple[Tensor, ...] | list[Tensor]) -> tuple[Tensor, ...]:
    return tuple(out) if isinstance(out, tuple | list) else (out,)


def record_calls(cfm: CausalCFM, dtype: torch.dtype, programs: tuple[str, ...]) -> dict[str, list[tuple]]:
    """Each program's estimator calls as the engine's solver makes them (every solver step's inputs,
    cloned contiguous): a stream's first call, then calls of two streams with other sizes. The page
    windows through a pool of their own, as ``GraphedCFM.forward_cached`` runs them."""
    dev = next(cfm.parameters()).device
    graphed = GraphedCFM(cfm, dtype, compiled=False)
    estimator = cast(CompiledEstimator, graphed.solver.estimator)
    calls: dict[str, list[tuple]] = {name: [] for name in programs}
    whole, paged = estimator.run, estimator.run_paged

    def record_whole(*args: Any) -> Tensor:
        calls["streaming" if args[-1] else "final"].append(tuple(a.contiguous().clone() for a in args[:-1]))
        return whole(*args)

    def record_paged(*args: Tensor) -> Any:
        calls["paged"].append(tuple(a.contiguous().clone() for a in args))
        assert paged is not None
        return paged(*args)

    estimator.run, estimator.run_paged = record_whole, record_paged
    for streams, frames in ((1, 250), (2, 350)):
        inputs = _example_inputs(streams, frames, dev)
        if "final" in programs:
            graphed.solver(inputs, False)
        if "streaming" in programs:
            graphed.solver(inputs, True)
    if "paged" in programs:
        sizes = _page_sizes(cfm)
        if sizes is None:
            raise TypeError(f"{type(cfm.estimator).__name__} has no page windows")
        _stream_windows(graphed, sizes, dev)
    return {name: calls[name] for name in programs}


def _stream_windows(graphed: GraphedCFM, sizes: tuple[int, ...], dev: torch.device) -> None:
    """A stream's first streaming call, then two streams' first two (the second reads the first's pages
    through a wider page table), through a pool of 64 pages."""
    steps, depth, heads, dim_head, mel, chunk, _, states = sizes
    page = PageLayout.page_bytes(steps, depth, heads, dim_head, mel, chunk, states)
    if not graphed.enable_reuse(63 * page, 800, dev):
        raise ValueError("no page pool for the window programs")
    graphed.graphs.frozen = True  # uncaptured: the eager calls are what is recorded
    for streams, frames in ((1, (250,)), (2, (250, 350))):
        caches = [graphed.frame_cache(None) for _ in range(streams)]  # type: ignore[arg-type]
        for n in frames:
            graphed.forward_cached(_example_inputs(streams, n, dev), caches)


def _example_inputs(batch: int, frames: int, dev: torch.device) -> CfmInputs:
    """A call of ``frames`` frames for every row, the first 100 of them the prompt's (random values: the
    programs depend on shapes, not values)."""
    g = torch.Generator().manual_seed(batch * 1000 + frames)
    mu, cond = torch.randn(batch, 80, frames, generator=g), torch.zeros(batch, 80, frames)
    cond[:, :, :100] = torch.randn(batch, 80, 100, generator=g)
    spks, mask = torch.randn(batch, 80, generator=g), torch.ones(batch, 1, frames)
    prompt, total = torch.full((batch,), 100), torch.full((batch,), frames)
    return CfmInputs(*(t.to(dev) for t in (mu, mask, spks, cond, prompt, total)))


def main(argv: list[str] | None = None) -> int:
    """The child: ``SPEC.json OUT_DIR`` -> builds the set into OUT_DIR (exit 0), or fails (exit 1)."""
    args = sys.argv[1:] if argv is None else argv
    faulthandler.enable()  # a native crash (export, compile, load) prints every thread's Python stack
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    fields = json.loads(Path(args[0]).read_text())
    spec = AotSpec(**{**fields, "programs": tuple(fields["programs"])})
    build(spec, Path(args[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
