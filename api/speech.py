"""``POST /v1/audio/speech``: OpenAI's speech API over ``engine.stream``.

The first chunk is awaited before any header is sent, so a refusal (busy, not found, bad input) still gets
its status code and the time to first audio can travel as a header. Then, by ``stream`` /
``stream_format``: chunked bytes as produced, SSE events (base64 deltas + a final event with metrics), or
one file with exact sizes and the RTF header.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import math
import threading
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import replace
from typing import Any

import anyio
import numpy as np
from fastapi import APIRouter, Depends, Request, Response

from api.auth import require_key
from api.context import ApiContext, EngineLike
from api.contract import check_fields
from api.encode import (
    MEDIA_TYPES,
    StreamEncoder,
    encode_audio,
    probe_formats_ahead,
    stream_encoder,
    supported_formats,
)
from api.errors import ApiError, from_engine, retry_after
from api.lexicons import applied_header, apply_lexicon
from api.ops import check_model
from api.route import guarded_route
from api.schemas import SpeechRequest
from api.streaming import EngineStreamResponse, cut_stream
from api.stretch import split_speed, time_stretch
from api.telemetry import Telemetry
from engine.errors import EngineError
from engine.request import AudioChunk, Mode, SynthesisRequest
from engine.serving.metrics import RequestMetrics

log = logging.getLogger(__name__)

Prompt = tuple[np.ndarray, int]  # (float32 mono samples, sample rate Hz)
NOT_READY_RETRY_S = 5.0
# SynthesisRequest field -> this route's parameter, for the ``param`` of an engine error
SPEECH_PARAMS = {
    "text": "input",
    "voice_id": "voice",
    "prompt_text": "ref_text",
    "instruct_text": "instructions",
    "prompt_audio": "ref_audio",
    "source_audio": "source_audio",
    "language": "language",
}


def body_cap(ctx: ApiContext) -> int:
    """Largest plausible speech body: two base64 audios, three texts at 6 JSON bytes a char, slack."""
    b64 = 4 * math.ceil(ctx.limits.max_upload_bytes / 3)
    return 2 * b64 + 3 * 6 * ctx.limits.max_text_chars + 64 * 1024


def routes(ctx: ApiContext) -> APIRouter:
    # before the server listens: the first request pays neither PyAV's import nor the first prompt's decode
    probe_formats_ahead()
    decode_ahead()
    router = APIRouter(route_class=guarded_route(ctx.telemetry, body_cap(ctx)))
    # the caller's voice namespace; a default (not Annotated): string annotations cannot see this local
    owner = Depends(require_key(ctx.api_keys))

    @router.post("/v1/audio/speech", response_model=None)
    async def create_speech(body: SpeechRequest, request: Request, caller: str = owner) -> Response:
        return await speak(ctx, body, request, caller)

    return router


async def speak(ctx: ApiContext, body: SpeechRequest, request: Request, owner: str) -> Response:
    check_ready(ctx.engine)
    check_model(body.model, ctx.engine)
    check_format(body.response_format)
    check_length(body.input, "input", ctx.limits.max_text_chars)
    applied = await apply_lexicon(ctx, body.lexicon, body.input, owner)
    if applied is not None:
        body = body.model_copy(update={"input": applied.text})
    req = await build_request(ctx, body, owner)
    # Built before the engine stream opens, so nothing between opening and responding can fail.
    encoder = stream_encoder(body.response_format, ctx.engine.sample_rate) if body.streams() else None
    try:
        gen, first = await open_stream(ctx.engine, req)
    except EngineError as err:
        raise from_engine(err, SPEECH_PARAMS) from err
    stretch = split_speed(body.speed)[1]
    if stretch != 1.0:  # beyond the model's own 0.5-2: the rest as a time-stretch of its audio
        gen, first = stretched(gen, stretch), stretch_chunk(first, stretch)
    ctx.telemetry.first_audio(first.metrics)
    if encoder is None:
        response: Response = await whole_file(ctx, request, gen, first, body.response_format)
    else:
        response = stream_response(ctx, body, req.request_id, gen, first, encoder)
    response.headers.update(applied_header(applied))
    return response


def stream_response(
    ctx: ApiContext,
    body: SpeechRequest,
    request_id: str,
    gen: AsyncIterator[AudioChunk],
    first: AudioChunk,
    encoder: StreamEncoder,
) -> EngineStreamResponse:
    telemetry, sse = ctx.telemetry, body.stream_format == "sse"
    headers = metric_headers(first.metrics, first.sample_rate, final=False)
    if sse:
        content: AsyncGenerator[Any, None] = sse_events(telemetry, gen, first, encoder)
        headers |= {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    else:
        content = audio_bytes(telemetry, gen, first, encoder)

    def on_disconnect() -> None:
        telemetry.disconnects.inc()
        ctx.engine.abort(request_id)

    return EngineStreamResponse(
        content,
        on_disconnect=on_disconnect,
        on_start=telemetry.api_streams.inc,
        on_end=telemetry.api_streams.dec,
        media_type="text/event-stream" if sse else MEDIA_TYPES[body.response_format],
        headers=headers,
    )


# ------------------------------------------------------------------------------------------- checks


def check_ready(engine: EngineLike) -> None:
    if not getattr(engine, "ready", True):
        message = "the model is still loading or warming up; retry shortly"
        raise ApiError(503, message, code="not_ready", headers=retry_after(NOT_READY_RETRY_S))


def check_format(fmt: str) -> None:
    if fmt not in supported_formats():
        have = ", ".join(supported_formats())
        message = f"response_format {fmt!r} has no encoder on this server; available: {have}"
        raise ApiError(422, message, param="response_format", code="unsupported_format")


def check_length(text: str, param: str, max_chars: int) -> None:
    if len(text) > max_chars:
        message = f"{param} has {len(text)} characters; the limit is {max_chars}"
        raise ApiError(413, message, param=param, code="text_too_long")


# ------------------------------------------------------------------------------------ request building


async def build_request(ctx: ApiContext, body: SpeechRequest, owner: str | None = None) -> SynthesisRequest:
    mode = body.resolved_mode()
    texts = {"input": body.input, "ref_text": body.ref_text, "instructions": body.instructions}
    if mode != Mode.VC and not body.input.strip() and len(body.input) <= ctx.limits.max_text_chars:
        raise ApiError(422, "input is empty", param="input", code="empty_input")
    spoken = "input" if mode != Mode.VC else None  # vc speaks source_audio: its input is not read
    check_fields(texts, ctx.limits.max_text_chars, spoken=spoken, family=ctx.engine.family)
    check_mode_inputs(body, mode, bool(ctx.engine.asr_model))  # before decoding: cheap refusals first
    prompt = await decode_audio_field(body.ref_audio, "ref_audio", ctx) if body.ref_audio else None
    source = await decode_audio_field(body.source_audio, "source_audio", ctx) if body.source_audio else None
    ref_text = body.ref_text
    if mode == Mode.ZERO_SHOT and prompt is not None and not ref_text.strip():
        ref_text = await transcribe_prompt(ctx.engine, prompt, "auto")  # the transcript zero-shot needs
    try:
        return SynthesisRequest(
            text=body.input,
            mode=mode,
            prompt_audio=prompt,
            voice_id=None if prompt is not None else (body.voice_id() or None),  # ref_audio wins
            voice_owner=owner,
            prompt_text=ref_text,
            instruct_text=body.instructions,
            source_audio=source,
            language=body.language,
            stream=body.streams(),
            speed=split_speed(body.speed)[0],
            seed=body.seed,
            forced_tokens=body.forced_tokens if ctx.limits.forced_tokens else None,
        )
    except ValueError as err:  # the request's own range checks: "<field> must be ..."
        field = str(err).split(" ", 1)[0]
        param = field if field in ("speed", "seed", "forced_tokens") else None
        raise ApiError(422, str(err), param=param, code="invalid_value") from err


def check_mode_inputs(body: SpeechRequest, mode: Mode, has_asr: bool = False) -> None:
    if mode == Mode.VC and not body.source_audio:
        raise ApiError(422, "mode 'vc' needs source_audio", param="source_audio", code="missing_source")
    if mode == Mode.ZERO_SHOT and body.ref_audio and not body.ref_text.strip() and not has_asr:
        message = (
            "zero-shot cloning needs ref_text, the transcript of ref_audio (this server has no ASR to make"
            " it; or use mode 'cross_lingual')"
        )
        raise ApiError(422, message, param="ref_text", code="missing_ref_text")
    if mode == Mode.INSTRUCT and not body.instructions.strip():
        raise ApiError(
            422, "mode 'instruct' needs instructions", param="instructions", code="missing_instructions"
        )


async def transcribe_prompt(engine: EngineLike, prompt: Prompt, language: str) -> str:
    """The prompt's transcript from the server's ASR (a worker thread; synthesis keeps running)."""
    try:
        result = await engine.transcribe(prompt, language)
    except EngineError as err:
        raise from_engine(err) from err
    text = str(result.text).strip()
    if not text:
        message = "no speech was recognised in ref_audio: send ref_text, its transcript"
        raise ApiError(422, message, param="ref_text", code="missing_ref_text")
    return text


def base64_payload(value: str, param: str, max_bytes: int) -> bytes:
    """Bytes of a base64 string or ``data:`` URL, refusing oversize input BEFORE decoding it."""
    if value.startswith(("http://", "https://", "file://")):
        message = f"{param} must be base64 or a data URL; URLs are not fetched"
        raise ApiError(400, message, param=param, code="invalid_audio_url")
    if value.startswith("data:"):
        head, sep, value = value.partition(",")
        if not sep or not head.endswith(";base64"):
            message = f"{param} must be a base64 data URL (data:audio/...;base64,...)"
            raise ApiError(400, message, param=param, code="invalid_base64")
    text = "".join(value.split())  # tolerate line-wrapped base64
    if len(text) > 4 * math.ceil(max_bytes / 3):
        message = f"{param} is over the upload limit of {max_bytes} bytes"
        raise ApiError(413, message, param=param, code="upload_too_large")
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ApiError(400, f"{param} is not valid base64", param=param, code="invalid_base64") from err
    if not data:
        raise ApiError(400, f"{param} is empty", param=param, code="invalid_base64")
    return data


def read_prompt(data: bytes, ctx: ApiContext, param: str) -> Prompt:
    """Decode (in a worker thread: CPU) with the engine's own checks: size, duration, rate, silence."""
    from engine.audio import AudioLimits, read_audio  # lazy: engine.audio imports torch

    limits = AudioLimits.for_prompt(ctx.limits)
    if param == "source_audio":  # speech to convert has no minimum length
        limits = AudioLimits(max_seconds=ctx.limits.max_prompt_s, max_bytes=ctx.limits.max_upload_bytes)
    try:
        audio = read_audio(data, limits)
    except EngineError as err:
        mapped = from_engine(err)
        mapped.param = param
        raise mapped from err
    return audio.samples, audio.sample_rate


def decode_ahead() -> threading.Thread:
    """A 0.1-s tone decoded as a prompt is (``engine.audio.read_audio``) on a thread of its own, now: the
    first decode loads libsndfile through soundfile (5 ms of a 2-core CPU; the first speech request's prompt
    decode took 24 ms there against 2.6 after), which is then nobody's request's."""

    def decode() -> None:
        from engine.audio import read_audio  # engine.audio imports torch: the server has it by now

        tone = 0.1 * np.sin(2 * np.pi * 220.0 * np.arange(2400) / 24000)
        read_audio(encode_audio(tone, 24000, "wav"))

    thread = threading.Thread(target=decode, name="decode-ahead", daemon=True)
    thread.start()
    return thread


async def decode_audio_field(value: str, param: str, ctx: ApiContext) -> Prompt:
    data = base64_payload(value, param, ctx.limits.max_upload_bytes)
    return await anyio.to_thread.run_sync(read_prompt, data, ctx, param)


# ------------------------------------------------------------------------------------------- streaming


async def open_stream(
    engine: EngineLike, req: SynthesisRequest
) -> tuple[AsyncIterator[AudioChunk], AudioChunk]:
    """Start the engine stream and wait for its first chunk (engine refusals surface here)."""
    gen = engine.stream(req)
    try:
        first = await anext(gen)
    except StopAsyncIteration:
        raise ApiError(500, "the engine produced no audio", code="no_audio") from None
    except BaseException:
        await close(gen)
        raise
    return gen, first


def stretch_chunk(chunk: AudioChunk, rate: float) -> AudioChunk:
    return replace(chunk, pcm=time_stretch(chunk.pcm, rate, chunk.sample_rate))


async def stretched(gen: AsyncIterator[AudioChunk], rate: float) -> AsyncIterator[AudioChunk]:
    """Each chunk time-stretched (at a speed off 1 the model sends whole segments, not pieces of one)."""
    try:
        async for chunk in gen:
            yield stretch_chunk(chunk, rate)
    finally:
        await close(gen)


async def close(gen: AsyncIterator[AudioChunk]) -> None:
    """Close the engine's stream now, so its ``finally:`` frees the request (async generators have
    ``aclose``; any other async iterator has nothing to close)."""
    aclose = getattr(gen, "aclose", None)
    if aclose is not None:
        await aclose()


async def next_chunk(gen: AsyncIterator[AudioChunk]) -> AudioChunk | None:
    """The next chunk, or None at the end. Pulled past ``is_last`` on purpose: the engine's generator
    then runs its end-of-request code normally instead of being closed at its last ``yield``."""
    return await anext(gen, None)


class Encoded:
    """An engine stream's encoded bytes as chunks arrive, then the encoder's tail. ``last`` is the latest
    chunk seen: once iteration ends, its metrics are the request's final ones."""

    def __init__(self, gen: AsyncIterator[AudioChunk], first: AudioChunk, encoder: StreamEncoder):
        self.gen, self.last, self.encoder = gen, first, encoder

    async def __aiter__(self) -> AsyncGenerator[bytes, None]:
        chunk: AudioChunk | None = self.last
        while chunk is not None:
            self.last = chunk
            if data := self.encoder.feed(chunk.pcm):
                yield data
            chunk = await next_chunk(self.gen)
        if tail := self.encoder.finish():
            yield tail


async def audio_bytes(
    telemetry: Telemetry, gen: AsyncIterator[AudioChunk], first: AudioChunk, encoder: StreamEncoder
) -> AsyncGenerator[bytes, None]:
    """Encoded bytes as chunks arrive. A mid-stream engine error becomes a ``StreamCut``, so the server
    cuts the connection: a truncated chunked body tells the client, a clean end would not."""
    stream = Encoded(gen, first, encoder)
    try:
        async for data in stream:
            yield data
        telemetry.finished(stream.last.metrics)
    except EngineError as err:
        telemetry.stream_errors.inc()
        raise cut_stream(err, f"request {first.metrics.request_id}") from err
    finally:
        await close(gen)


def sse_event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def delta(data: bytes) -> str:
    return sse_event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii")})


async def sse_events(
    telemetry: Telemetry, gen: AsyncIterator[AudioChunk], first: AudioChunk, encoder: StreamEncoder
) -> AsyncGenerator[str, None]:
    """OpenAI's ``speech.audio.delta`` events, then ``speech.audio.done`` with usage and our metrics; a
    mid-stream failure becomes an ``error`` event (the status line is long gone)."""
    stream = Encoded(gen, first, encoder)
    try:
        async for data in stream:
            yield delta(data)
        last = stream.last
        telemetry.finished(last.metrics)
        yield sse_event(
            {"type": "speech.audio.done", "usage": usage(last.metrics), "metrics": as_dict(last.metrics)}
        )
    except EngineError as err:
        telemetry.stream_errors.inc()
        log.warning("request %s failed mid-stream: %s", first.metrics.request_id, err)
        yield sse_event({"type": "error", **from_engine(err, SPEECH_PARAMS).body()})
    finally:
        await close(gen)


async def whole_file(
    ctx: ApiContext, request: Request, gen: AsyncIterator[AudioChunk], first: AudioChunk, fmt: str
) -> Response:
    """Collect every chunk (stopping early if the client leaves), encode once, send with exact sizes."""
    pieces, last = [first.pcm], first
    try:
        while (chunk := await next_chunk(gen)) is not None:
            pieces.append(chunk.pcm)
            last = chunk
            if await request.is_disconnected():
                ctx.telemetry.disconnects.inc()
                ctx.engine.abort(first.metrics.request_id)
                raise ApiError(499, "client closed the request", code="client_closed")
    finally:
        await close(gen)
    ctx.telemetry.finished(last.metrics)
    data = await anyio.to_thread.run_sync(encode_audio, np.concatenate(pieces), first.sample_rate, fmt)
    headers = metric_headers(last.metrics, first.sample_rate, final=True)
    return Response(data, media_type=MEDIA_TYPES[fmt], headers=headers)


# -------------------------------------------------------------------------------------------- metrics


def usage(metrics: RequestMetrics) -> dict[str, int]:
    """OpenAI's usage: input = text tokens the speech LM read, output = speech tokens it generated."""
    total = metrics.text_tokens + metrics.lm_tokens
    return {"input_tokens": metrics.text_tokens, "output_tokens": metrics.lm_tokens, "total_tokens": total}


def as_dict(metrics: RequestMetrics) -> dict[str, Any]:
    return {
        "request_id": metrics.request_id,
        "seed": metrics.seed,
        "ttfa_ms": metrics.ttfa_ms,
        "rtf": metrics.rtf,
        "audio_s": metrics.audio_s,
        "elapsed_ms": metrics.elapsed_ms,
        "queue_wait_ms": metrics.queue_wait_ms,
        "lm_tokens": metrics.lm_tokens,
        "text_tokens": metrics.text_tokens,
        "lm_tokens_per_s": metrics.lm_tokens_per_s,
        "stage_ms": metrics.stage_ms,
        "ttfa_parts_ms": metrics.ttfa_parts_ms,  # queue, frontend, lm, t2w_wait, t2w_compute
    }


def metric_headers(metrics: RequestMetrics, sample_rate: int, final: bool) -> dict[str, str]:
    """What is known when the headers leave: TTFA always (first chunk is in), RTF only for whole files."""
    headers = {
        "X-Request-Id": metrics.request_id,
        "X-Seed": str(metrics.seed),
        "X-Sample-Rate": str(sample_rate),
        "X-Queue-Wait-Ms": f"{metrics.queue_wait_ms:.1f}",
    }
    if metrics.ttfa_ms is not None:
        headers["X-TTFA-Ms"] = f"{metrics.ttfa_ms:.1f}"
    if final:
        headers["X-Audio-Seconds"] = f"{metrics.audio_s:.3f}"
        headers["X-Elapsed-Ms"] = f"{metrics.elapsed_ms:.1f}"
        if metrics.rtf is not None:
            headers["X-RTF"] = f"{metrics.rtf:.4f}"
    return headers
