"""The flow's 10-step CFM solve as replayed CUDA graphs, at bucketed shapes, of a compiled bf16 estimator.

Eager, one solve launches thousands of small kernels (10 steps x the estimator's layers) and the GPU idles
between them; a captured graph replays them in one launch. Shapes are bucketed: batch to a power of two,
frames up to a multiple of ``frame_bucket``. Padding is exact for the real rows and frames: padded frames
are masked out of attention and every conv is causal (left context only), and padded rows are independent.
With ``stepped`` a graph holds one solver step, replayed once a step (engine.flow.stepped): a tenth of a
capture's work. Graphs are captured lazily on first use of a bucket and kept in an LRU (``graph_cache``);
``precapture`` records every bucket up to a batch and length before serving (the engine's load), so no
request pays for a capture: after it, a shape beyond those buckets runs the (compiled) solver uncaptured.
With a background builder the engine serves first on the eager estimator's graphs and the compile runs
behind it; its graphs then replace the eager ones (``_serve_eager_first``).

With a page pool (``enable_reuse``) streaming calls reuse each request's finished frames
(engine.flow.dit_pages, unet_pages): a request's ``PagedCache`` names its pages, and the window graphs,
bucketed by (batch, query frames, prefix pages), compute only the frames after them. Final calls recompute
with full attention.
"""

from __future__ import annotations

import copy
import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor, nn
from torch.profiler import record_function

from engine import device as devices
from engine.flow.cfm import CausalCFM, CfmInputs
from engine.flow.compiled_estimator import CompiledEstimator
from engine.flow.dit_cache import ReuseBudget, gather_frames, place_windows
from engine.flow.dit_pages import PagedBatch, PagedCache, PageLayout, PagePool
from engine.flow.stepped import SteppedCall, step_statics
from engine.flow.unet import CausalConditionalDecoder
from engine.flow.voice_pages import VoicePages
from engine.graph_cache import GraphCache, Job, Later, bucket, largest_first

if TYPE_CHECKING:
    from engine.flow.aot_package import AotBuild

# a page-window graph's key: (batch, queries, WINDOW, prefix pages); a full solve's (batch, frames, streaming)
WINDOW = "window"
VOICE_SHARE = 8  # the kept voices' prompt pages: up to 1/8 of the pool (the rest: the streams' caches)
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AotRoot:
    """Where the flow's ahead-of-time programs live (the cache root's ``compile/aot``), and whether they
    are traced with cuDNN's attention first (``flow_attention`` "cudnn": a program of its own)."""

    root: Path
    cudnn: bool = False


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
        aot: AotRoot | None = None,
        precompiled: Path | None = None,
        stepped: bool = False,
        compile_child: bool = False,
    ):
        super().__init__()
        self.cfm, self.frame_bucket, self.dtype = cfm, frame_bucket, dtype
        # a graph of one solver step replayed once a step, not of the whole solve (engine.flow.stepped)
        self.stepped = stepped
        # with ``aot`` the compiled programs come from packages built in a child process (aot_package)
        self.aot = aot if compiled else None
        # eager until the packages' programs replace it (precapture), not torch.compile's; ``precompiled``:
        # torch.compile's programs kept whole there and loaded without tracing (engine.flow.precompiled),
        # those it lacks compiled by a child process with ``compile_child`` (engine.flow.compile_child)
        by_torch = compiled and aot is None
        estimator = CompiledEstimator(
            cfm.estimator, dtype, by_torch, precompiled=precompiled, compile_child=compile_child
        )
        self.solver = cfm.with_estimator(estimator)
        # every flow graph runs a smaller call of its kind exactly: a full solve over masked frames and zero
        # rows (_padded), a page window over queries past each row's total (their pages: the scratch page)
        self.graphs = GraphCache("flow solver", max_graphs, covers=True)
        self.pool: PagePool | None = None  # enable_reuse
        # the pages a request may keep, and the prefix widths (pages) of the window graphs: a window reads
        # the smallest that holds every row's cache (reading 800 frames for 250 cached cost the H200 a third
        # of the gain at 16 streams). At least 2: Inductor specialises a dimension of 0 or 1, and every
        # width should share one compiled program (a compile costs ~1 min at the engine's load).
        self.prefix_pages = 0
        self.prefix_buckets: tuple[int, ...] = (2,)
        # the voices' prompt pages (EngineConfig.flow_voice_pages): kept in the pool, and then the first-chunk
        # lane also captures windows after a voice's prefix (``voice_windows``, set before its graphs)
        self.voices: VoicePages | None = None
        self.voice_windows = False

    def enable_reuse(self, nbytes: float, max_frames: int, device: torch.device) -> int:
        """A page pool of ``nbytes`` for the streaming calls, each request keeping up to ``max_frames``
        finished frames; before any capture (graphs record the pool's address) -> the pool's pages, 0 when
        there is none (an estimator without page windows, or too few bytes)."""
        sizes = _page_sizes(self.cfm)
        if sizes is None or len(self.graphs):
            return 0
        steps, depth, heads, dim_head, mel, chunk, lead, states = sizes
        page = PageLayout.page_bytes(steps, depth, heads, dim_head, mel, chunk, states)
        pages = int(nbytes // page) + 1  # + the scratch page
        if pages < 2 or self.frame_bucket % chunk:
            return 0
        dims = (steps, depth, heads, dim_head, mel, chunk, lead, pages)
        layout = PageLayout(*dims, self.dtype, torch.float32, device, states)
        self.pool, self.prefix_pages = PagePool(layout), max_frames // chunk
        self.voices = VoicePages(self.pool, max(pages // VOICE_SHARE, 1))
        widest = max(self.prefix_pages, 2)
        self.prefix_buckets = tuple(sorted({2, max(widest // 2, 2), widest}))
        return pages

    @property
    def compiled(self) -> bool:
        """The solver serving now runs the TorchInductor-compiled estimator."""
        estimator = self.solver.estimator
        return isinstance(estimator, CompiledEstimator) and estimator.compiled

    @property
    def reuses_frames(self) -> bool:
        """Streaming calls may reuse finished frames (``forward_cached``): there is a page pool."""
        return self.pool is not None

    def frame_cache(self, budget: ReuseBudget) -> PagedCache:
        """A fresh per-request cache in the pool (which is its bound: ``budget`` is the eager solver's)."""
        return PagedCache(self._pool())

    def forward_cached(self, inputs: CfmInputs, caches: list[PagedCache]) -> Tensor:
        """The streaming solve computing only each row's frames after its cache, which it extends -> mel
        [B,80,T] float32, zero before each row's window (as ``CausalCFM.forward_cached``)."""
        layout, b = self._pool().layout, inputs.mu.size(0)
        starts, totals = [c.frames for c in caches], inputs.total_frames.tolist()
        bb, qq = self.bucket(b, max(t - s for s, t in zip(starts, totals)))
        slots = self._prefix(max(starts) // layout.chunk)
        call = self._captured((bb, qq, WINDOW, slots), inputs.mu.device)
        if call is None and (wider := self.graphs.covering((bb, qq, WINDOW, slots))) is not None:
            bb, qq = wider[0], wider[1]  # as in forward; the extra queries write the scratch page
            call = self._captured((bb, qq, WINDOW, slots), inputs.mu.device)
        batch = PagedBatch.plan(caches, totals, qq, slots, self.prefix_pages)
        with record_function("t2w.flow.solver"):
            noise = self.cfm.initial_noise(max(totals), inputs.mu.device, inputs.mu.dtype)
            padded = _window_inputs(inputs, noise, batch, bb, qq, layout)
            x = self._window_solver()(*padded) if call is None else call(*padded)
        for cache, start, total, keep in zip(caches, starts, totals, batch.keeps):
            cache.commit(keep, total - start)
        return place_windows(x[:b], starts, totals, inputs.mu.size(2))

    def bucket(self, batch: int, frames: int) -> tuple[int, int]:
        return bucket(batch, frames, self.frame_bucket)

    def forward(self, inputs: CfmInputs, streaming: bool) -> Tensor:
        b, frames = inputs.mu.size(0), inputs.mu.size(2)
        if frames > self.cfm.noise.size(2) - self.frame_bucket:
            return self.solver(inputs, streaming)  # near the noise buffer's end: no padding room
        bb, tt = self.bucket(b, frames)
        call = self._captured((bb, tt, streaming), inputs.mu.device)
        if call is None and (wider := self.graphs.covering((bb, tt, streaming))) is not None:
            bb, tt = wider[0], wider[1]  # not captured yet: a wider graph, padded as for its own bucket
            call = self._captured((bb, tt, streaming), inputs.mu.device)
        with record_function("t2w.flow.solver"):
            padded = _padded(inputs, bb, tt)
            # precaptured, and not this bucket: no capture on a request's path, but the bucket's shape (the
            # compiled estimator was traced at bucket shapes; a raw length could cost a recompile)
            out = self._solver(streaming)(*padded) if call is None else call(*padded)
        return out[:b, :, :frames]

    def precapture(
        self, max_batch: int, max_frames: int, device: torch.device, later: Later | None = None
    ) -> int:
        """Capture every (batch, frames, streaming) bucket up to these sizes (with ``later``, a background
        builder's ``add``, the first of each kind now and the rest there); returns how many there are.
        Where the page windows fail to compile, the pool goes and the streaming calls recompute (logged):
        frame reuse is an optimisation, and a load that fails for it would take the service down."""
        from torch._dynamo.exc import BackendCompilerFailed  # Dynamo: seconds to import, only for graphs

        # the solvers' noise and step schedule on the device now, on this thread's stream: graphs captured on
        # other threads and streams read them, so none may first make them in a warm-up there
        self.cfm.initial_noise(1, device, torch.float32)
        self.cfm.schedule(device, torch.float32)
        devices.synchronize(device)
        if self.aot is not None:
            return self._serve_programs(max_batch, max_frames, device, later)
        if later is not None and self.compiled:
            return self._serve_eager_first(max_batch, max_frames, device, later)
        try:
            return self._precapture(max_batch, max_frames, device, later)
        except BackendCompilerFailed:
            if self.pool is None:
                raise
            log.exception("the flow's page windows did not compile; streaming flow calls will recompute")
            self.pool, self.graphs = None, GraphCache("flow solver", self.graphs.max_graphs, covers=True)
            return self._precapture(max_batch, max_frames, device, later)

    def twin(self) -> GraphedCFM:
        """The same solver (the one serving now), page pool and settings with a graph cache of its own, none
        captured: a second worker's (a graph's input buffers serve one thread at a time)."""
        twin = copy.copy(self)
        twin._modules = dict(self._modules)  # its own solver slot: a later swap of this one's stays here
        twin.graphs = GraphCache(f"{self.graphs.name} (first lane)", self.graphs.max_graphs, covers=True)
        return twin

    def precapture_first(
        self, max_frames: int, device: torch.device, stop: threading.Event | None = None
    ) -> int:
        """The graphs of a streaming request's first chunk, every frame bucket up to ``max_frames`` at batch 1
        (with a page pool its window after no cached frame: the narrowest prefix), captured now (paced by
        ``stop``) -> how many."""
        max_frames = min(max_frames, self.cfm.noise.size(2) - self.frame_bucket)
        _, top = self.bucket(1, max(max_frames, 1))
        tops = range(top, 0, -self.frame_bucket)
        if self.pool is None:
            keys: list[tuple] = [(1, frames, True) for frames in tops]
        else:
            # a voice's kept prompt: 3-4 pages for 3.5-4.5 s, the next prefix width
            widths = self.prefix_buckets[: 2 if self.voice_windows else 1]
            keys = [(1, frames, WINDOW, width) for frames in tops for width in widths]

        return self.graphs.capture_now(keys, lambda key: self._captured(key, device), device, stop)

    def _serve_eager_first(self, max_batch: int, max_frames: int, device: torch.device, later: Later) -> int:
        """Background graphs of a compiled estimator: the first graphs now of its eager twin (seconds; the
        compile of the DiT takes minutes), then on ``later`` the eager twin's other single-stream graphs,
        the "flow compile" job (the compiled programs and the graphs captured so far, swapped in at once),
        then the other graphs, captured of the solver then in use (the compiled one; the eager one if the
        compile failed). The single-stream graphs come before the compile because Dynamo's tracing is tens
        of seconds of Python: an uncaptured call meanwhile runs the eager DiT op by op, each op waiting for
        the interpreter (first chunks took seconds: BENCHMARKS.md, "Start-up"), while a replay is one call."""
        compiled, estimator = self.solver, self.solver.estimator
        assert isinstance(estimator, CompiledEstimator)
        self.solver = self.cfm.with_estimator(estimator.twin(compiled=False))
        between = ("flow compile", self._swap_job(lambda stop: compiled, device))
        return self._precapture(max_batch, max_frames, device, later, between)

    def _serve_programs(
        self, max_batch: int, max_frames: int, device: torch.device, later: Later | None
    ) -> int:
        """The programs compiled ahead of time. On disk (a warm start) or without ``later``: loaded (or
        built) now and every graph captured of them. Else as the compile in ``_serve_eager_first``: eager
        graphs first, then the "flow compile" job, waiting for the child process that builds them (a
        process, not the interpreter), swaps them in."""
        build = self._programs_build(device)
        if later is None or build.done:
            self.solver = self._programs_solver(build, None) or self.solver
            return self._precapture(max_batch, max_frames, device, later)
        between = ("flow compile", self._swap_job(lambda stop: self._programs_solver(build, stop), device))
        return self._precapture(max_batch, max_frames, device, later, between)

    def _programs_build(self, device: torch.device) -> AotBuild:
        """The package set for this solver (its estimator, dtype, attention, page pool or not)."""
        from engine.flow.aot_package import AotBuild, AotSpec

        assert self.aot is not None
        spec = AotSpec.of(self.cfm, self.dtype, device, self.aot.cudnn, paged=self.pool is not None)
        return AotBuild(spec, self.aot.root)

    def _programs_solver(self, build: AotBuild, stop: threading.Event | None) -> CausalCFM | None:
        """The solver running ``build``'s programs (built now if the cache root lacks them), bound to the
        serving estimator's weights; None when ``stop`` came first."""
        from engine.flow.aot_package import AotPrograms

        estimator = cast(CompiledEstimator, self.solver.estimator)
        if not build.start().wait(stop):
            return None
        programs = AotPrograms.load(build.path, estimator.inner)
        return self.cfm.with_estimator(estimator.with_programs(programs))

    def _swap_job(self, solver: Callable[[threading.Event], CausalCFM | None], device: torch.device) -> Job:
        """Get the compiled ``solver`` (None: stopped), capture every key captured by then of it, then
        serve them: the graphs and the uncaptured solver switch together; a stop or a failure leaves the
        eager ones."""

        def job(stop: threading.Event) -> None:
            compiled = solver(stop)
            if compiled is None:
                return
            keys = cast("list[tuple]", self.graphs.keys())  # this cache's keys are tuples
            calls = self.graphs.record_all(
                keys, lambda key: self._recipe(key, compiled, device), device, stop
            )
            if calls is None:
                return
            self.graphs.replace(calls)
            self.solver = compiled
            log.info("the compiled flow estimator serves now (%d graphs replaced)", len(calls))

        return job

    def _recipe(self, key: tuple, solver: CausalCFM, dev: torch.device) -> tuple[Callable, Callable]:
        """The function and input buffers of ``key``'s graph, of ``solver``."""
        run, statics, _ = self._kind(key, dev, solver)
        return run, statics

    def _kind(
        self, key: tuple, dev: torch.device, solver: CausalCFM | None = None
    ) -> tuple[Callable, Callable[[], tuple[Tensor, ...]], Callable | None]:
        """What ``key``'s graph records (a page window's or a bucket's solve; whole, or one step of it), its
        input buffers, and for a step graph the solve's x before its first step (else None)."""
        if key[2] == WINDOW:
            layout = self._pool().layout
            statics = functools.partial(_window_statics, key[0], key[1], layout, key[3], dev)
            if not self.stepped:
                return self._window_solver(solver), statics, None
            return self._window_step(solver), lambda: _stepped(statics()), _window_start
        streaming, statics = bool(key[2]), functools.partial(_statics, key[0], key[1], dev)
        if not self.stepped:
            return self._solver(streaming, solver), statics, None
        return self._step(streaming, solver), lambda: _stepped(statics()), self._noise_start

    def _captured(self, key: tuple, dev: torch.device) -> Callable[..., Tensor] | None:
        """``key``'s graph of the serving solver, captured now if the cache allows (None: not captured)."""
        run, statics, start = self._kind(key, dev)
        call = self.graphs.get(key, run, statics)
        if call is None or start is None:
            return call
        return SteppedCall(call, start, self.cfm.cfg.n_timesteps)

    def _precapture(
        self,
        max_batch: int,
        max_frames: int,
        device: torch.device,
        later: Later | None,
        between: tuple[str, Job] | None = None,
    ) -> int:
        max_frames = min(max_frames, self.cfm.noise.size(2) - self.frame_bucket)
        top_batch, top_frames = self.bucket(max_batch, max(max_frames, 1))
        keys: list[tuple] = []
        for batch, frames in largest_first(top_batch, top_frames, self.frame_bucket):
            keys += [*self._streaming_keys(batch, frames, top_frames), (batch, frames, False)]

        return self.graphs.precapture(keys, lambda key: self._captured(key, device), device, later, between)

    def _streaming_keys(self, batch: int, frames: int, top_frames: int) -> list[tuple]:
        """The streaming graphs of a bucket: one full solve, or with a pool the windows of every prefix
        width that a request of up to ``top_frames`` can reach (its cache starts past the width below).
        Windows after a prefix are a hop and a chunk long: those past half of ``top_frames`` (a long first
        call after a full budget) run uncaptured, which keeps the load's captures (and time) down."""
        if self.pool is None:
            return [(batch, frames, True)]
        chunk, lows = self.pool.layout.chunk, (-1, *self.prefix_buckets)
        reach = [
            p
            for low, p in zip(lows, self.prefix_buckets)
            if (low + 1) * chunk + frames - self.frame_bucket < top_frames
            and (p == self.prefix_buckets[0] or frames <= max(top_frames // 2, self.frame_bucket))
        ]
        return [(batch, frames, WINDOW, p) for p in sorted(reach, reverse=True)]

    def _prefix(self, pages: int) -> int:
        """The window graphs' prefix width for rows with up to ``pages`` cached chunks."""
        return next((p for p in self.prefix_buckets if p >= pages), pages)

    def _window_solver(self, solver: CausalCFM | None = None):
        """The page-window solve of ``solver`` (None: of the one serving when it runs)."""
        pool = self._pool()

        def run(*tensors: Tensor) -> Tensor:
            return (self.solver if solver is None else solver).forward_paged(pool, *tensors)

        return run

    def _window_step(self, solver: CausalCFM | None = None):
        """One step of ``_window_solver``'s solve, in place on (x, step, *window inputs)."""
        pool = self._pool()

        def run(x: Tensor, step: Tensor, noise: Tensor, *tensors: Tensor) -> Tensor:
            return (self.solver if solver is None else solver).forward_paged_step(pool, x, step, *tensors)

        return run

    def _pool(self) -> PagePool:
        if self.pool is None:
            raise RuntimeError("no page pool: enable_reuse first")
        return self.pool

    def _solver(self, streaming: bool, solver: CausalCFM | None = None):
        """The solve of ``solver`` (None: of the one serving when it runs) on a bucket's input buffers."""

        def run(mu: Tensor, mask: Tensor, spks: Tensor, cond: Tensor) -> Tensor:
            frames = torch.zeros(mu.size(0), dtype=torch.long, device=mu.device)
            serving = self.solver if solver is None else solver
            return serving(CfmInputs(mu, mask, spks, cond, frames, frames), streaming)

        return run

    def _step(self, streaming: bool, solver: CausalCFM | None = None):
        """One step of ``_solver``'s solve, in place on (x, step, *bucket inputs)."""

        def run(x: Tensor, step: Tensor, mu: Tensor, mask: Tensor, spks: Tensor, cond: Tensor) -> Tensor:
            frames = torch.zeros(mu.size(0), dtype=torch.long, device=mu.device)
            serving = self.solver if solver is None else solver
            return serving.solve_step(x, step, CfmInputs(mu, mask, spks, cond, frames, frames), streaming)

        return run

    def _noise_start(self, values: tuple[Tensor, ...]) -> Tensor:
        """A whole solve's x before its first step: the fixed noise at the bucket's frames (mu [B,80,T])."""
        mu = values[0]
        return self.cfm.initial_noise(mu.size(2), mu.device, mu.dtype).expand(mu.size(0), -1, -1)


def _window_start(values: tuple[Tensor, ...]) -> Tensor:
    """A window solve's x before its first step: its noise, the first input (``_window_statics``)."""
    return values[0]


def _stepped(statics: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """A step graph's input buffers around a whole solve's (the state x shaped as the first, mu or noise)."""
    return step_statics(statics[0], statics)


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


def _page_sizes(cfm: CausalCFM) -> tuple[int, ...] | None:
    """``CausalCFM.cache_sizes`` and the numbers of conv state a page keeps (the U-Net's; 0 for the DiT)."""
    sizes, est = cfm.cache_sizes, cfm.estimator
    if sizes is None:
        return None
    convs = est.conv_states() if isinstance(est, CausalConditionalDecoder) else ()
    return *sizes, sum(channels * left for channels, left in convs)


def _window_statics(
    batch: int, queries: int, layout: PageLayout, prefix: int, dev: torch.device
) -> tuple[Tensor, ...]:
    """A window graph's input buffers: noise [B,80,Q], mu and cond [B,80,lead+Q], spks [B,80], then
    ``PagedBatch.tensors``; padded rows run one frame from frame 0 over the scratch page."""
    noise = torch.zeros(batch, 80, queries, device=dev)
    mu = torch.zeros(batch, 80, layout.lead + queries, device=dev)
    start, total = (torch.full((batch,), n, dtype=torch.long, device=dev) for n in (0, 1))
    widths = (prefix, queries // layout.chunk, layout.lead_pages)
    pages = (torch.zeros(batch, n, dtype=torch.long, device=dev) for n in widths)
    return noise, mu, torch.zeros_like(mu), torch.zeros(batch, 80, device=dev), start, total, *pages


def _window_inputs(
    inputs: CfmInputs, noise: Tensor, batch: PagedBatch, rows: int, queries: int, layout: PageLayout
) -> tuple[Tensor, ...]:
    """Each row's window frames (its lead, then its queries, from its cache's end on; noise [1,80,T] the
    solver's) in bucket-sized tensors, padded rows as ``_window_statics`` makes them."""
    b, dev, lead = inputs.mu.size(0), inputs.mu.device, layout.lead
    pos = batch.start[:, None] - lead + torch.arange(lead + queries, device=dev)  # [B,lead+Q]
    statics = _window_statics(rows, queries, layout, batch.prefix.size(1), dev)
    real = (
        gather_frames(noise.expand(b, -1, -1), pos[:, lead:]),
        gather_frames(inputs.mu, pos),
        gather_frames(inputs.cond, pos),
        inputs.spks,
        *batch.tensors,
    )
    for static, value in zip(statics, real):
        static[:b] = value
    return statics
