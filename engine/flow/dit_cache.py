"""Reuse of a request's finished frames across its streaming CosyVoice3 flow calls (the DiT estimator).

Why it is exact. In a streaming (non-final) call the DiT's attention is chunk-causal: query frame i sees
keys j < (i // C + 1) * C, C = ``static_chunk_size`` (50), chunks counted from frame 0, prompt included.
The input embedding's position conv is causal (frame i reads input frames i-60..i), RoPE positions are
absolute, LayerNorm and the FFN work per frame and AdaLN per row (flow time). The initial noise is a fixed
buffer indexed by frame, and a frame's mu, cond and spks do not change between a request's calls (the last
3 tokens of a non-final call are look-ahead only). So every frame of a chunk that was complete in a call,
[0, F) with F = (T // C) * C, follows the same trajectory in every later call of the request: x at every
Euler step and keys/values at every layer and step, in both CFG rows (checked on a tiny random DiT in
fp32: equal to 2e-6, the rounding of other matmul shapes; a frame of the incomplete chunk moves by 4e-2).

What a request keeps (``DiTCache``, owned by its ``Utterance``): for frames [0, F), the keys (after RoPE)
and values of every step, layer and CFG row, and the solver's x entering every step, from which the
position conv's 60 frames of left context are recomputed. Its next streaming call runs only the query
frames [F, T) (``DiTWindow``); each layer attends over the cached keys followed by the window's own.

Batching: rows are independent, so every row keeps its own window start (its cache's F) in one padded
call: row b's window is left-aligned in the batch tensors (its query q is frame F_b + q), its keys are its
cached prefix (zero-padded to the batch's longest) followed by the window's keys, and the attention mask
is stated on absolute frame positions (``WindowAttention``). A first call is a window from frame 0 (empty
cache). No row recomputes frames it has cached because of another row, and no batch is split.

Memory: per frame, keys + values x layers x steps x 2 CFG rows x dim. The released DiT (dim 1024, 22
layers, 10 steps) keeps 2 * 22 * 10 * 2 * 1024 = 901k numbers a frame: 3.6 MB (3.4 MiB) in float32, 1.8 MB
in bf16; 10 s of speech after a 5 s prompt (750 frames) holds ~2.7 GB until the final call. The final
call (full attention) runs the ordinary solver and the cache is released.

A ``ReuseBudget`` shared by a worker's caches bounds their total bytes: a cache that cannot grow keeps the
frames it has (its next windows start there, still exact) and the rest of its request recomputes.

Scope: the eager solver (``CausalCFM.forward_cached``) only; the CUDA-graph solver (engine.flow.graphs) is
unchanged and recomputes every call. CosyVoice2's U-Net reuses its frames the same way with a cache of its
own built on this one (engine.flow.unet_cache).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.flow.attention import WindowAttention

# A cached window's keys/values at one layer and step: (k, v) [B,H,Q,D] of the window -> what its queries
# attend over, [B,H,K,D] (the cached prefix's, then the window's); ``DiTWindow.keys_values`` makes them.
KeysValues = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class CacheLayout:
    """What a cache and its windows need of the DiT and the solver (the flow fills it from DiTConfig):
    one entry per Euler step and layer, in these sizes and dtypes."""

    steps: int
    depth: int
    heads: int
    dim_head: int
    mel_dim: int
    chunk: int  # static_chunk_size: the streaming attention chunk, frames
    lead: int  # frames the position conv reads back: its two causal convs, 2 x (kernel - 1)
    kv_dtype: torch.dtype  # the estimator's weights' dtype: its keys and values
    x_dtype: torch.dtype  # the solver's x
    device: torch.device


class ReuseBudget:
    """Bytes the caches of one token2wav worker may hold together; thread-safe (a cache dropped with its
    request gives its bytes back from whichever thread collects it)."""

    def __init__(self, limit_bytes: float) -> None:
        if limit_bytes < 0:
            raise ValueError(f"the flow reuse budget must be >= 0 bytes, got {limit_bytes}")
        self.limit, self.held = limit_bytes, 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> bool:
        with self._lock:
            if self.held + nbytes > self.limit:
                return False
            self.held += nbytes
            return True

    def give(self, nbytes: int) -> None:
        with self._lock:
            self.held -= nbytes


class DiTCache:
    """One request's finished frames [0, ``frames``) of its streaming flow calls (see the module doc).

    Buffers grow by at least half their size, within ``budget`` (none: unbounded); a call writes past
    ``frames`` and ``commit`` moves the boundary only after the whole solve succeeded, so a failed call
    leaves the cache as it was.
    """

    def __init__(self, budget: ReuseBudget | None = None) -> None:
        self.budget = budget
        self.nbytes = 0  # what the buffers hold, taken from the budget
        self.frames = 0  # finished frames kept: a multiple of the attention chunk
        self.keys: Tensor | None = None  # [steps, depth, 2 (cond, uncond), heads, capacity, dim_head]
        self.values: Tensor | None = None  # as keys
        self.x: Tensor | None = None  # [steps, 80, capacity]: x entering each step (both CFG rows see it)
        self.queried = 0  # query frames this request's cached calls computed (what reuse saved is visible)
        self.calls = 0  # cached calls committed

    @property
    def capacity(self) -> int:
        return 0 if self.x is None else self.x.size(2)

    def reserve(self, frames: int, layout: CacheLayout) -> bool:
        """Room for ``frames`` frames, the kept ones copied over; False (nothing changes) where the budget
        has no room for the larger buffers."""
        if frames <= self.capacity:
            return True
        size = max(frames, self.capacity + self.capacity // 2)
        nbytes = self._fixed_bytes(layout) + size * _frame_bytes(layout)
        if self.budget is not None and not self.budget.take(nbytes - self.nbytes):
            return False
        self.nbytes = nbytes
        kv = (layout.steps, layout.depth, 2, layout.heads, size, layout.dim_head)
        keys = torch.empty(kv, dtype=layout.kv_dtype, device=layout.device)
        values = torch.empty_like(keys)
        x = torch.empty(layout.steps, layout.mel_dim, size, dtype=layout.x_dtype, device=layout.device)
        if self.keys is not None and self.values is not None and self.x is not None:
            keys[..., : self.frames, :] = self.keys[..., : self.frames, :]
            values[..., : self.frames, :] = self.values[..., : self.frames, :]
            x[..., : self.frames] = self.x[..., : self.frames]
        self.keys, self.values, self.x = keys, values, x
        return True

    def _fixed_bytes(self, layout: CacheLayout) -> int:
        """Bytes the cache holds whatever its frames (none here; a subclass may keep more)."""
        return 0

    def commit(self, frames: int, queried: int) -> None:
        self.frames = frames
        self.queried += queried
        self.calls += 1

    def clear(self) -> None:
        """Free the buffers and their budget (after the final call); the counters stay."""
        self.frames = 0
        self.keys = self.values = self.x = None
        if self.budget is not None and self.nbytes:
            self.budget.give(self.nbytes)
        self.nbytes = 0

    def __del__(self) -> None:
        """A request that ends without its final call (cancelled, failed) gives its bytes back too."""
        self.clear()


def _frame_bytes(layout: CacheLayout) -> int:
    """Bytes a cached frame takes: keys and values of every step, layer, CFG row and head, and its x."""
    kv = 2 * layout.steps * layout.depth * 2 * layout.heads * layout.dim_head * layout.kv_dtype.itemsize
    return kv + layout.steps * layout.mel_dim * layout.x_dtype.itemsize


class DiTWindow:
    """One cached streaming call over a batch of rows: row b runs query frames [start_b, total_b), with
    start_b its cache's ``frames``, and afterwards keeps [start_b, end_b), end_b = (total_b // C) * C.

    Batch tensors have 2B rows (B conditioned, then their B unconditioned twins) and Q = max(total - start)
    query columns; ``lead`` frames before each window feed the position conv of its first queries.
    """

    def __init__(self, caches: Sequence[DiTCache], totals: Sequence[int], layout: CacheLayout):
        self.caches, self.totals = list(caches), [int(t) for t in totals]
        self.starts = [c.frames for c in self.caches]
        self.ends = [t // layout.chunk * layout.chunk for t in self.totals]
        if any(t <= s for s, t in zip(self.starts, self.totals)):
            raise ValueError(f"flow reuse: calls of {self.totals} frames add none after {self.starts} cached")
        # a row whose cache has no room keeps what it has: it computes the whole window and stores nothing
        self.ends = [e if c.reserve(e, layout) else s for c, s, e in zip(self.caches, self.starts, self.ends)]
        self.rows, self.width = len(self.caches), max(t - s for s, t in zip(self.starts, self.totals))
        self.lead = layout.lead
        self.past = max(self.starts)  # key columns of the cached prefix (rows padded to the longest)
        self.span = self.past + self.width  # every position of the call is below it
        start = torch.tensor(self.starts, device=layout.device)[:, None]  # [B,1]
        self.frame_pos = start - self.lead + torch.arange(self.lead + self.width, device=layout.device)
        self.known = twice(self.frame_pos >= 0)  # [2B,lead+Q]: lead frames before frame 0 do not exist
        self.query_pos = twice(self.frame_pos[:, self.lead :])  # [2B,Q] absolute frames
        self.rule = self._rule(layout.chunk)

    def _rule(self, chunk: int) -> WindowAttention:
        """Keys: past columns j are frame j (real below the row's start), then the window's queries."""
        query = self.query_pos
        query_valid = query < torch.tensor(self.totals + self.totals, device=query.device)[:, None]
        starts = torch.tensor(self.starts + self.starts, device=query.device)[:, None]
        return WindowAttention.after_prefix(query, query_valid, self.past, starts, chunk)

    def frames(self, seq: Tensor) -> Tensor:
        """[B,C,T] whole rows -> [B,C,lead+Q] each row's window with its lead (frames past T: padding)."""
        return gather_frames(seq, self.frame_pos)

    def queries(self, seq: Tensor) -> Tensor:
        """[B,C,T] whole rows -> [B,C,Q] each row's query frames."""
        return gather_frames(seq, self.frame_pos[:, self.lead :])

    def lead_x(self, step: int, like: Tensor) -> Tensor:
        """The cached x entering ``step`` of each row's lead frames: [B,80,lead], zero before frame 0."""
        out = like.new_zeros(self.rows, like.size(1), self.lead)
        for row, (cache, start) in enumerate(zip(self.caches, self.starts)):
            first = max(start - self.lead, 0)
            if start > first and cache.x is not None:
                out[row, :, self.lead - (start - first) :] = cache.x[step, :, first:start]
        return out

    def keep_x(self, step: int, x: Tensor) -> None:
        """x [B,80,Q] entering ``step``: each row's frames that its cache keeps."""
        for row, (cache, start, end) in enumerate(zip(self.caches, self.starts, self.ends)):
            if end > start and cache.x is not None:
                cache.x[step, :, start:end] = x[row, :, : end - start]

    def keys_values(self, step: int, layer: int) -> KeysValues:
        """What ``Attention`` calls with the window's keys/values at this step and layer."""
        return functools.partial(self._attend_over, step, layer)

    def _attend_over(self, step: int, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """k, v [2B,H,Q,D] -> [2B,H,past+Q,D]: each row's cached prefix (zero-padded; masked) then k, v.
        The window's kept frames go into the caches on the way (committed with the call)."""
        self._keep(step, layer, k, v)
        if self.past == 0:
            return k, v
        keys, values = [c.keys for c in self.caches], [c.values for c in self.caches]
        return self._with_prefix(step, layer, k, keys), self._with_prefix(step, layer, v, values)

    def _keep(self, step: int, layer: int, k: Tensor, v: Tensor) -> None:
        # rows b and B + b are request b's cond and uncond rows: cache[..., 2, H, frames, D]
        for row, (cache, start, end) in enumerate(zip(self.caches, self.starts, self.ends)):
            if end > start and cache.keys is not None and cache.values is not None:
                cache.keys[step, layer, :, :, start:end] = k[row :: self.rows, :, : end - start]
                cache.values[step, layer, :, :, start:end] = v[row :: self.rows, :, : end - start]

    def _with_prefix(self, step: int, layer: int, new: Tensor, cached: list[Tensor | None]) -> Tensor:
        """new [2B,H,Q,D]; cached: each row's buffer [steps, depth, 2, H, capacity, D] -> [2B,H,past+Q,D]."""
        if self.rows == 1 and cached[0] is not None:  # no padding: the cached view, then the window
            return torch.cat([cached[0][step, layer, :, :, : self.past], new], dim=2)
        # zeros, not empty: a masked key's value still meets a zero weight, and 0 * NaN would be NaN
        out = new.new_zeros(new.size(0), new.size(1), self.past + self.width, new.size(3))
        out[:, :, self.past :] = new
        for row, (buffer, start) in enumerate(zip(cached, self.starts)):
            if start > 0 and buffer is not None:
                out[row :: self.rows, :, :start] = buffer[step, layer, :, :, :start]
        return out

    def commit(self) -> None:
        """The call succeeded: every cache now holds its frames up to ``end``."""
        for cache, start, end, total in zip(self.caches, self.starts, self.ends, self.totals):
            cache.commit(max(end, start), total - start)

    def place(self, x: Tensor, frames: int) -> Tensor:
        """x [B,80,Q] window frames -> [B,80,frames] at their positions, zero before each window (frames
        this call did not compute: the caller never emits them)."""
        return place_windows(x, self.starts, self.totals, frames)


def place_windows(x: Tensor, starts: Sequence[int], totals: Sequence[int], frames: int) -> Tensor:
    """x [B,80,Q]: row b's frames [starts[b], totals[b]) left-aligned -> [B,80,frames] at their positions,
    zero elsewhere."""
    out = x.new_zeros(x.size(0), x.size(1), frames)
    for row, (start, total) in enumerate(zip(starts, totals)):
        out[row, :, start:total] = x[row, :, : total - start]
    return out


def twice(rows: Tensor) -> Tensor:
    """[B,...] -> [2B,...]: the unconditioned twins sit at the same positions as their rows."""
    return torch.cat([rows, rows])


def gather_frames(seq: Tensor, pos: Tensor) -> Tensor:
    """seq [B,C,T] at positions pos [B,P] (clamped into [0, T): those frames are padding) -> [B,C,P]."""
    index = pos.clamp(0, seq.size(2) - 1)[:, None, :].expand(-1, seq.size(1), -1)
    return seq.gather(2, index)
