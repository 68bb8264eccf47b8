"""The LM's per-step RAS replayed from captured graphs: one graph per batch bucket instead of ~40 kernel
launches a step.

``DeviceRAS.step`` runs after every forward of vLLM's engine core, outside vLLM's own CUDA graphs: about 74
top-level aten ops (40 of them kernels) a step, launched one by one from Python, for a 0.5B LM whose graphed
forward is itself a single launch. Captured once per power-of-two batch, the step is one row copy, one fill
and one replay. A bucket pads the batch: the rows past the real ones are marked not in use (``rows_in_use``),
so they change no state and their outputs are dropped; the captures themselves run at 0 rows in use (their
warm-up runs leave every request's state alone). Where graphs are not supported the step runs eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from engine import device as devices
from engine.lm.sampling import DeviceRAS

log = logging.getLogger(__name__)

# (fn, static inputs, pool=, stream=) -> an object with .graph (replay()) and .output, as devices.CapturedCall
Capture = Callable[..., Any]


def batch_bucket(batch: int, rows: int) -> int:
    """The graph that serves ``batch`` rows: the next power of two, at most ``rows`` (the state's rows)."""
    if not 1 <= batch <= rows:
        raise ValueError(f"a RAS step of {batch} rows, the state has {rows}")
    return min(1 << (batch - 1).bit_length(), rows)


class GraphedRAS:
    """``DeviceRAS`` whose ``step`` replays the graph of the batch's bucket (captured on its first use)."""

    def __init__(self, ras: DeviceRAS, device: torch.device, capture: Capture | None = None):
        self.ras, self.device = ras, device
        self.rows = ras.active.shape[0]
        self._capture = capture if capture is not None else devices.CapturedCall
        self._graphs: dict[int, Any] = {}
        self._pool = self._stream = None
        # [] long on the device: how many of a bucket's rows are real this step (0 while capturing)
        self._in_use = torch.zeros((), dtype=torch.long, device=device)

    @property
    def buckets(self) -> list[int]:
        return sorted(self._graphs)

    def step(self, logits: torch.Tensor) -> torch.Tensor:
        """As ``DeviceRAS.step``: logits [B, V] -> logits whose active rows allow exactly the sampled id
        (a view of the bucket's output: read it before the next step)."""
        b = logits.shape[0]
        call = self._graph(batch_bucket(b, self.rows), logits)
        call.inputs[0][:b].copy_(logits)
        self._in_use.fill_(b)
        call.graph.replay()
        return call.output[:b]

    def _graph(self, bucket: int, like: torch.Tensor) -> Any:
        call = self._graphs.get(bucket)
        if call is None:
            call = self._graphs[bucket] = self._record(bucket, like)
            log.info("RAS step graph captured for batches up to %d rows", bucket)
        return call

    def _record(self, bucket: int, like: torch.Tensor) -> Any:
        if self._pool is None and self._capture is devices.CapturedCall:
            self._pool, self._stream = devices.graph_pool(), devices.capture_stream()
        static = torch.zeros(bucket, like.shape[1], dtype=like.dtype, device=like.device)
        self._in_use.fill_(0)  # the warm-up runs and the capture change no request's state
        return self._capture(self._run, (static,), pool=self._pool, stream=self._stream)

    def _run(self, logits: torch.Tensor) -> torch.Tensor:
        return self.ras.step(logits, self._in_use)


def ras_stepper(ras: DeviceRAS, device: torch.device, graphs: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """The step the LM's logits processor calls: replayed from graphs where asked for and supported."""
    if graphs and devices.graphs_supported(device):
        return GraphedRAS(ras, device).step
    return ras.step
