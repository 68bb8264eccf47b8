"""Reuse of a request's finished frames in the CUDA-graph flow solver: a page pool (CosyVoice3's DiT here;
CosyVoice2's U-Net adds its convs' states, engine.flow.unet_pages).

Why the reuse is exact, and what a frame's cache holds, is engine.flow.dit_cache's story: in a streaming
(non-final) call every frame of a chunk finished in an earlier call follows the same trajectory, so its
keys/values at every step and layer (both CFG rows) and its x entering every step can be kept and only the
frames after them computed. ``DiTCache`` keeps them in per-request buffers that grow, which a captured CUDA
graph cannot follow (its tensors' addresses are fixed when it is recorded). Here they live in one pool
allocated once, in pages of one attention chunk (50 frames): a request owns a list of pages (page c holds
its chunk c, frames [50c, 50c + 50)), and a call gets tensors of page numbers. The graph gathers the
cached prefix's keys/values through them and writes the chunks that a call completes into the request's
next pages, so one captured graph serves every request at its bucket's (batch, query frames).

A batch of windows (``PagedBatch``): row b runs its query frames [start_b, total_b), start_b = its cached
frames, left-aligned in [B, 80, Q] tensors; every row reads the same number of prefix pages (``prefix``, its
unused ones page 0) and the attention mask hides the columns past its start. Page 0 is the pool's scratch:
nothing reads it unmasked, and the chunks a call does not keep (incomplete, or no page left) go there.

Memory: one page of the released DiT (22 layers, 16 heads x 64, 10 steps) holds keys and values of every
step, layer and CFG row in bf16, 90 MB, and its x in float32, 0.16 MB. A 10 s stream after a 3.5 s prompt
holds up to 11 pages (~1 GB) until its final call.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.flow.attention import WindowAttention
from engine.flow.dit_cache import twice

SCRATCH = 0  # the page that unkept chunks are written to and unused prefix slots read (always masked)


@dataclass(frozen=True)
class PageLayout:
    """The pool's sizes (from the DiT's config and the solver) and where it lives."""

    steps: int
    depth: int
    heads: int
    dim_head: int
    mel_dim: int
    chunk: int  # static_chunk_size: frames a page holds
    lead: int  # frames before a window that the position conv reads: 2 x (kernel - 1)
    pages: int  # in the pool, the scratch page included
    kv_dtype: torch.dtype
    x_dtype: torch.dtype
    device: torch.device
    states: int = 0  # the U-Net: numbers of its causal convs' states a CFG row keeps per page and step

    def __post_init__(self) -> None:
        if self.pages < 2:
            raise ValueError(f"a page pool needs the scratch page and at least one more, got {self.pages}")

    @property
    def lead_pages(self) -> int:
        """Pages a window reads before its start (a chunk boundary): those of the DiT's lead frames, or the
        U-Net's chunk whose conv states it continues from."""
        return max(math.ceil(self.lead / self.chunk), 1 if self.states else 0)

    @staticmethod
    def page_bytes(
        steps: int, depth: int, heads: int, dim_head: int, mel_dim: int, chunk: int, states: int = 0
    ) -> int:
        """Bytes one page takes: bf16 keys and values (2 CFG rows), float32 x and bf16 conv states, every
        step and layer."""
        return steps * (chunk * (2 * depth * 2 * heads * dim_head * 2 + mel_dim * 4) + 2 * states * 2)


class PagePool:
    """Every stream's cached chunks in two tensors allocated once; pages handed out and back, thread-safe
    (a request dropped without its final call gives its pages back from whichever thread collects it). A
    page may have several holders (a voice's prompt pages, engine.flow.voice_pages): it is free again when
    the last gives it back."""

    def __init__(self, layout: PageLayout) -> None:
        self.layout = lay = layout
        # kv[step, page, layer, (key, value), (cond, uncond), head, frame, dim]; x[step, page, mel, frame]
        shape = (lay.steps, lay.pages, lay.depth, 2, 2, lay.heads, lay.chunk, lay.dim_head)
        self.kv = torch.zeros(shape, dtype=lay.kv_dtype, device=lay.device)  # zeros: masked, still finite
        self.x = torch.zeros(
            lay.steps, lay.pages, lay.mel_dim, lay.chunk, dtype=lay.x_dtype, device=lay.device
        )
        # states[step, page, (cond, uncond), number]: the U-Net's conv inputs over the chunk's last frames
        self.states = torch.zeros(lay.steps, lay.pages, 2, lay.states, dtype=lay.kv_dtype, device=lay.device)
        # the same storage with steps and pages as one dimension: step s's page p is page s * pages + p there
        # (``at``), so one estimator call (and one captured solver step) reads any step's pages by tables
        self.kv_pages, self.x_pages = self.kv.flatten(0, 1), self.x.flatten(0, 1)
        self.states_pages = self.states.flatten(0, 1)
        self._free = list(range(lay.pages - 1, SCRATCH, -1))
        self._holders = [0] * lay.pages  # per page: who holds it (a request's cache, a kept voice)
        self._lock = threading.Lock()

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def held(self) -> int:
        """Pages requests hold now."""
        return self.layout.pages - 1 - self.free

    def take(self, wanted: int) -> list[int]:
        """Up to ``wanted`` pages (fewer, maybe none, when the pool runs short)."""
        with self._lock:
            got = self._free[len(self._free) - min(wanted, len(self._free)) :]
            del self._free[len(self._free) - len(got) :]
            for page in got:
                self._holders[page] = 1
        return got[::-1]

    def share(self, pages: Sequence[int]) -> None:
        """One more holder of each of these held pages."""
        with self._lock:
            if any(self._holders[p] < 1 for p in pages):
                raise ValueError(f"page pool: sharing a page nobody holds among {list(pages)}")
            for page in pages:
                self._holders[page] += 1

    def give(self, pages: Sequence[int]) -> None:
        """One holder fewer of each page; those nobody holds any more are free."""
        with self._lock:
            if any(self._holders[p] < 1 for p in pages):
                raise ValueError(f"page pool: giving back a free page among {list(pages)}")
            for page in reversed(pages):
                self._holders[page] -= 1
                if self._holders[page] == 0:
                    self._free.append(page)

    def at(self, step: int | Tensor, pages: Tensor) -> Tensor:
        """Page numbers of one step -> their numbers in the flattened pools (``kv_pages`` ...); ``step`` an
        int, or a [1] long tensor on the device (a captured step: no host sync)."""
        return pages + step * self.layout.pages

    def keep_x(self, x: Tensor, writes: Tensor) -> None:
        """x [B,80,Q] entering a step: its chunks into their pages (``writes`` [B,Q/chunk], that step's:
        ``at``)."""
        b, mel, chunks = x.size(0), x.size(1), writes.size(1)
        pages = x[:, :, : chunks * self.layout.chunk].unflatten(2, (chunks, -1)).transpose(1, 2)
        rows = pages.reshape(b * chunks, mel, -1).to(self.x.dtype)
        self.x_pages.index_copy_(0, writes.flatten(), rows)

    def lead_x(self, lead: Tensor) -> Tensor:
        """The x entering a step of the ``layout.lead`` frames before each window: lead [B, lead pages] (the
        step's: ``at``) -> [B,80,lead] (frames before frame 0 read the scratch page: the caller masks them)"""
        b, n = lead.shape
        pages = self.x_pages[lead.flatten()].unflatten(0, (b, n))  # [B,n,80,chunk]
        return pages.transpose(1, 2).flatten(2)[:, :, n * self.layout.chunk - self.layout.lead :]

    def keep_states(self, states: Tensor, writes: Tensor) -> None:
        """The U-Net's conv states at the end of each window chunk, states [2B, chunks, numbers] (rows: B
        cond, B uncond), into the pages of the chunks that the call keeps (``writes``: the step's, ``at``)."""
        b, chunks = writes.shape
        pages = states.unflatten(0, (2, b)).permute(1, 2, 0, 3).reshape(b * chunks, 2, -1)
        self.states_pages.index_copy_(0, writes.flatten(), pages)

    def keep_kv(self, kv: Tensor, writes: Tensor) -> None:
        """A window's keys/values at a step, kv [depth, 2, 2B, H, Q, D] (rows: B cond, B uncond), into the
        pages of its chunks that the call keeps (``writes``: the step's, ``at``)."""
        b, chunks, c = writes.size(0), writes.size(1), self.layout.chunk
        pages = kv[..., : chunks * c, :].unflatten(2, (2, b)).unflatten(5, (chunks, c))
        # [depth, kv, cfg, B, H, chunks, c, D] -> [B, chunks, depth, kv, cfg, H, c, D]
        pages = pages.permute(3, 5, 0, 1, 2, 4, 6, 7).reshape(b * chunks, *self.kv.shape[2:])
        self.kv_pages.index_copy_(0, writes.flatten(), pages)


class PagedCache:
    """One request's finished frames [0, ``frames``) in pool pages: ``pages[c]`` holds its chunk c. Pages
    taken for a call beyond ``frames`` stay reserved for the next call if that one fails."""

    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        self.pages: list[int] = []
        self.frames = 0  # a multiple of the chunk
        self.queried = 0  # query frames its cached calls computed
        self.calls = 0

    def reserve(self, end: int, limit: int) -> int:
        """Pages for chunks up to frame ``end`` (at most ``limit`` pages in all) -> the frames it can keep:
        ``end``, or fewer where the pool ran short (then the rest of the request recomputes, exactly)."""
        wanted = min(end // self.pool.layout.chunk, limit) - len(self.pages)
        if wanted > 0:
            self.pages += self.pool.take(wanted)
        return max(min(end, len(self.pages) * self.pool.layout.chunk), self.frames)

    def adopt(self, pages: Sequence[int], frames: int) -> None:
        """A fresh cache begins with another holder's pages of chunks [0, frames) (a voice's prompt: its
        windows read them and write only the chunks after ``frames``, into pages of its own)."""
        if self.pages or self.frames or frames != len(pages) * self.pool.layout.chunk:
            raise ValueError(f"flow reuse: adopting {len(pages)} pages for {frames} frames into a used cache")
        self.pool.share(pages)
        self.pages, self.frames = list(pages), frames

    def commit(self, frames: int, queried: int) -> None:
        self.frames = frames
        self.queried += queried
        self.calls += 1

    def clear(self) -> None:
        """Give every page back (after the final call); the counters stay."""
        pages, self.pages, self.frames = self.pages, [], 0
        self.pool.give(pages)

    def __del__(self) -> None:
        self.clear()


@dataclass(frozen=True)
class PagedBatch:
    """The page numbers and bounds of one batch of windows, [B] rows (see the module doc)."""

    start: Tensor  # [B] long: first query frame (cached frames, a multiple of the chunk)
    total: Tensor  # [B] long: frames of the call
    prefix: Tensor  # [B, P] long: page of chunk c for c < start / chunk, else SCRATCH
    writes: Tensor  # [B, Q / chunk] long: page for window chunk c where the call keeps it, else SCRATCH
    lead: Tensor  # [B, lead pages] long: the pages of the chunks just before start (SCRATCH before frame 0)
    keeps: tuple[int, ...]  # frames each row's cache holds after the call

    @classmethod
    def plan(
        cls, caches: Sequence[PagedCache], totals: Sequence[int], queries: int, slots: int, limit: int
    ) -> PagedBatch:
        """Reserve the pages each row's window completes (``queries`` columns, a multiple of the chunk),
        each cache holding at most ``limit`` pages, and number them; ``slots`` prefix pages a row (at least
        every row's cached chunks)."""
        lay = caches[0].pool.layout
        rows = [_Row.of(c, int(t), queries, slots, limit, lay) for c, t in zip(caches, totals)]
        dev = lay.device

        def table(values: list[list[int]] | list[int]) -> Tensor:
            return torch.tensor(values, dtype=torch.long).to(dev, non_blocking=True)

        return cls(
            table([r.start for r in rows]),
            table([r.total for r in rows]),
            table([r.prefix for r in rows]),
            table([r.writes for r in rows]),
            table([r.lead for r in rows]),
            tuple(r.keep for r in rows),
        )

    @property
    def tensors(self) -> tuple[Tensor, ...]:
        return self.start, self.total, self.prefix, self.writes, self.lead


@dataclass(frozen=True)
class _Row:
    start: int
    total: int
    prefix: list[int]
    writes: list[int]
    lead: list[int]
    keep: int

    @classmethod
    def of(cls, cache: PagedCache, total: int, queries: int, slots: int, limit: int, lay: PageLayout) -> _Row:
        start, chunk = cache.frames, lay.chunk
        if not start < total <= start + queries or start > slots * chunk:
            raise ValueError(
                f"flow reuse: a call of {total} frames after {start} cached, {queries} columns, {slots} pages"
            )
        keep = cache.reserve(total // chunk * chunk, limit)
        first = start // chunk  # the window's first chunk
        writes = [
            _page(cache, first + c) if (first + c + 1) * chunk <= keep else SCRATCH
            for c in range(queries // chunk)
        ]
        prefix = [_page(cache, c) if c < first else SCRATCH for c in range(slots)]
        lead = [_page(cache, c) if c >= 0 else SCRATCH for c in range(first - lay.lead_pages, first)]
        return cls(start, total, prefix, writes, lead, keep)


def _page(cache: PagedCache, chunk: int) -> int:
    return cache.pages[chunk] if chunk < len(cache.pages) else SCRATCH


class PagedWindow:
    """One estimator call over a batch of page windows, built inside the (compiled) estimator from tensors
    only; what ``DiT.forward_window`` asks of a window. A plain class, not a frozen dataclass: TorchDynamo
    traces its construction.

    Every table has a row per estimator row, 2B (``PagedRows``: B cond rows, then their B uncond twins):
    kv [steps x pages, depth, 2, 2, H, chunk, D] the pool's pages of every step (``PagePool.kv_pages``),
    prefix [2B,P] page numbers there (this call's step's, ``PagePool.at``), start and total [2B] as in
    ``PagedBatch``; cfg [2B] each row's CFG half (0 cond, 1 uncond) of the pages. x has ``lead`` +
    ``queries`` columns. Keys: the P prefix pages' frames (frame j at column j, masked from the row's start
    on), then the window's queries. No table has B rows: a compiled program traced at a batch of 2 or more
    would otherwise need a version of its own for a batch of one (TorchDynamo specialises a size of 1).
    """

    def __init__(
        self,
        kv: Tensor,
        rows: PagedRows,
        lead: int,
        chunk: int,
        queries: int,
        folded: bool = False,  # the attention rule folded into q/k dims (engine.flow.attention)
    ) -> None:
        self.kv, self.prefix, self.cfg, self.lead = kv, rows.prefix, rows.cfg, lead
        starts = rows.start[:, None]  # [2B,1]
        pos = starts - lead + torch.arange(lead + queries, device=starts.device)  # [2B,lead+Q]
        self.known = pos >= 0  # [2B,lead+Q]: frames before frame 0 read as zeros
        self.query_pos = pos[:, lead:]  # [2B,Q] absolute frames
        past = rows.prefix.size(1) * chunk
        self.span = past + queries  # every position of the call is below it
        query_valid = self.query_pos < rows.total[:, None]
        self.rule = WindowAttention.after_prefix(self.query_pos, query_valid, past, starts, chunk, folded)
        self.new: list[Tensor] = []  # each layer's window keys/values, [2, 2B, H, Q, D]

    def keys_values(self, step: int, layer: int) -> functools.partial[tuple[Tensor, Tensor]]:
        """``Attention``'s hook at ``layer`` (the pool given is already the step's)."""
        return functools.partial(self._attend_over, layer)

    def _attend_over(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """k, v [2B,H,Q,D] -> [2B,H,P*chunk+Q,D]: each row's prefix pages (its CFG half), then k, v."""
        self.new.append(torch.stack([k, v]))
        pages = self.kv[:, layer][self.prefix, :, self.cfg[:, None]]  # [2B,P,kv,H,chunk,D]
        cached = pages.permute(2, 0, 3, 1, 4, 5).flatten(3, 4)  # [kv,2B,H,P*chunk,D]
        return torch.cat([cached[0], k], 2), torch.cat([cached[1], v], 2)

    def written(self) -> Tensor:
        """Every layer's window keys/values: [depth, 2, 2B, H, Q, D]."""
        return torch.stack(self.new)


class PagedRows:
    """``PagedBatch``'s tables as the estimator reads them, a row per estimator row (2B: the B cond rows,
    then their uncond twins): prefix [2B,P], start, total [2B], lead [2B, lead pages], cfg [2B] (0, then 1).
    A plain class: TorchDynamo traces it."""

    def __init__(self, prefix: Tensor, start: Tensor, total: Tensor, lead: Tensor, cfg: Tensor) -> None:
        self.prefix, self.start, self.total, self.lead, self.cfg = prefix, start, total, lead, cfg

    @classmethod
    def of(cls, prefix: Tensor, start: Tensor, total: Tensor, lead: Tensor) -> PagedRows:
        """From ``PagedBatch``'s B-row tables (outside the compiled estimator: B may be 1 there)."""
        b = start.size(0)
        cfg = torch.arange(2 * b, device=start.device) // b
        return cls(twice(prefix), twice(start), twice(total), twice(lead), cfg)

    @property
    def tensors(self) -> tuple[Tensor, ...]:
        return self.prefix, self.start, self.total, self.lead, self.cfg
