"""Captured CUDA graphs by shape bucket: the cache the flow solver and the vocoder graphs share in kind.

A bucket rounds the batch up to a power of two and the frames up to a multiple of ``frame_bucket``, so a
few dozen graphs cover every request shape; callers pad their inputs into the bucket. The captures share
one memory pool and one side stream (the caching allocator keeps freed blocks per stream, so a fresh
stream per capture could not reuse the last capture's warm-up memory), and an LRU bounds their number.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

import torch

from engine import device as devices

log = logging.getLogger(__name__)
K = TypeVar("K", bound=tuple)  # a bucket key: (batch, frames[, streaming])
SLOW_CAPTURE_S = 5.0  # a capture this long held a compile (a warm capture of a flow bucket is ~1 s)


def bucket(batch: int, frames: int, frame_bucket: int) -> tuple[int, int]:
    """(batch, frames) -> (the next power of two, the next multiple of ``frame_bucket``)."""
    return 2 ** math.ceil(math.log2(batch)), frame_bucket * math.ceil(frames / frame_bucket)


def largest_first(top_batch: int, top_frames: int, frame_bucket: int) -> list[tuple[int, int]]:
    """Every (batch, frames) bucket up to these, largest first: in one shared pool a later capture can
    reuse a freed block only if it is big enough (ascending captures left ~115 GiB reserved on the H200)."""
    batches = [2**i for i in reversed(range(int(math.log2(top_batch)) + 1))]
    return [(b, t) for b in batches for t in range(top_frames, 0, -frame_bucket)]


class GraphCache:
    """``key -> CapturedCall``, captured on first use, least recently used dropped past ``max_graphs``.

    After ``precapture`` the cache is frozen: a key it did not capture gets no graph (``get`` returns None
    and the caller runs uncaptured), so no request ever waits for a capture (~1 s for a large flow bucket).
    """

    def __init__(self, name: str, max_graphs: int):
        self.name, self.max_graphs = name, max_graphs
        self._graphs: OrderedDict[Hashable, devices.CapturedCall] = OrderedDict()
        self._pool = self._stream = None  # created on the first capture (CUDA only)
        self.frozen = False
        self._missed: set[Hashable] = set()  # keys logged once as run uncaptured

    def __len__(self) -> int:
        return len(self._graphs)

    def __getitem__(self, key: Hashable) -> devices.CapturedCall:
        return self._graphs[key]

    def precapture(self, keys: Sequence[K], capture: Callable[[K], object], dev: torch.device) -> int:
        """``capture(key)`` for every key (in order), with room for all of them; returns how many."""
        self.max_graphs = max(self.max_graphs, len(keys))
        start = time.monotonic()
        with torch.inference_mode():  # as in serving: outside it every captured output kept its autograd
            for done, key in enumerate(keys, 1):  # graph alive (the H200 filled up after ~70 flow captures)
                began = time.monotonic()
                capture(key)
                self._progress(key, done, len(keys), began, start)
        devices.empty_cache(dev)  # the warm-up runs' activations
        self.frozen = True
        return len(keys)

    def _progress(self, key: Hashable, done: int, total: int, began: float, start: float) -> None:
        """Load can take minutes (a cold compile is ~1 min a program on the H200): say which capture
        compiled (a slow one) and how far it is, so a start-up that runs long shows where."""
        now = time.monotonic()
        if now - began > SLOW_CAPTURE_S:
            log.info("%s graph %s took %.1f s (compiling)", self.name, key, now - began)
        if done % 20 == 0 or done == total:
            log.info("%s graphs: %d of %d captured in %.1f s", self.name, done, total, now - start)

    def get(
        self,
        key: Hashable,
        fn: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]],
        statics: Callable[[], tuple[torch.Tensor, ...]],
    ) -> devices.CapturedCall | None:
        """The graph of ``fn`` for ``key``, recording it on ``statics()`` (its input buffers) if new;
        None for a new key once frozen (the caller runs ``fn`` uncaptured)."""
        call = self._graphs.get(key)
        if call is None and self.frozen:
            if key not in self._missed:
                self._missed.add(key)
                log.info("no %s graph was captured for %s: such calls run uncaptured", self.name, key)
            return None
        if call is None:
            if self._pool is None:
                self._pool, self._stream = devices.graph_pool(), devices.capture_stream()
            call = devices.CapturedCall(fn, statics(), self._pool, stream=self._stream)
            log.debug("captured the %s graph %s", self.name, key)
            self._graphs[key] = call
            while len(self._graphs) > self.max_graphs:
                self._graphs.popitem(last=False)
        self._graphs.move_to_end(key)
        return call
