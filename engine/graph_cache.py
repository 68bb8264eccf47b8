"""Captured CUDA graphs by shape bucket: the cache the flow solver and the vocoder graphs share in kind.

A bucket rounds the batch up to a power of two and the frames up to a multiple of ``frame_bucket``, so a
few dozen graphs cover every request shape; callers pad their inputs into the bucket. The captures share
one memory pool and one side stream (the caching allocator keeps freed blocks per stream, so a fresh
stream per capture could not reuse the last capture's warm-up memory), and an LRU bounds their number.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar, cast

import torch

from engine import device as devices
from engine.graph_builder import Job, Pace

log = logging.getLogger(__name__)
# a background builder's add(name, job): the job captures until done or until its event is set
Later = Callable[[str, Job], None]
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


def first_keys(keys: Sequence[K], covers: bool = False) -> list[K]:
    """The keys captured before serving when the rest is built in the background, per kind of graph (the
    key past batch and frames, e.g. streaming or a window's prefix). Where graphs may run smaller calls
    padded (``covers``), each kind's widest bucket at batch 1 and at the largest batch: from the first
    request on, every call replays a graph (``GraphCache.covering``) instead of running op by op.
    Otherwise its shortest bucket at batch 1 and at the smallest batch above 1. Either way batch 1
    and a larger batch hold the compiles (Inductor specialises a size of 1, so batch 1 has a program of its
    own and every larger batch shares one), so no uncaptured request compiles."""
    chosen: dict[tuple, K] = {}
    for key in keys:
        slot = (key[2:], key[0] == 1)
        if slot not in chosen or _rank(key, covers) < _rank(chosen[slot], covers):
            chosen[slot] = key
    picked = set(chosen.values())
    return [k for k in keys if k in picked]


def _rank(key: tuple, wide: bool) -> tuple[int, int]:
    """The lowest wins its slot: the widest (largest batch, then frames) or the shortest key."""
    return (-key[0], -key[1]) if wide else (key[0], key[1])


def serving_order(keys: Sequence[K], covers: bool = False) -> list[K]:
    """Background captures: a single stream's and a pair's buckets first, shortest first (what a demo's
    first visitors meet), then the rest in the given order (largest first keeps the shared pool small).
    Where graphs may run smaller calls padded (``covers``), each batch's widest bucket of each kind comes
    before all that: until its batch has a graph, a call of 2-8 rows pads into the largest batch's graph
    (16 rows: 2-8x its compute, enough for a burst of streams to underrun), whereas each batch's widest
    graph bounds the padding to the call's frames."""
    small = sorted((k for k in keys if k[0] <= 2), key=lambda k: (k[0], k[1]))
    order = small + [k for k in keys if k[0] > 2]
    if not covers:
        return order
    most: dict[tuple, int] = {}  # per kind, the most frames of a key still to capture
    for key in keys:
        most[key[2:]] = max(most.get(key[2:], 0), key[1])
    cover = [k for k in keys if k[1] == most[k[2:]]]  # the batches whose widest graph is still to capture
    return cover + [k for k in order if k not in cover]


class GraphCache:
    """``key -> CapturedCall``, captured on first use, least recently used dropped past ``max_graphs``.

    After ``precapture`` the cache is frozen: a key it did not capture gets no graph (``get`` returns None
    and the caller replays a wider one, ``covering``, or runs uncaptured), so no request ever waits for a
    capture (~1 s for a large flow bucket).
    """

    def __init__(self, name: str, max_graphs: int, covers: bool = False):
        """``covers``: a graph may run a call of its kind with a smaller batch and fewer frames, padded
        (the caller pads exactly, as into its own bucket): see ``covering``."""
        self.name, self.max_graphs, self.covers = name, max_graphs, covers
        self._graphs: OrderedDict[Hashable, devices.CapturedCall] = OrderedDict()
        self._pool = self._stream = None  # created on the first capture (CUDA only)
        self.frozen = False  # no capture on a request's path: set by precapture
        # precapture with a builder: every single-stream bucket (batch 1) now, not only the first keys, so
        # a lone request's calls replay their own bucket from the start instead of the widest one, padded
        # (EngineConfig.single_stream_graphs_at_load)
        self.single_stream_now = False
        self._builder: int | None = None  # the thread capturing precapture's keys (it may, frozen)
        self._lock = threading.Lock()  # the background builder inserts while the token2wav thread replays
        self._missed: set[Hashable] = set()  # keys logged once as run uncaptured
        # graphs replaced by ``replace``, kept alive: the token2wav stream may still be replaying one, and
        # a graph is not destroyed under its own launch (a few graphs: the first of each kind)
        self._retired: list[devices.CapturedCall] = []

    def __len__(self) -> int:
        return len(self._graphs)

    def __getitem__(self, key: Hashable) -> devices.CapturedCall:
        return self._graphs[key]

    def precapture(
        self,
        keys: Sequence[K],
        capture: Callable[[K], object],
        dev: torch.device,
        later: Later | None = None,
        between: tuple[str, Job] | None = None,
    ) -> int:
        """``capture(key)`` for every key, with room for all of them; returns how many. With ``later``
        (a ``GraphBuilder.add``) only ``first_keys`` (and with ``single_stream_now`` every batch-1 key) are
        captured now and the rest is handed to ``later``,
        captured in ``serving_order`` while requests run on what exists. With ``between`` (a named job) the
        single-stream keys go first as a job of their own, then ``between``, then the rest."""
        self.max_graphs = max(self.max_graphs, len(keys))
        now = first_keys(keys, self.covers) if later is not None else list(keys)
        if self.single_stream_now:
            picked = set(now)
            now = [k for k in keys if k in picked or k[0] == 1]
        self._capture_all(now, capture, dev, None)
        self.frozen = True
        if later is None:
            return len(keys)
        taken = set(now)
        rest = serving_order([k for k in keys if k not in taken], self.covers)
        if between is not None:  # the single-stream buckets first, in their serving order
            soon = [k for k in rest if k[0] == 1]
            rest = [k for k in rest if k[0] != 1]
            if soon:
                later(f"{self.name} graphs (1 stream)", self._capture_job(soon, capture, dev))
            later(*between)
        if rest:
            later(f"{self.name} graphs", self._capture_job(rest, capture, dev))
        return len(keys)

    def capture_now(
        self,
        keys: Sequence[K],
        capture: Callable[[K], object],
        dev: torch.device,
        stop: threading.Event | None = None,
    ) -> int:
        """``capture(key)`` for every key on this thread (paced by ``stop``, a builder's, between captures),
        then frozen as after ``precapture``; returns how many there are."""
        self.max_graphs = max(self.max_graphs, len(keys))
        self._capture_all(keys, capture, dev, stop)
        self.frozen = True
        return len(keys)

    def _capture_job(self, keys: list[K], capture: Callable[[K], object], dev: torch.device) -> Job:
        return lambda stop: self._capture_all(keys, capture, dev, stop)

    def _capture_all(
        self,
        keys: Sequence[K],
        capture: Callable[[K], object],
        dev: torch.device,
        stop: threading.Event | None,
    ) -> None:
        """Capture ``keys`` in order on this thread (``get`` captures for it even when frozen)."""
        self._builder = threading.get_ident()
        try:
            self._each(keys, capture, dev, stop)
        finally:
            self._builder = None

    def _each(
        self, keys: Sequence[K], fn: Callable[[K], object], dev: torch.device, stop: threading.Event | None
    ) -> bool:
        """``fn(key)`` for every key in order, with progress logged -> False when ``stop`` came first."""
        start = time.monotonic()
        try:
            # as in serving: outside inference mode every captured output kept its autograd graph alive
            # (the H200 filled up after ~70 flow captures)
            with torch.inference_mode():
                for done, key in enumerate(keys, 1):
                    if isinstance(stop, Pace):
                        stop.between()  # no stream can stall for it, or a bounded wait
                    if stop is not None and stop.is_set():
                        return False
                    began = time.monotonic()
                    fn(key)
                    self._progress(key, done, len(keys), began, start)
            return True
        finally:
            devices.empty_cache(dev)  # the warm-up runs' activations

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
        if call is None and self.frozen and threading.get_ident() != self._builder:
            if key not in self._missed:
                self._missed.add(key)
                wider = self.covering(cast(tuple, key))
                how = "uncaptured" if wider is None else f"padded into the wider graph {wider} for now"
                log.info("no %s graph was captured for %s: such calls run %s", self.name, key, how)
            return None
        if call is None:
            call = self._record(fn, statics)
            log.debug("captured the %s graph %s", self.name, key)
            with self._lock:
                self._graphs[key] = call
                while len(self._graphs) > self.max_graphs:
                    self._graphs.popitem(last=False)
        with self._lock:
            self._graphs.move_to_end(key)
        return call

    def covering(self, key: K) -> K | None:
        """The captured key of ``key``'s kind whose graph is the cheapest to run ``key``'s call padded
        (batch and frames at least ``key``'s, fewest rows x frames); None when none is, or when this
        cache does not cover. Until the background captures reach a bucket its calls replay a wider graph
        (more padded compute, a single launch) rather than the solver op by op."""
        if not self.covers:
            return None
        with self._lock:
            captured = cast("list[K]", list(self._graphs))  # a covering cache's keys are bucket tuples
        wider = [k for k in captured if k[2:] == key[2:] and k[0] >= key[0] and k[1] >= key[1]]
        return min(wider, key=lambda k: (k[0] * k[1], k[0]), default=None)

    def keys(self) -> list[Hashable]:
        """The captured keys, least recently used first."""
        with self._lock:
            return list(self._graphs)

    def record_all(
        self,
        keys: Sequence[K],
        recipe: Callable[[K], tuple[Callable[..., object], Callable[[], tuple[torch.Tensor, ...]]]],
        dev: torch.device,
        stop: threading.Event,
    ) -> dict[K, devices.CapturedCall] | None:
        """Capture ``recipe(key) -> (fn, statics)`` for every key in this cache's pool without serving
        them (``replace`` does, all at once) -> the graphs, None when ``stop`` was set in between."""
        calls: dict[K, devices.CapturedCall] = {}

        def record(key: K) -> None:
            calls[key] = self._record(*recipe(key))

        return calls if self._each(keys, record, dev, stop) else None

    def replace(self, calls: dict[K, devices.CapturedCall]) -> None:
        """Serve ``calls`` in place of their keys' graphs from the next lookup on: a call already holding
        the old graph replays it to its end (one consistent graph per call)."""
        with self._lock:
            for key, call in calls.items():
                old = self._graphs.get(key)
                if old is not None:
                    self._retired.append(old)
                self._graphs[key] = call

    def _record(
        self, fn: Callable[..., object], statics: Callable[[], tuple[torch.Tensor, ...]]
    ) -> devices.CapturedCall:
        if self._pool is None:
            self._pool, self._stream = devices.graph_pool(), devices.capture_stream()
        return devices.CapturedCall(fn, statics(), self._pool, stream=self._stream)
