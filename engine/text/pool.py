"""Text normalisation and tokenisation for many requests at once, in worker processes.

The text side of a request (wetext normalisation, sentence splitting, the Qwen tokenizer) is Python that
holds the GIL: in threads, concurrent requests queue behind each other (two threads take longer than one
doing the same calls in turn). Each worker process holds its own copy of the
``TextFrontend``, loaded from the tokenizer directory when it starts (not pickled from this process: a
pickled Hugging Face tokenizer whose vocabulary has holes, as the tiny test one does, comes back with other
special-token ids), and answers ``TextJob -> TextIds``. With
``workers == 0`` the job runs in a thread of this process instead (CPU machines, tests).

A worker that dies breaks the pool: the request that met it fails with SynthesisFailed and the pool is
rebuilt for the next one.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import threading
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

from engine.errors import SynthesisFailed, Unspeakable
from engine.request import Mode, SynthesisRequest
from engine.text.frontend import TextFrontend, load_normalizers, load_tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TextJob:
    """The text side of a request: plain values, so it can be sent to another process."""

    text: str
    mode: Mode
    language: str
    text_frontend: bool
    transcript: str  # the prompt's (zero-shot)
    instruct_text: str


@dataclass(frozen=True)
class TextIds:
    segments: list[list[int]]  # each sentence's text ids, spoken one after another
    prompt: list[int]  # the prompt-text ids (zero-shot transcript or instruction); empty for cross-lingual


def text_job(req: SynthesisRequest, transcript: str) -> TextJob:
    return TextJob(req.text, req.mode, req.language, req.text_frontend, transcript, req.instruct_text)


def text_ids(text: TextFrontend, job: TextJob) -> TextIds:
    """Normalise, split and tokenise (pure Python that holds the GIL: the engine's text pool runs it)."""
    cross = job.mode == Mode.CROSS_LINGUAL
    segments = text.prepare(job.text, job.language, job.text_frontend, cross_lingual=cross)
    if not segments:
        raise Unspeakable("the text has nothing to speak after normalisation", field="text")
    prompt: list[int] = []
    if job.mode == Mode.ZERO_SHOT:
        prompt = text.tokenize(text.prompt_text(job.transcript, job.language, job.text_frontend))
    elif job.mode == Mode.INSTRUCT:
        prompt = text.tokenize(text.instruct_text(job.instruct_text))
    return TextIds([text.tokenize(s) for s in segments], prompt)


_worker_text: TextFrontend | None = None  # in a worker process: its own copy, set by _start_worker


def _start_worker(tokenizer_dir: str, family: str) -> None:
    global _worker_text
    _worker_text = TextFrontend(load_tokenizer(tokenizer_dir, family))
    load_normalizers()  # before the first job, not during it


def _run_in_worker(job: TextJob) -> TextIds:
    assert _worker_text is not None, "the pool's initializer sets it"
    return text_ids(_worker_text, job)


def _ping() -> bool:
    return True


class TextPool:
    """``text``: this process's frontend (used with no workers); ``tokenizer_dir``: where workers load
    theirs from (the model's CosyVoice-BlankEN); needed when ``workers > 0``. Workers need only the
    ``family`` and the directory, so a pool with workers may start before this process's frontend has
    loaded (``text`` None, ``attach`` later): at load their start (seconds of imports each) then runs
    beside everything else instead of after the tokenizer."""

    def __init__(
        self,
        text: TextFrontend | None,
        workers: int,
        tokenizer_dir: str | os.PathLike[str] | None = None,
        family: str | None = None,
    ):
        if workers < 0:
            raise ValueError(f"workers must be >= 0, got {workers}")
        if workers and tokenizer_dir is None:
            raise ValueError("worker processes need the tokenizer directory to load from")
        if text is None and not (workers and family):
            raise ValueError("a pool without its frontend needs workers and the family they load")
        self.text, self.workers, self.tokenizer_dir = text, workers, tokenizer_dir
        self.family = text.family if text is not None else str(family)
        self._lock = threading.Lock()
        self._pool = self._new_pool()
        self._pings: list[Future[bool]] = []  # one per worker, done once it has started (``start``)

    def attach(self, text: TextFrontend) -> None:
        """This process's frontend, once loaded (a pool started before it)."""
        if text.family != self.family:
            raise ValueError(f"the pool's workers load {self.family}, the frontend is {text.family}")
        self.text = text

    def _new_pool(self) -> ProcessPoolExecutor | None:
        if self.workers == 0:
            return None
        # spawn, not fork: this process runs CUDA, vLLM and worker threads that a fork would copy mid-state
        ctx = multiprocessing.get_context("spawn")
        args = (os.fspath(self.tokenizer_dir or ""), self.family)
        return ProcessPoolExecutor(self.workers, ctx, initializer=_start_worker, initargs=args)

    def start(self) -> None:
        """Start every worker now, without waiting for them (each imports and loads for seconds: at load
        this runs beside the LM backend's start); a pool would start them on demand, under the first
        requests. ``wait_started`` waits."""
        if self._pool is not None and not self._pings:
            self._pings = [self._pool.submit(_ping) for _ in range(self.workers)]

    def wait_started(self, timeout_s: float = 120.0) -> None:
        """Block until every worker has started (its tokenizer and normalisers loaded)."""
        self.start()
        for ping in self._pings:
            ping.result(timeout=timeout_s)

    async def run(self, job: TextJob) -> TextIds:
        pool, text = self._pool, self.text
        if pool is None:
            assert text is not None, "a pool without workers is built with its frontend"
            return await asyncio.to_thread(text_ids, text, job)
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, _run_in_worker, job)
        except BrokenProcessPool as err:
            log.error("a text worker process died (%s); starting a new pool", err)
            self._replace(pool)
            raise SynthesisFailed("the text frontend failed for this request; please try again") from err

    def _replace(self, broken: ProcessPoolExecutor) -> None:
        with self._lock:  # several requests can meet the same broken pool: one replacement
            if self._pool is broken:
                broken.shutdown(wait=False, cancel_futures=True)
                self._pool = self._new_pool()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
