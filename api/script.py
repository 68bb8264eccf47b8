"""``POST /v1/audio/script``: a script of several speakers, pauses and tags as one stream or one file.

The body names a voice per speaker (saved, example or stock OpenAI names); the script format is
``engine/text/script.py``'s.
Like ``/v1/audio/speech``, the first audio is awaited before any header leaves, so
a refusal keeps its status code. Then by ``stream`` / ``stream_format``: chunked audio bytes; SSE events
(``speech.audio.delta``, a ``script.part.done`` per spoken part with its span, speaker and word times,
then ``speech.audio.done``); or one file, or with ``timestamps`` one JSON object with the audio (base64),
the parts, the words and their SRT and WebVTT. Each part is its own engine request, so a script of
20,000 characters streams without meeting the per-request time limit.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import asdict
from typing import Any

import anyio
import numpy as np
from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from api.auth import require_key
from api.context import ApiContext, EngineLike
from api.contract import check_fields
from api.encode import MEDIA_TYPES, encode_audio, stream_encoder
from api.errors import ApiError, from_engine
from api.lexicons import applied_header, library, run
from api.ops import check_model
from api.route import guarded_route
from api.schemas import ResponseFormat, StreamFormat
from api.speech import check_format, check_ready, delta, sse_event
from api.streaming import EngineStreamResponse, cut_stream
from api.voices import call
from engine.errors import EngineError, TooLarge
from engine.lexicons import Applied, Lexicon, apply_to_parts
from engine.request import SynthesisRequest
from engine.serving.performance import PartDone, perform
from engine.serving.subtitles import Turn, Word, WordTimer, to_srt, to_vtt
from engine.text.script import (
    MAX_SCRIPT_AUDIO_S,
    MAX_SCRIPT_CHARS,
    Part,
    Speech,
    compile_script,
    parse_script,
)

log = logging.getLogger(__name__)

MAX_SPEAKERS = 8
MAX_RESPONSE_BYTES = 64 * 2**20  # one whole (unstreamed) response: about 23 min of 24 kHz wav
PARAMS = {"text": "script", "voices": "voices", "gap": "gap_ms", "voice_id": "voices", "language": "language"}
Item = np.ndarray | PartDone


class ScriptRequest(BaseModel):
    """The script, a voice per speaker (the first one also speaks untitled text), the gap between turns."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    script: str
    voices: dict[str, str] = Field(min_length=1, max_length=MAX_SPEAKERS)  # speaker name -> voice id
    gap_ms: float = Field(300.0, ge=0.0, le=5000.0)
    response_format: ResponseFormat = "wav"
    stream: bool = False
    stream_format: StreamFormat = "audio"
    timestamps: bool = False  # word times: JSON beside the whole file, or events in the SSE stream
    language: str = "auto"
    seed: int | None = Field(None, ge=0, lt=2**63)
    lexicon: str | None = Field(None, max_length=64)  # a saved lexicon applied to every spoken line

    def streams(self) -> bool:
        return self.stream or self.stream_format == "sse"


def routes(ctx: ApiContext) -> APIRouter:
    router = APIRouter(route_class=guarded_route(ctx.telemetry, 8 * MAX_SCRIPT_CHARS + 64 * 1024))
    owner = Depends(require_key(ctx.api_keys))

    @router.post("/v1/audio/script", response_model=None)
    async def create_script(body: ScriptRequest, request: Request, caller: str = owner) -> Response:
        return await perform_script(ctx, body, request, caller)

    return router


async def perform_script(ctx: ApiContext, body: ScriptRequest, request: Request, owner: str) -> Response:
    check_ready(ctx.engine)
    check_model(body.model, ctx.engine)
    check_format(body.response_format)
    check_fields({"script": body.script}, MAX_SCRIPT_CHARS)  # the contract's characters, as every text
    try:
        lines = parse_script(body.script, list(body.voices))
        parts = compile_script(lines, ctx.engine.family, body.gap_ms / 1000)
        cast = await build_cast(ctx.engine, body, owner)
    except EngineError as err:
        raise from_engine(err, PARAMS) from err
    parts, applied = await lexicon_parts(ctx, body.lexicon, parts, owner)
    # a local engine's Whisper; a remote engine has none
    timer: WordTimer | None = getattr(ctx.engine, "word_timer", None)
    gen = bounded(perform(ctx.engine, parts, cast, timer, timings=body.timestamps), ctx.engine.sample_rate)
    first = await open_performance(gen)
    if not body.streams():
        response = await whole(ctx, request, gen, first, body)
        response.headers.update(applied_header(applied))
        return response
    sse = body.stream_format == "sse"
    content = sse_events(gen, first, body, ctx) if sse else audio_bytes(gen, first, body, ctx)
    headers = {"X-Sample-Rate": str(ctx.engine.sample_rate), "X-Script-Parts": str(spoken(parts))}
    headers |= applied_header(applied)
    return EngineStreamResponse(
        content,
        on_disconnect=ctx.telemetry.disconnects.inc,  # closing the content aborts every part's request
        on_start=ctx.telemetry.api_streams.inc,
        on_end=ctx.telemetry.api_streams.dec,
        media_type="text/event-stream" if sse else MEDIA_TYPES[body.response_format],
        headers=headers | ({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"} if sse else {}),
    )


async def lexicon_parts(
    ctx: ApiContext, name: str | None, parts: list[Part], owner: str
) -> tuple[list[Part], Applied | None]:
    """Each spoken part's text with the lexicon applied (``engine.lexicons.apply_to_parts``), and every
    hit together; None when no lexicon was asked for."""
    if not name:
        return parts, None
    lexicon: Lexicon = await run(library(ctx).get, name, owner)
    return apply_to_parts(lexicon, parts)


def spoken(parts: list[Part]) -> int:
    return sum(1 for p in parts if isinstance(p, Speech))


async def build_cast(engine: EngineLike, body: ScriptRequest, owner: str) -> dict[str, SynthesisRequest]:
    """A request template per speaker; every voice is checked now, not when its first line comes up."""
    from engine.voices import OPENAI_VOICES  # lazy: engine.voices imports torch (the server listens first)

    known = {str(getattr(v, "id", v)) for v in await call(engine.list_voices, owner)} | set(OPENAI_VOICES)
    cast: dict[str, SynthesisRequest] = {}
    for name, voice in body.voices.items():
        if voice not in known and voice.lower() not in OPENAI_VOICES:
            message = f"speaker {name!r}: no voice {voice!r} (GET /v1/audio/voices lists them)"
            raise ApiError(404, message, param="voices", code="voice_not_found")
        try:
            template = SynthesisRequest(
                voice_id=voice, voice_owner=owner, language=body.language, seed=body.seed
            )
            cast[name] = template
        except ValueError as err:
            raise ApiError(422, str(err), code="invalid_value") from err
    return cast


async def bounded(gen: AsyncGenerator[Item, None], rate: int) -> AsyncGenerator[Item, None]:
    """The performance, failing (``TooLarge``) once its audio passes ``MAX_SCRIPT_AUDIO_S``: the pauses
    are bounded before it starts, the speech only as it is made."""
    limit, made = round(MAX_SCRIPT_AUDIO_S * rate), 0
    try:
        async for item in gen:
            made += item.size if isinstance(item, np.ndarray) else 0
            if made > limit:
                message = f"the script's audio has passed {MAX_SCRIPT_AUDIO_S:g} s, the limit"
                raise TooLarge(message, field="text", code="script_too_long")
            yield item
    finally:
        await gen.aclose()


def response_bytes(samples: int, body: ScriptRequest) -> int:
    """The most a whole response may take: 16-bit samples (wav/pcm; the compressed formats take less),
    base64 (4/3) inside the JSON with timestamps."""
    size = 2 * samples
    return size * 4 // 3 if body.timestamps else size


async def open_performance(gen: AsyncGenerator[Item, None]) -> Item:
    """The first item (engine refusals of the first part surface here, before the status line)."""
    try:
        return await anext(gen)
    except EngineError as err:
        await gen.aclose()
        raise from_engine(err, PARAMS) from err
    except StopAsyncIteration:
        raise ApiError(500, "the script produced no audio", code="no_audio") from None


async def items(gen: AsyncGenerator[Item, None], first: Item) -> AsyncIterator[Item]:
    yield first
    async for item in gen:
        yield item


def part_json(done: PartDone) -> dict[str, Any]:
    return asdict(done) | {"words": [asdict(w) for w in done.words]}


async def audio_bytes(
    gen: AsyncGenerator[Item, None], first: Item, body: ScriptRequest, ctx: ApiContext
) -> AsyncGenerator[bytes, None]:
    """Encoded audio as it comes; a mid-stream failure cuts the connection (a clean end would lie)."""
    encoder = stream_encoder(body.response_format, ctx.engine.sample_rate)
    try:
        async for item in items(gen, first):
            if isinstance(item, np.ndarray) and (data := encoder.feed(item)):
                yield data
        if tail := encoder.finish():
            yield tail
    except EngineError as err:
        ctx.telemetry.stream_errors.inc()
        raise cut_stream(err, "a script") from err
    finally:
        await gen.aclose()


async def sse_events(
    gen: AsyncGenerator[Item, None], first: Item, body: ScriptRequest, ctx: ApiContext
) -> AsyncGenerator[str, None]:
    encoder = stream_encoder(body.response_format, ctx.engine.sample_rate)
    audio_s = 0.0
    try:
        async for item in items(gen, first):
            if isinstance(item, PartDone):
                yield sse_event({"type": "script.part.done", **part_json(item)})
                audio_s = item.end_s
            elif data := encoder.feed(item):
                yield delta(data)
        if tail := encoder.finish():
            yield delta(tail)
        yield sse_event({"type": "speech.audio.done", "audio_s": audio_s})
    except EngineError as err:
        ctx.telemetry.stream_errors.inc()
        log.warning("a script failed mid-stream: %s", err)
        yield sse_event({"type": "error", **from_engine(err, PARAMS).body()})
    finally:
        await gen.aclose()


async def whole(
    ctx: ApiContext, request: Request, gen: AsyncGenerator[Item, None], first: Item, body: ScriptRequest
) -> Response:
    """Every part, then one file (or JSON with the file, the parts, the words and their subtitles)."""
    pcm: list[np.ndarray] = []
    parts: list[PartDone] = []
    samples = 0
    try:
        async for item in items(gen, first):
            (parts if isinstance(item, PartDone) else pcm).append(item)  # type: ignore[arg-type]
            samples += item.size if isinstance(item, np.ndarray) else 0
            if response_bytes(samples, body) > MAX_RESPONSE_BYTES:
                message = (
                    f"the response would pass {MAX_RESPONSE_BYTES} bytes, the limit of a whole response:"
                    " shorten the script, or stream it (stream: true)"
                )
                raise ApiError(413, message, param="script", code="response_too_large")
            if await request.is_disconnected():
                ctx.telemetry.disconnects.inc()
                raise ApiError(499, "client closed the request", code="client_closed")
    except EngineError as err:
        raise from_engine(err, PARAMS) from err
    finally:
        await gen.aclose()
    rate = ctx.engine.sample_rate
    data = await anyio.to_thread.run_sync(encode_audio, np.concatenate(pcm), rate, body.response_format)
    if not body.timestamps:
        media = MEDIA_TYPES[body.response_format]
        return Response(data, media_type=media, headers={"X-Sample-Rate": str(rate)})
    words: list[Word] = [w for p in parts for w in p.words]
    turns = [Turn(p.speaker, p.words) for p in parts]  # the subtitles name each cue's speaker
    return JSONResponse(
        {
            "audio": base64.b64encode(data).decode("ascii"),
            "format": body.response_format,
            "sample_rate": rate,
            "duration_s": sum(a.size for a in pcm) / rate,
            "parts": [part_json(p) for p in parts],
            "words": [asdict(w) for w in words],
            "srt": to_srt(turns),
            "vtt": to_vtt(turns),
        }
    )
