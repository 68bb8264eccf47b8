"""What a token2wav call costs, as the worker measures it: seconds per padded row-frame.

A batch of ``rows`` chunks padded to ``bucket_frames`` mel frames computes ``rows x bucket_frames`` row-frames
(the padding included: the flow graphs run the whole bucket). The scheduler reads the running mean to keep
calls made only of chunks with slack short (``job_queue.pick_batch``'s budget). Launch-bound calls (CUDA
graphs at small shapes) measure few seconds per row-frame, so their budget stays above a full batch and
batching is not cut where it is nearly free; compute-bound ones (the eager DiT, long mel) get a budget of a
few rows. Read and written by the worker thread only.
"""

from __future__ import annotations

import math


class CallCost:
    def __init__(self, weight: float = 0.2):
        if not 0 < weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        self.weight = weight
        self.unit_s: float | None = None  # seconds per padded row-frame; None before the first call

    def observe(self, rows: int, bucket_frames: int, seconds: float) -> None:
        """One call of ``rows`` rows padded to ``bucket_frames`` frames took ``seconds`` (flow + vocoder)."""
        if rows < 1 or bucket_frames < 1 or not seconds > 0:
            return  # nothing measured (a batch whose requests went away, a clock that did not move)
        unit = seconds / (rows * bucket_frames)
        self.unit_s = unit if self.unit_s is None else self.unit_s + self.weight * (unit - self.unit_s)

    def row_frames_within(self, seconds: float) -> float:
        """How many padded row-frames a call computes in ``seconds``; inf until a call was measured."""
        if self.unit_s is None or self.unit_s <= 0:
            return math.inf
        return seconds / self.unit_s
