"""The flow's 10-step CFM solve as replayed CUDA graphs, at bucketed shapes, of a compiled bf16 estimator.

Eager, one solve launches thousands of small kernels (10 steps x the estimator's layers) and the GPU idles
between them; a captured graph replays them in one launch. Shapes are bucketed: batch to a power of two,
frames up to a multiple of ``frame_bucket``. Padding is exact for the real rows and frames: padded frames
are masked out of attention and every conv is causal (left context only), and padded rows are independent.
Graphs are captured lazily on first use of a bucket and kept in an LRU (``graph_cache``); ``precapture``
records every bucket up to a batch and length before serving (the engine's load), so no request pays for
a capture: after it, a shape beyond those buckets runs the (compiled) solver uncaptured.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.profiler import record_function

from engine import device as devices
from engine.compiled_estimator import CompiledEstimator
from engine.graph_cache import GraphCache, bucket, largest_first
from engine.models.flow import CausalCFM, CfmInputs


class GraphedCFM(nn.Module):
    """Drop-in for ``flow.decoder``: same ``forward(inputs, streaming) -> mel [B, 80, T] float32``.

    The solver runs a ``CompiledEstimator``: weights cast to ``dtype`` once (float32 keeps the original
    module and the exact reference path), optionally compiled by TorchInductor.
    """

    def __init__(
        self,
        cfm: CausalCFM,
        dtype: torch.dtype = torch.float32,
        frame_bucket: int = 100,
        max_graphs: int = 128,  # > the 80 buckets of batch 1-16 x 100-800 frames x streaming: no re-captures
        compiled: bool = False,
    ):
        super().__init__()
        self.cfm, self.frame_bucket = cfm, frame_bucket
        self.solver = cfm.with_estimator(CompiledEstimator(cfm.estimator, dtype, compiled))
        self.graphs = GraphCache("flow solver", max_graphs)

    def bucket(self, batch: int, frames: int) -> tuple[int, int]:
        return bucket(batch, frames, self.frame_bucket)

    def forward(self, inputs: CfmInputs, streaming: bool) -> Tensor:
        b, frames = inputs.mu.size(0), inputs.mu.size(2)
        if frames > self.cfm.noise.size(2) - self.frame_bucket:
            return self.solver(inputs, streaming)  # near the noise buffer's end: no padding room
        bb, tt = self.bucket(b, frames)
        call = self._graph(bb, tt, streaming, inputs.mu.device)
        with record_function("t2w.flow.solver"):
            padded = _padded(inputs, bb, tt)
            # precaptured, and not this bucket: no capture on a request's path, but the bucket's shape (the
            # compiled estimator was traced at bucket shapes; a raw length could cost a recompile)
            out = self._solver(streaming)(*padded) if call is None else call(*padded)
        return out[:b, :, :frames]

    def precapture(self, max_batch: int, max_frames: int, device: torch.device) -> int:
        """Capture every (batch, frames, streaming) bucket up to these sizes; returns how many there are."""
        max_frames = min(max_frames, self.cfm.noise.size(2) - self.frame_bucket)
        top_batch, top_frames = self.bucket(max_batch, max(max_frames, 1))
        keys = [
            (batch, frames, streaming)
            for batch, frames in largest_first(top_batch, top_frames, self.frame_bucket)
            for streaming in (True, False)
        ]
        return self.graphs.precapture(keys, lambda key: self._graph(*key, device), device)

    def _graph(
        self, batch: int, frames: int, streaming: bool, dev: torch.device
    ) -> devices.CapturedCall | None:
        return self.graphs.get(
            (batch, frames, streaming), self._solver(streaming), lambda: _statics(batch, frames, dev)
        )

    def _solver(self, streaming: bool):
        def run(mu: Tensor, mask: Tensor, spks: Tensor, cond: Tensor) -> Tensor:
            frames = torch.zeros(mu.size(0), dtype=torch.long, device=mu.device)
            return self.solver(CfmInputs(mu, mask, spks, cond, frames, frames), streaming)

        return run


def _statics(batch: int, frames: int, dev: torch.device) -> tuple[Tensor, ...]:
    """float32 input buffers (the estimator casts at its boundary, inside the graph): mu, mask, spks, cond."""
    mu = torch.zeros(batch, 80, frames, device=dev)
    mask = torch.zeros(batch, 1, frames, device=dev)
    mask[:, :, :1] = 1  # padded rows keep one valid frame so no attention row is empty
    return mu, mask, torch.zeros(batch, 80, device=dev), torch.zeros_like(mu)


def _padded(inputs: CfmInputs, batch: int, frames: int) -> tuple[Tensor, ...]:
    """The real rows/frames in the top-left corner of bucket-sized tensors; the rest zero (masked)."""
    mu, mask, spks, cond = _statics(batch, frames, inputs.mu.device)
    b, t = inputs.mu.size(0), inputs.mu.size(2)
    mu[:b, :, :t], cond[:b, :, :t], spks[:b] = inputs.mu, inputs.cond, inputs.spks
    mask[:b] = 0
    mask[:b, :, :t] = inputs.mask
    return mu, mask, spks, cond
