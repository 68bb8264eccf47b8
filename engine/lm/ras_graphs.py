"""The LM's per-step RAS replayed from captured graphs: one graph per batch bucket instead of ~40 kernel
launches a step.

``DeviceRAS.step`` runs after every forward of vLLM's engine core, outside vLLM's own CUDA graphs: about 74
top-level aten ops (40 of them kernels) a step, launched one by one from Python, for a 0.5B LM whose graphed
forward is itself a single launch. Captured once per power-of-two batch, the step is one row copy, one fill
and one replay. A bucket pads the batch: the rows past the real ones are marked not in use (``rows_in_use``),
so they change no state and their outputs are dropped; the captures themselves run at 0 rows in use (their
warm-up runs leave every request's state alone), all of them at the first step, before any request is served.
Where graphs are not supported the step runs eagerly.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import cast

import torch

from engine import device as devices
from engine.graph_cache import GraphCache
from engine.lm.sampling import DeviceRAS

log = logging.getLogger(__name__)


def every_bucket(rows: int) -> list[int]:
    """The buckets of a state of ``rows`` rows: the powers of two below it, then ``rows`` itself."""
    return sorted({batch_bucket(1 << k, rows) for k in range(rows.bit_length())} | {rows})


def batch_bucket(batch: int, rows: int) -> int:
    """The graph that serves ``batch`` rows: the next power of two, at most ``rows`` (the state's rows)."""
    if not 1 <= batch <= rows:
        raise ValueError(f"a RAS step of {batch} rows, the state has {rows}")
    return min(1 << (batch - 1).bit_length(), rows)


class GraphedRAS:
    """``DeviceRAS`` whose ``step`` replays the graph of the batch's bucket (every bucket captured at the
    first step)."""

    def __init__(self, ras: DeviceRAS, device: torch.device):
        self.ras, self.rows = ras, ras.active.shape[0]
        # one graph per bucket (``every_bucket``), never dropped
        self._graphs = GraphCache("RAS step", max_graphs=len(every_bucket(self.rows)))
        # [] long on the device: how many of a bucket's rows are real this step (0 while capturing)
        self._in_use = torch.zeros((), dtype=torch.long, device=device)

    @property
    def buckets(self) -> list[int]:
        return sorted(cast("list[int]", self._graphs.keys()))

    def step(self, logits: torch.Tensor) -> torch.Tensor:
        """As ``DeviceRAS.step``: logits [B, V] -> logits whose active rows allow exactly the sampled id
        (a view of the bucket's output: read it before the next step)."""
        b = logits.shape[0]
        if not self._graphs.keys():
            # the first step comes at the LM's start or our warm-up, before ready: capturing every bucket
            # there keeps the captures (~tens of ms each) off the requests' path, where a batch size first
            # met under load (32, 64 rows) would hold every stream of that step
            self._capture_every_bucket(logits)
        rows = batch_bucket(b, self.rows)
        call = self._graphs.get(rows, self._run, lambda: self._statics(rows, logits))
        assert call is not None  # never frozen, and every bucket is captured
        call.inputs[0][:b].copy_(logits)
        self._in_use.fill_(b)
        call.graph.replay()
        return call.output[:b]

    def _capture_every_bucket(self, like: torch.Tensor) -> None:
        for rows in every_bucket(self.rows):
            self._graphs.get(rows, self._run, functools.partial(self._statics, rows, like))

    def _statics(self, rows: int, like: torch.Tensor) -> tuple[torch.Tensor]:
        """A new bucket's input buffer; the capture's warm-up runs and recording then change no request's
        state (0 rows in use)."""
        self._in_use.fill_(0)
        log.info("RAS step: capturing the graph for batches up to %d rows", rows)
        return (torch.zeros(rows, like.shape[1], dtype=like.dtype, device=like.device),)

    def _run(self, logits: torch.Tensor) -> torch.Tensor:
        return self.ras.step(logits, self._in_use)


def ras_stepper(ras: DeviceRAS, device: torch.device, graphs: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """The step the LM's logits processor calls: replayed from graphs where asked for and supported."""
    if graphs and devices.graphs_supported(device):
        return GraphedRAS(ras, device).step
    return ras.step
