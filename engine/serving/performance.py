"""A script performed as one continuous stream: each spoken part is an engine request, pauses are silence.

``perform`` yields the output in order: ``np.ndarray`` audio (float32 mono at the engine's rate; pauses as
exact zeros) and, after each spoken part's last sample, a ``PartDone`` with where that part sits in the output
and its words' times. The next ``lookahead`` spoken parts are computed while the current one is delivered
(their chunks wait in their own queues), so a turn starts as soon as the previous one ends. Closing the
generator cancels the renders, whose ``finally`` aborts their engine requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from engine.request import AudioChunk, Mode, SynthesisRequest, new_request_id
from engine.serving.subtitles import Word, WordTimer, align_words
from engine.text.script import Pause, Speech

log = logging.getLogger(__name__)

LOOKAHEAD = 1  # spoken parts computed ahead of the one being delivered


class Streamer(Protocol):
    @property
    def sample_rate(self) -> int: ...

    def stream(self, req: SynthesisRequest) -> AsyncIterator[AudioChunk]: ...


@dataclass(frozen=True)
class PartDone:
    """A spoken part that has been delivered whole: ``index`` of ``total`` spoken parts, its span of the
    output in seconds, its words' times (empty unless asked for)."""

    index: int
    total: int
    speaker: str
    text: str
    start_s: float
    end_s: float
    words: tuple[Word, ...] = ()


def part_request(part: Speech, cast: Mapping[str, SynthesisRequest]) -> SynthesisRequest:
    """The speaker's request template with this part's text (and instruct, when the line has one)."""
    base = cast[part.speaker]
    instructed = {"mode": Mode.INSTRUCT, "instruct_text": part.instruct} if part.instruct else {}
    return replace(base, text=part.text, request_id=new_request_id(), **instructed)  # type: ignore[arg-type]


class _Render:
    """One spoken part computing in its own task; its chunks wait in ``queue`` until delivered."""

    def __init__(self, engine: Streamer, req: SynthesisRequest):
        self.queue: asyncio.Queue[np.ndarray | BaseException | None] = asyncio.Queue()
        self.task = asyncio.create_task(self._run(engine, req))

    async def _run(self, engine: Streamer, req: SynthesisRequest) -> None:
        try:
            async with contextlib.aclosing(engine.stream(req)) as chunks:  # type: ignore[type-var]
                async for chunk in chunks:
                    if chunk.pcm.size:
                        self.queue.put_nowait(chunk.pcm)
        except Exception as err:  # delivered, and raised, when the listener reaches this part
            self.queue.put_nowait(err)
            return
        self.queue.put_nowait(None)

    async def chunks(self) -> AsyncIterator[np.ndarray]:
        while (item := await self.queue.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item


async def perform(
    engine: Streamer,
    parts: Sequence[Speech | Pause],
    cast: Mapping[str, SynthesisRequest],
    timer: WordTimer | None = None,
    timings: bool = False,
    lookahead: int = LOOKAHEAD,
) -> AsyncGenerator[np.ndarray | PartDone, None]:
    """The script's audio in order, a ``PartDone`` after each spoken part (with word times if ``timings``:
    aligned by ``timer`` when given, else spread by letters)."""
    rate = engine.sample_rate
    spoken = [i for i, p in enumerate(parts) if isinstance(p, Speech)]
    renders: dict[int, _Render] = {}
    position = 0  # samples delivered so far
    try:
        for n, i in enumerate(spoken):
            for k in spoken[n : n + 1 + lookahead]:  # this part and the next ``lookahead``, started once
                if k not in renders:
                    renders[k] = _Render(engine, part_request(parts[k], cast))  # type: ignore[arg-type]
            for pause in _pauses_before(parts, i, spoken[n - 1] if n else -1, rate):
                position += pause.size
                yield pause
            pieces: list[np.ndarray] = []
            async for pcm in renders[i].chunks():  # stays in ``renders`` (cancelled on close) until done
                pieces.append(pcm)
                yield pcm
            del renders[i]
            audio = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
            part = parts[i]
            assert isinstance(part, Speech)
            words = await _words(part.text, audio, rate, timer, position / rate) if timings else []
            end = (position + audio.size) / rate
            yield PartDone(n, len(spoken), part.speaker, part.text, position / rate, end, tuple(words))
            position += audio.size
        for pause in _pauses_before(parts, len(parts), spoken[-1] if spoken else -1, rate):
            yield pause
    finally:
        await _cancel(renders.values())


def _pauses_before(parts: Sequence[Speech | Pause], i: int, after: int, rate: int) -> list[np.ndarray]:
    """The silences between spoken part ``after`` and part ``i`` (exact zeros, rounded to the sample)."""
    return [
        np.zeros(round(p.seconds * rate), np.float32) for p in parts[after + 1 : i] if isinstance(p, Pause)
    ]


async def _words(
    text: str, audio: np.ndarray, rate: int, timer: WordTimer | None, offset_s: float
) -> list[Word]:
    """Word times in a worker thread (Whisper is blocking); a failing ASR falls back to the spread."""
    try:
        return await asyncio.to_thread(align_words, text, audio, rate, timer, offset_s)
    except (RuntimeError, ValueError) as err:
        log.warning("word alignment by the ASR failed (%s); spreading the words by letters", err)
        return await asyncio.to_thread(align_words, text, audio, rate, None, offset_s)


async def _cancel(renders: Iterable[_Render]) -> None:
    tasks = [r.task for r in renders]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
