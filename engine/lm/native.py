"""Native PyTorch speech-LM backend: one decode thread that batches every active request's step.

Requests join between steps (continuous batching): each step prefills the newcomers one by one, then runs
ONE batched decode forward over all running requests (their KV caches have different lengths), samples
each row with its own RAS state and hands the ids to the requests' asyncio queues. Per-request state (KV
cache, sampler, output queue, abort flag) lives in the request's own ``_Sequence`` object.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from engine import device as devices
from engine.config import SamplingConfig
from engine.errors import SynthesisFailed
from engine.lm.backend import LMRequest
from engine.lm.bistream import Feed, Layout, Picker, RASPicker, Round, Step, embed, run_round
from engine.lm.decode_slot import DecodeSlot
from engine.lm.sampling import SamplerState, sample_step
from engine.lm.speech_lm import KVCache, SpeechLM

log = logging.getLogger(__name__)
_END = object()


@dataclass(eq=False)
class _Sequence:
    req: LMRequest
    sampler: SamplerState
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    cache: KVCache | None = None
    last: int = -1
    aborted: bool = False

    def emit(self, item: object) -> None:
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening any more
            self.aborted, self.cache = True, None


class NativeLM:
    """Continuous-batching decode loop on one device; ``generate`` streams speech-token ids."""

    name = "native"

    def __init__(
        self, lm: SpeechLM, sampling: SamplingConfig, max_batch: int = 64, slot: DecodeSlot | None = None
    ):
        self.lm, self.sampling, self.max_batch = lm, sampling, max_batch
        self._slot = slot  # a lone request's steps replayed from one graph (engine.lm.decode_slot)
        weight = lm.speech_embedding.weight
        self._device, self._dtype = weight.device, weight.dtype
        self._pending: list[_Sequence] = []
        self._running: list[_Sequence] = []
        self._calls: list[_Call] = []  # bistream forwards, run between two steps
        self._cond = threading.Condition()
        self._closed = False
        self._died = False  # the decode thread is ending on an error: nothing will compute any more
        self._thread = threading.Thread(target=self._loop, name="native-lm", daemon=True)
        self._thread.start()

    @property
    def active(self) -> int:
        with self._cond:
            return len(self._pending) + len(self._running)

    async def generate(self, req: LMRequest) -> AsyncIterator[int]:
        """Yield sampled ids (stop id excluded) until a stop id or max_len; closing the iterator aborts."""
        seq = _Sequence(req, req.sampler(), asyncio.get_running_loop())
        with self._cond:
            if self._closed:
                raise RuntimeError("the LM backend is closed")
            self._pending.append(seq)
            self._cond.notify()
        try:
            while (item := await seq.out.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item  # type: ignore[misc]
        finally:
            seq.aborted = True  # the loop drops it before its next step

    @property
    def healthy(self) -> bool:
        return self._thread.is_alive() and not self._died

    def session(self, request_id: str, seed: int) -> NativeSession:
        """A bistream request: its own KV cache kept across rounds, RAS seeded with ``seed``."""
        speech = self.lm.config.speech_token_size
        return NativeSession(self, RASPicker(seed, self.sampling, speech))

    async def call(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on the decode thread, between two batched steps (the model is only used from there)."""
        loop = asyncio.get_running_loop()
        call = _Call(fn, loop, loop.create_future())
        with self._cond:
            if self._closed:
                raise RuntimeError("the LM backend is closed")
            self._calls.append(call)
            self._cond.notify()
        return await call.future

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as err:  # the thread dies: nothing will answer the requests waiting on it
            log.critical("the native LM decode thread stopped: %r", err)
            self._stop_all(err)
            raise

    def _stop_all(self, err: BaseException) -> None:
        """Fail every request the dead thread held (they would wait forever) and refuse new ones."""
        failure = SynthesisFailed(f"the speech LM stopped ({type(err).__name__}); the server needs a restart")
        with self._cond:
            self._closed = self._died = True
            seqs, calls = self._pending + self._running, self._calls
            self._pending, self._running, self._calls = [], [], []
        self._fail(seqs, failure)
        for call in calls:
            with contextlib.suppress(RuntimeError):
                call.loop.call_soon_threadsafe(call._settle, None, failure)

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not (self._closed or self._pending or self._running or self._calls):
                    self._cond.wait()
                if self._closed:
                    return
                room = self.max_batch - len(self._running)
                self._pending.sort(key=lambda s: s.req.priority)  # stable: arrival order within a priority
                new, self._pending = self._pending[:room], self._pending[room:]
                calls, self._calls = self._calls, []
            try:
                with torch.inference_mode():
                    for call in calls:
                        call.run()
                    self._step(new)
            except Exception:  # never let the decode thread die: later requests would wait forever
                log.exception("LM loop step failed")

    def _step(self, new: list[_Sequence]) -> None:
        self._running = [s for s in self._running if not s.aborted]
        for seq in new:  # one by one: a failing prefill fails only its own request
            if not seq.aborted:
                self._start(seq)
        self._running += [s for s in new if not s.aborted]
        if not self._running:
            return
        try:
            self._decode(self._running)
        except Exception as err:  # a failed batched step fails the requests in it, not the loop
            log.exception("LM decode step failed")
            self._fail(self._running, err)
            self._running = []

    def _start(self, seq: _Sequence) -> None:
        try:
            seq.cache = self.lm.new_cache()
            hidden = self.lm.prefill(seq.req.prefix.to(self._device, self._dtype), seq.cache)
            self._sample([seq], hidden.unsqueeze(0))
        except Exception as err:
            log.exception("LM prefill failed for request %s", seq.req.request_id)
            self._fail([seq], err)

    def _fail(self, seqs: list[_Sequence], err: Exception) -> None:
        if devices.is_out_of_memory(err):
            devices.empty_cache(self._device)
            err = SynthesisFailed(
                "the device ran out of memory for this request; try a shorter text or again later"
            )
        for seq in seqs:
            seq.emit(err)
            seq.aborted, seq.cache = True, None

    def _decode(self, running: list[_Sequence]) -> None:
        hidden = self._alone(running[0]) if len(running) == 1 else None
        if hidden is None:
            ids = torch.tensor([s.last for s in running], device=self._device)
            caches = [s.cache for s in running if s.cache is not None]
            hidden = self.lm.decode(self.lm.speech_embeds(ids), caches)  # [B, H]
        self._sample(running, hidden)
        self._running = [s for s in running if not s.aborted]

    def _alone(self, seq: _Sequence) -> torch.Tensor | None:
        """The only decoding request's step from the slot, adopting it first (no other live cache holds
        the slot: any other has ended or left the batch); None where there is no slot or no room."""
        slot, cache = self._slot, seq.cache
        if slot is None or cache is None or not slot.has_room(cache):
            return None
        if not slot.holds(cache):
            slot.adopt(cache)
        return slot.step(seq.last, cache)  # [1, H]

    def _sample(self, seqs: list[_Sequence], hidden: torch.Tensor) -> None:
        logp = self.lm.logprobs(hidden)  # [B, V] float32
        tokens = sample_step(logp, [s.sampler for s in seqs], self.sampling)
        for seq, tok in zip(seqs, tokens):
            sampler = seq.sampler
            if tok not in sampler.stop_ids:
                seq.emit(tok)
            if sampler.finished(tok):
                seq.emit(_END)
                seq.aborted, seq.cache = True, None  # finished: leaves the batch, frees its KV cache
            seq.last = tok


@dataclass(eq=False)
class _Call:
    fn: Callable[[], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]

    def run(self) -> None:
        try:
            result, error = self.fn(), None
        except Exception as err:  # handed to the caller, who raises it in its own request
            result, error = None, err
        with contextlib.suppress(RuntimeError):  # the caller's event loop is closed: nobody is waiting
            self.loop.call_soon_threadsafe(self._settle, result, error)

    def _settle(self, result: Any, error: Exception | None) -> None:
        if self.future.done():  # the caller was cancelled meanwhile
            return
        if error is not None:
            self.future.set_exception(error)
        else:
            self.future.set_result(result)


class NativeSession:
    """One bistream request on the native backend: rounds run step by step against its own KV cache."""

    def __init__(self, native: NativeLM, picker: Picker, trace: list[Step] | None = None):
        self.native, self.picker, self.trace = native, picker, trace
        config = native.lm.config
        self.layout = Layout.of(config)
        self.specials = tuple(sorted(config.stop_ids))
        self.cache: KVCache | None = native.lm.new_cache()

    def round(self, rnd: Round) -> AsyncIterator[int]:
        return run_round(rnd, self._forward, self.picker, self.layout, self.specials)

    async def _forward(self, feeds: tuple[Feed, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        result: tuple[torch.Tensor, torch.Tensor] = await self.native.call(lambda: self._step(feeds))
        return result

    def _step(self, feeds: tuple[Feed, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward on the decode thread: hidden [H] and log-probs [V] at the last fed position."""
        if self.cache is None:
            raise RuntimeError("the bistream session is closed")
        lm, start = self.native.lm, self.cache.length
        hidden = lm.prefill(embed(lm, feeds), self.cache)
        logp = lm.logprobs(hidden)
        if self.trace is not None:
            self.trace.append(Step(feeds, start, hidden.float().cpu(), logp.cpu()))
        return hidden, logp

    async def aclose(self) -> None:
        self.cache = None  # frees the KV cache; a forward still queued fails into nobody's hands
