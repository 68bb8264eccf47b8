"""The text pool: the same ids from a worker process as from this one, errors carried back, and a dead
worker failing only the request that met it."""

from __future__ import annotations

import asyncio
import os
import signal
from concurrent.futures import Future
from pathlib import Path

import pytest

from engine.demo.tiny_tokenizer import write_tiny_tokenizer
from engine.errors import InvalidInput, SynthesisFailed
from engine.request import Mode
from engine.text.frontend import TextFrontend, load_tokenizer
from engine.text.pool import TextJob, TextPool, text_ids

JOBS = [
    TextJob("On 2024-05-03 it was 25 degrees. Then it rained!", Mode.ZERO_SHOT, "en", True, "A prompt.", ""),
    TextJob("今天是2024年5月3日。", Mode.CROSS_LINGUAL, "auto", True, "", ""),
    TextJob("Speak up.", Mode.INSTRUCT, "auto", True, "", "speak happily"),
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tok") / "CosyVoice-BlankEN"
    write_tiny_tokenizer(root, "cosyvoice3")
    return root


@pytest.fixture(scope="module")
def text(tokenizer_dir) -> TextFrontend:
    return TextFrontend(load_tokenizer(tokenizer_dir, "cosyvoice3"))


@pytest.fixture(scope="module")
def pool(text, tokenizer_dir):
    pool = TextPool(text, 1, tokenizer_dir)
    pool.wait_started()
    yield pool
    pool.close()


def test_a_worker_process_gives_the_ids_this_process_computes(text, pool):
    async def all_jobs():
        return await asyncio.gather(*(pool.run(job) for job in JOBS))

    got = asyncio.run(all_jobs())
    want = [text_ids(text, job) for job in JOBS]
    assert got == want
    assert got[0].prompt and not got[1].prompt and got[2].prompt  # zero-shot, cross-lingual, instruct


def test_errors_come_back_from_the_worker_as_raised(pool):
    with pytest.raises(InvalidInput, match="nothing to speak"):
        asyncio.run(pool.run(TextJob("...", Mode.CROSS_LINGUAL, "auto", True, "", "")))


def test_a_dead_worker_fails_one_request_and_the_pool_comes_back(text, tokenizer_dir):
    pool = TextPool(text, 1, tokenizer_dir)
    try:
        pool.wait_started()
        for pid in list(pool._pool._processes):  # type: ignore[union-attr]
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(SynthesisFailed, match="try again"):
            asyncio.run(pool.run(JOBS[0]))
        assert asyncio.run(pool.run(JOBS[0])) == text_ids(text, JOBS[0])
    finally:
        pool.close()


def test_no_workers_runs_in_a_thread_here(text):
    pool = TextPool(text, workers=0)
    assert asyncio.run(pool.run(JOBS[2])) == text_ids(text, JOBS[2])
    with pytest.raises(ValueError):
        TextPool(text, workers=-1)
    with pytest.raises(ValueError, match="tokenizer directory"):
        TextPool(text, workers=2)


def loaded_normalizers() -> int:
    """Run in a worker: how many wetext normalisers it has built."""
    from engine.text.frontend import _wetext

    return _wetext.cache_info().currsize


def test_a_worker_loads_its_normalizers_before_its_first_job(text, tokenizer_dir):
    """A fresh worker builds both wetext normalisers as it starts, so no request waits for them."""
    fresh = TextPool(text, 1, tokenizer_dir)
    try:
        fresh.wait_started()
        assert fresh._pool is not None
        assert fresh._pool.submit(loaded_normalizers).result(timeout=60) == 2
    finally:
        fresh.close()


class HeldPings:
    """A stand-in process pool whose workers start only when the test says (``release``)."""

    def __init__(self) -> None:
        self.pings: list[Future[bool]] = []

    def submit(self, fn, *args):
        self.pings.append(Future())
        return self.pings[-1]

    def release(self) -> None:
        for ping in self.pings:
            ping.set_result(True)

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        pass


def test_start_returns_at_once_and_wait_started_waits_for_every_worker(text, tokenizer_dir, monkeypatch):
    """At load the workers start beside the LM backend's start: ``start`` only sends each its first job,
    ``wait_started`` returns once all have answered (a timeout while one has not)."""
    held = HeldPings()
    monkeypatch.setattr(TextPool, "_new_pool", lambda self: held)
    pool = TextPool(text, 3, tokenizer_dir)
    pool.start()
    pool.start()  # once: the same three first jobs
    assert len(held.pings) == 3 and not any(p.done() for p in held.pings)
    with pytest.raises(TimeoutError):
        pool.wait_started(timeout_s=0.05)
    held.release()
    pool.wait_started(timeout_s=0.05)


def test_workers_start_before_this_process_has_its_frontend(text, tokenizer_dir):
    """At load the workers start first (they need only the family and the directory); the frontend joins
    once loaded, and jobs then come back as this process computes them."""
    early = TextPool(None, 1, tokenizer_dir, family="cosyvoice3")
    try:
        early.wait_started()  # started with no frontend in this process
        with pytest.raises(ValueError, match="cosyvoice2"):
            early.attach(TextFrontend(load_tokenizer(tokenizer_dir, "cosyvoice2")))
        early.attach(text)
        assert asyncio.run(early.run(JOBS[0])) == text_ids(text, JOBS[0])
    finally:
        early.close()
    with pytest.raises(ValueError, match="needs workers"):
        TextPool(None, 0, tokenizer_dir, family="cosyvoice3")
