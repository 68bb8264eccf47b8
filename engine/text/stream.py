"""Text that arrives in pieces (an LLM's output, typing) -> normalised text ids in pieces.

Normalisation reads whole expressions ("$5.50", "Jan. 5, 2024", "2024年5月"), so a piece is never
normalised up to its raw end: ``TextPieces`` releases the longest prefix that ends at a word boundary with
more text known after it, where no digit touches the cut and no tag ([breath], <strong>) is open, and
holds the rest back until the next piece or the end. The released fragments are normalised and tokenised
one by one; a fragment keeps its leading space, so the Qwen tokenizer sees " word" as in the whole text.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterable, AsyncIterator, Callable

from engine.errors import InvalidInput, SynthesisFailed, TooLarge, Unspeakable
from engine.text.frontend import TextFrontend, has_speech, normalize_text, resolve_language, trim_marks

# A cut may follow these: CJK ideographs and the CJK / full-width punctuation (no spaces in that text).
_CJK = re.compile(r"[\u3000-\u303f\u4e00-\u9fff\uff00-\uffef]")


def _digit(c: str) -> bool:
    return c.isdigit()


def _cut_ok(text: str, i: int) -> bool:
    """May ``text[:i]`` be normalised alone? ``text[i]`` exists, so what follows the cut is known."""
    before, after = text[i - 1], text[i]
    if after.isspace() and not before.isspace():
        word = text[:i].rsplit(None, 1)[-1]
        rest = text[i:].lstrip()
        if not rest or _digit(rest[0]) or any(map(_digit, word)):
            return False
    elif not (_CJK.match(before) and not _digit(after) and not (i >= 2 and _digit(text[i - 2]))):
        return False
    head = text[:i]
    return head.count("[") == head.count("]") and head.count("<") == head.count(">")


def safe_cut(text: str) -> int:
    """Length of the longest prefix of ``text`` that can be normalised on its own (0: hold it all)."""
    return next((i for i in range(len(text) - 1, 0, -1) if _cut_ok(text, i)), 0)


class TextPieces:
    """One request's text as it arrives: ``push`` a raw piece, get the normalised text it releases."""

    def __init__(self, normalize: Callable[[str], str], max_chars: int):
        self.normalize, self.max_chars = normalize, max_chars
        self.chars = 0
        self._tail = ""
        self._started = False

    def push(self, piece: str) -> str:
        self.chars += len(piece)
        if self.chars > self.max_chars:
            raise TooLarge(f"the streamed text has passed {self.max_chars} characters, the limit")
        text = self._tail + piece
        cut = safe_cut(text)
        self._tail = text[cut:]
        return self._release(text[:cut])

    def finish(self) -> str:
        tail, self._tail = self._tail, ""
        return self._release(tail)

    def _release(self, raw: str) -> str:
        core = trim_marks(raw).strip()
        if not has_speech(core):  # zero-width or combining marks only: nothing to say, as for blank text
            return ""
        lead = " " if self._started and raw[0].isspace() else ""
        self._started = True
        out = self.normalize(core)
        return lead + out if out else ""


def text_pieces(text: TextFrontend, language: str, normalise: bool, max_chars: int) -> TextPieces:
    """The family's normaliser for ``language`` ("auto" decides per fragment), or none."""

    def normalize(fragment: str) -> str:
        return normalize_text(fragment, resolve_language(fragment, language), text.family)

    return TextPieces(normalize if normalise else (lambda s: s), max_chars)


class Prefetch:
    """Reads a text stream as it arrives, from the moment the request is submitted, into a queue the
    decoder drains: ``on_piece`` then sees each piece's arrival, not the time the decoder got to it."""

    def __init__(self, source: AsyncIterable[str], on_piece: Callable[[], None], max_chars: int):
        self._queue: asyncio.Queue[str | Exception | None] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._read(source, on_piece, max_chars))

    def end(self, error: Exception | None = None) -> None:
        """End the text now, from any thread (an abort): the decoder sees its end, or ``error`` raised."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, error)

    async def _read(self, source: AsyncIterable[str], on_piece: Callable[[], None], max_chars: int) -> None:
        chars = 0  # counted here too: a request waiting in line must not buffer an unbounded text
        try:
            async for piece in source:
                if not isinstance(piece, str):
                    raise InvalidInput(f"text pieces must be strings, got {type(piece).__name__}")
                chars += len(piece)
                if chars > max_chars:
                    raise TooLarge(f"the streamed text has passed {max_chars} characters, the limit")
                if piece:
                    on_piece()
                self._queue.put_nowait(piece)
            self._queue.put_nowait(None)
        except Exception as err:  # handed to the decoder, which fails the request with it
            self._queue.put_nowait(err)

    async def pieces(self) -> AsyncIterator[str]:
        while (item := await self._queue.get()) is not None:
            if isinstance(item, Exception):
                raise item
            yield item

    async def aclose(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


async def token_pieces(
    source: AsyncIterable[str],
    pieces: TextPieces,
    tokenize: Callable[[str], list[int]],
    idle_timeout_s: float,
) -> AsyncIterator[list[int]]:
    """Text ids for each released fragment; InvalidInput if nothing was said, SynthesisFailed when the
    caller sends nothing (neither a piece nor the end) for ``idle_timeout_s``."""
    said = False
    stream = aiter(source)
    while True:
        try:
            async with asyncio.timeout(idle_timeout_s):
                piece = await anext(stream)
        except StopAsyncIteration:
            break
        except TimeoutError as err:
            raise SynthesisFailed(f"no text arrived for {idle_timeout_s:.0f} s") from err
        if ids := tokenize(pieces.push(piece)):
            said = True
            yield ids
    if ids := tokenize(pieces.finish()):
        said = True
        yield ids
    if not said:
        raise Unspeakable("the text has nothing to speak (it is empty, or only invisible characters)")
