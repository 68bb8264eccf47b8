"""``<break/>`` in a request's text is exact silence at that place (engine.serving.pauses), as in scripts:
the text between the breaks is spoken piece by piece under the request's own id."""

from __future__ import annotations

from collections.abc import AsyncIterator

import numpy as np

from engine.request import AudioChunk, SynthesisRequest
from engine.serving.metrics import Stopwatch
from engine.serving.pauses import has_pauses, with_pauses

RATE = 1000


class Pieces:
    """A stand-in for the engine's stream: two chunks of ones per piece of text; ``stop_at`` ends a piece
    early without its last chunk, as an abort does."""

    def __init__(self, stop_at: str | None = None):
        self.texts: list[str] = []
        self.ids: set[str] = set()
        self.stop_at = stop_at

    async def stream(self, req: SynthesisRequest) -> AsyncIterator[AudioChunk]:
        self.texts.append(req.text)
        self.ids.add(req.request_id)
        metrics = Stopwatch(req.request_id, 0).snapshot()
        yield AudioChunk(np.ones(100, np.float32), RATE, 0, False, metrics)
        if req.text == self.stop_at:
            return
        yield AudioChunk(np.zeros(0, np.float32), RATE, 1, True, metrics)


async def run(text: str, stop_at: str | None = None) -> tuple[Pieces, list[AudioChunk]]:
    fake = Pieces(stop_at)
    chunks = [c async for c in with_pauses(fake.stream, SynthesisRequest(text=text), RATE)]
    return fake, chunks


async def test_breaks_are_silence_between_the_pieces_spoken_under_one_id() -> None:
    fake, chunks = await run('<break time="100ms"/>Hello. <break time="0.5s"/> World! <break time="20ms"/>')
    assert fake.texts == ["Hello.", "World!"] and len(fake.ids) == 1
    pcm = np.concatenate([c.pcm for c in chunks])
    expected = [0.0] * 100 + [1.0] * 100 + [0.0] * 500 + [1.0] * 100 + [0.0] * 20
    assert pcm.tolist() == expected
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert [c.is_last for c in chunks] == [False] * (len(chunks) - 1) + [True]


async def test_an_aborted_piece_ends_the_stream_unfinished() -> None:
    fake, chunks = await run('One. <break time="1s"/> Two.', stop_at="One.")
    assert fake.texts == ["One."] and not any(c.is_last for c in chunks)


def test_only_whole_texts_with_a_break_take_this_way() -> None:
    assert has_pauses(SynthesisRequest(text='a <break time="1s"/> b'))
    assert not has_pauses(SynthesisRequest(text="a [breath] b <strong>c</strong>"))
