"""A flow solve replayed as one captured Euler step, once a step, instead of one graph of the whole solve.

A whole-solve graph records all 10 solver steps: its capture runs the solve twice from Python (the warm-up,
then the recording), and the ~110 flow graphs of a start took ~65 s of the serving process's interpreter
after ready on the H200 (BENCHMARKS.md, "Start-up"), while the first visitors were served beside them. A
step graph records one step, reading the step's index from a device tensor (the schedule's t and dt, and
for page windows the pool's pages of that step, ``PagePool.at``): a tenth of the Python work and of the
graph's nodes per capture. A call then copies its inputs once and replays the step 10 times, setting the
index between replays on the device (no host sync); the solve is the same ops in the same order, so it
computes exactly what the whole graph computes (tests/engine/flow/test_graphs.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from engine import device as devices


class SteppedCall:
    """A captured in-place Euler step on (x, step, *values) -> x, replayed ``steps`` times a call: called
    like a whole solve's graph, ``(*values) -> x after the last step`` (a copy), where x starts as
    ``start(values)`` (the solve's initial noise)."""

    def __init__(
        self, step: devices.CapturedCall, start: Callable[[tuple[Tensor, ...]], Tensor], steps: int
    ) -> None:
        self.step, self.start, self.steps = step, start, steps

    def __call__(self, *values: Tensor) -> Tensor:
        x, index, *statics = self.step.inputs
        for static, value in zip(statics, values):
            static.copy_(value)
        x.copy_(self.start(values))
        for i in range(self.steps):
            index.fill_(i)  # a kernel with i as its argument: ordered with the replays, no host sync
            self.step.graph.replay()
        return x.clone()


def step_statics(like: Tensor, statics: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """A step graph's input buffers: the state x (``like``'s shape, float32), the step index [1] long,
    then the whole solve's ``statics``."""
    index = torch.zeros(1, dtype=torch.long, device=like.device)
    return torch.zeros(like.shape, device=like.device), index, *statics
