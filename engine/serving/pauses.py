"""``<break time="..."/>`` in a request's text: exact silence at that place, on every door that takes text
(the speech API, the studio, the CLI), as in scripts (``engine.text.script``).

A text with breaks is spoken piece by piece: each piece between two breaks is one engine request (the
same request id, one after another, so an abort reaches the piece being spoken), the breaks are chunks of
zeros. The chunks are numbered as one stream; the last one closes it.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import replace

import numpy as np

from engine.request import AudioChunk, SynthesisRequest
from engine.text.script import Pause, has_break, split_pauses


def has_pauses(req: SynthesisRequest) -> bool:
    return req.text_stream is None and has_break(req.text)


async def with_pauses(
    stream: Callable[[SynthesisRequest], AsyncIterator[AudioChunk]], req: SynthesisRequest, sample_rate: int
) -> AsyncGenerator[AudioChunk, None]:
    """``req``'s audio with its breaks as silence: ``stream`` speaks each piece of text in between. A
    piece that ends without its last chunk (aborted) ends the whole stream there, unfinished."""
    silence: list[np.ndarray] = []  # breaks not sent yet (chunks carry metrics: the next piece's)
    index, last = 0, None
    for piece in split_pauses(req.text):
        if isinstance(piece, Pause):
            silence.append(np.zeros(round(piece.seconds * sample_rate), np.float32))
            continue
        finished = False
        async for chunk in stream(replace(req, text=piece)):
            for pcm in silence:
                yield AudioChunk(pcm, sample_rate, index, False, chunk.metrics)
                index += 1
            silence, last, finished = [], chunk, chunk.is_last
            if not chunk.is_last:
                yield replace(chunk, index=index)
                index += 1
        if not finished:
            return
    if last is not None:
        for pcm in silence:  # trailing breaks
            yield AudioChunk(pcm, sample_rate, index, False, last.metrics)
            index += 1
        yield AudioChunk(np.zeros(0, np.float32), sample_rate, index, True, last.metrics)
