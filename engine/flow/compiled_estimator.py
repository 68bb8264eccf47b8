"""The flow estimator (v3 DiT, v2 U-Net) as the GPU runs it fastest, behind the same call.

Two changes, each measured on the H200 (BENCHMARKS.md, "what each optimisation bought"):
- weights held in the compute dtype (bfloat16): autocast re-cast every weight on every graph replay;
  buffers (the DiT's RoPE frequencies) and the flow-time embedding stay float32, since bf16 positions
  above 256 and bf16 times t are not exact; the solver keeps x in float32 and casts at this boundary;
- the estimator compiled by TorchInductor with dynamic shapes (one program for every bucket; the CUDA
  graphs in ``flow_graphs`` then record its fused kernels): the DiT's time is mostly elementwise chains
  (AdaLN modulation, RoPE, gating, GELU) that Inductor fuses. Traced without duck shaping: a batch or
  page-table width that happens to equal a model size (16 streams and 16 heads, 2 prefix pages and the
  k/v pair) would otherwise share its symbol, be specialised with it, and cost one more compile per bucket
  (precapture compiled the page windows 4-7 times instead of once; the page tables reach the estimator
  with a row per CFG row, ``PagedRows``, so that a batch of 1 does not need a program of its own either).
Compiled kernels land in a persistent cache directory, so a restart reuses them instead of recompiling;
with ``precompiled`` (a directory) the whole programs too, loaded without tracing (engine.flow.precompiled).
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.fx.experimental import _config as shape_config

from engine.cache_root import set_by_cache_root

if TYPE_CHECKING:
    from engine.flow.aot_package import AotPrograms

log = logging.getLogger(__name__)


class CompiledEstimator(nn.Module):
    """Drop-in for a CFM's estimator: ``forward(x, mask, mu, t, spks, cond, streaming) -> [B,80,T]``
    float32, computed in ``dtype`` (a cast copy of the weights; float32 shares the original module)."""

    def __init__(
        self,
        estimator: nn.Module,
        dtype: torch.dtype,
        compiled: bool,
        cast: bool = True,
        programs: AotPrograms | None = None,
        precompiled: Path | None = None,
        compile_child: bool = False,
    ) -> None:
        super().__init__()
        self.dtype, self.compiled = dtype, compiled or programs is not None
        self.precompiled = precompiled  # where the whole compiled programs are kept (None: not kept)
        self.compile_child = compile_child  # a program ``precompiled`` lacks: compiled by a child process
        keep = dtype == torch.float32 or not cast  # not cast: ``estimator`` already holds ``dtype`` weights
        self.inner = estimator if keep else cast_parameters(estimator, dtype)
        # page windows (engine.flow.dit_pages, unet_pages), compiled alike on first use
        paged = getattr(self.inner, "forward_paged", None)
        self.run: Callable[..., Tensor] = self.inner.__call__  # a callable, not a second name of the module
        self.run_paged: Callable[..., tuple[Tensor, ...]] | None = paged
        if programs is not None:  # compiled ahead of time (engine.flow.aot_package), bound to ``inner``
            self.run, self.run_paged = programs.whole(self.inner), programs.windows(paged)
        elif compiled:
            self.run = self._compiled("forward", self.inner)
            self.run_paged = self._compiled("forward_paged", paged) if paged is not None else None

    def _compiled(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` (``inner``'s method ``name``) compiled; with ``precompiled`` its programs loaded from there
        (or compiled whole and saved), today's program their fallback."""
        if self.precompiled is None:
            return _compiled(fn)
        from engine.flow.compile_child import compile_elsewhere
        from engine.flow.precompiled import Precompiled  # Dynamo: seconds to import, only when compiled

        method = getattr(type(self.inner), name)
        elsewhere = compile_elsewhere if self.compile_child else None
        return Precompiled(method, self.inner, self.precompiled, name, _compiled(fn), elsewhere)

    def twin(self, compiled: bool) -> CompiledEstimator:
        """The same weights (shared, not copied), run eager or by TorchInductor: the engine serves on the
        eager twin while the compiled one is built in the background."""
        return CompiledEstimator(
            self.inner, self.dtype, compiled, cast=False, precompiled=self.precompiled,
            compile_child=self.compile_child,
        )  # fmt: skip

    def with_programs(self, programs: AotPrograms) -> CompiledEstimator:
        """The same weights run by ``programs`` (built ahead of time and bound to them)."""
        return CompiledEstimator(self.inner, self.dtype, compiled=False, cast=False, programs=programs)

    def forward(
        self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor, streaming: bool
    ) -> Tensor:
        low = (a.to(self.dtype) for a in (x, mask, mu))
        return self.run(*low, t.float(), spks.to(self.dtype), cond.to(self.dtype), streaming).float()

    def forward_paged(
        self, x: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor, *pool: Tensor
    ) -> tuple[Tensor, ...]:
        """The estimator's ``forward_paged`` in ``dtype`` -> (velocity float32, what it keeps, ``dtype``)."""
        if self.run_paged is None:
            raise TypeError(f"{type(self.inner).__name__} has no page windows")
        low = (a.to(self.dtype) for a in (x, mu))
        v, *kept = self.run_paged(*low, t.float(), spks.to(self.dtype), cond.to(self.dtype), *pool)
        return v.float(), *kept


def _compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` compiled with dynamic shapes (the graph buckets vary batch and frames; one program serves
    them all), traced with every input size as its own symbol (no duck shaping): only real constraints,
    such as the 0/1 specialisation of a batch of 1, make a shape need a program of its own."""
    program = torch.compile(fn, dynamic=True)

    def run(*args: Any) -> Any:
        with shape_config.patch(use_duck_shape=False):  # type: ignore[attr-defined]
            return program(*args)

    return run


def cast_parameters(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy with every parameter in ``dtype``; buffers keep theirs (RoPE frequencies stay float32)."""
    low = copy.deepcopy(module)
    for param in low.parameters():
        param.data = param.data.to(dtype)
    return low


def use_compile_cache(root: Path) -> Path:
    """Point Inductor's and Triton's on-disk caches at ``root`` (unless the operator already set them),
    so compiled kernels outlive the process: a warm restart loads them instead of compiling again."""
    root.mkdir(parents=True, exist_ok=True)
    # importing torch._dynamo writes Inductor's default (a temp dir) into the environment: that one is ours
    # to replace, as is the cache root's general choice (engine.cache_root); a value the operator chose is not
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir  # Dynamo: seconds to import

    inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    ours = set_by_cache_root("TORCHINDUCTOR_CACHE_DIR")
    if inductor in (None, os.path.abspath(default_cache_dir())) or ours:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
    if "TRITON_CACHE_DIR" not in os.environ or set_by_cache_root("TRITON_CACHE_DIR"):
        os.environ["TRITON_CACHE_DIR"] = str(root / "triton")
    inductor_config = torch._inductor.config  # type: ignore[attr-defined]
    inductor_config.fx_graph_cache = True
    log.info("compile cache in %s", os.environ["TORCHINDUCTOR_CACHE_DIR"])
    return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
