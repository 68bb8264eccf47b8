"""``POST /v1/audio/transcriptions``: OpenAI's transcription API over the engine's Whisper.

Multipart ``file``: what Whisper takes, not what a voice prompt needs: any format the server decodes, any
rate from 4 kHz up (8 kHz telephone audio is resampled to Whisper's 16 kHz), any length up to 30 s (one
Whisper window), silence allowed. ``model``: any transcription id ``/v1/models`` lists (``whisper-1``,
``gpt-4o-transcribe``, ``gpt-4o-mini-transcribe``, the Whisper checkpoint's name). ``language``: an ISO
code (detected when absent). ``response_format``: ``json`` -> {"text", "usage"}, ``text``, ``srt``,
``vtt``, ``verbose_json`` (task, language name, duration, text, one segment with Whisper's tokens,
average log-probability, compression ratio and no-speech probability). The other fields the stock
client sends are checked by type and range: ``prompt`` and ``temperature`` are accepted and unused (the
decoding is greedy and unprompted), ``timestamp_granularities[]`` may ask for segments (not words),
``stream`` must be false. Every refusal is the OpenAI error shape, ``param`` naming the form field.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import anyio
from fastapi import APIRouter, Depends, File, Form, UploadFile
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from api.auth import require_key
from api.context import ApiContext
from api.errors import ApiError, from_engine
from api.ops import transcription_ids
from api.route import guarded_route
from api.speech import check_ready
from engine.errors import EngineError, shown

Format = Literal["json", "text", "srt", "vtt", "verbose_json"]
FORM_SLACK_BYTES = 64 * 1024
MAX_PROMPT_CHARS = 4096


def routes(ctx: ApiContext) -> APIRouter:
    router = APIRouter(
        route_class=guarded_route(ctx.telemetry, ctx.limits.max_upload_bytes + FORM_SLACK_BYTES)
    )
    auth = [Depends(require_key(ctx.api_keys))]

    @router.post("/v1/audio/transcriptions", dependencies=auth, response_model=None)
    async def create_transcription(
        file: Annotated[UploadFile | None, File()] = None,
        model: Annotated[str, Form(min_length=1, max_length=256)] = "whisper-1",
        language: Annotated[str, Form(max_length=16, pattern=r"^[A-Za-z-]*$")] = "",
        response_format: Annotated[Format, Form()] = "json",
        prompt: Annotated[str, Form(max_length=MAX_PROMPT_CHARS)] = "",
        temperature: Annotated[float, Form(ge=0.0, le=1.0)] = 0.0,
        granularities: Annotated[
            list[Literal["segment", "word"]], Form(alias="timestamp_granularities[]")
        ] = [],  # noqa: B006 (FastAPI copies defaults)
        stream: Annotated[bool, Form()] = False,
    ) -> Response:
        check_request(ctx, model, response_format, granularities, stream)
        if file is None:
            raise ApiError(
                422, "file (the audio to transcribe) is required", param="file", code="missing_file"
            )
        audio = await read_upload(ctx, file)
        try:
            result = await ctx.engine.transcribe(audio, language.strip().lower() or None)
        except EngineError as err:
            raise from_engine(err) from err
        return respond(result, response_format)

    return router


def check_request(
    ctx: ApiContext, model: str, response_format: str, granularities: Sequence[str], stream: bool
) -> None:
    check_ready(ctx.engine)  # while loading, whether it will transcribe is not known yet: 503 as elsewhere
    served = transcription_ids(ctx.engine)
    if not served:
        message = "transcription is off on this server (started with --asr-model none)"
        raise ApiError(501, message, code="asr_disabled")
    if model not in served:
        message = f"model {shown(model)} is not a transcription model here; use one of {', '.join(served)}"
        raise ApiError(404, message, param="model", code="model_not_found")
    if stream:
        message = "streamed transcription is not supported: send stream=false (or leave it out)"
        raise ApiError(422, message, param="stream", code="unsupported_value")
    if "word" in granularities:
        message = "word timestamps are not supported; timestamp_granularities may ask for segment"
        raise ApiError(422, message, param="timestamp_granularities", code="unsupported_value")
    if granularities and response_format != "verbose_json":
        message = "timestamp_granularities needs response_format verbose_json"
        raise ApiError(422, message, param="timestamp_granularities", code="invalid_value")


async def read_upload(ctx: ApiContext, file: UploadFile) -> Any:
    data = await file.read(ctx.limits.max_upload_bytes + 1)
    if len(data) > ctx.limits.max_upload_bytes:
        message = f"file is over the upload limit of {ctx.limits.max_upload_bytes} bytes"
        raise ApiError(413, message, param="file", code="upload_too_large")
    return await anyio.to_thread.run_sync(decode, data, ctx.limits.max_upload_bytes)


def decode(data: bytes, max_bytes: int) -> tuple[Any, int]:
    """(samples, rate) at the file's own rate, under transcription's limits (a worker thread: CPU)."""
    from engine.asr import audio_limits  # lazy: engine.asr imports torch
    from engine.audio import read_audio

    try:
        audio = read_audio(data, audio_limits(max_bytes))
    except EngineError as err:
        mapped = from_engine(err)
        mapped.param = "file"
        raise mapped from err
    return audio.samples, audio.sample_rate


def compression_ratio(text: str) -> float:
    """Whisper's repetition gauge: UTF-8 bytes over their zlib-compressed size."""
    data = text.encode()
    return round(len(data) / len(zlib.compress(data)), 4) if data else 0.0


def timestamp(seconds: float, comma: bool) -> str:
    ms = round(seconds * 1000)
    text = f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}.{ms % 1000:03d}"
    return text.replace(".", ",") if comma else text


def respond(result: Any, response_format: str) -> Response:
    text, duration = str(result.text), round(float(result.duration_s), 3)
    if response_format == "text":
        return PlainTextResponse(text)
    if response_format in ("srt", "vtt"):
        comma = response_format == "srt"
        cue = f"{timestamp(0.0, comma)} --> {timestamp(duration, comma)}\n{text}\n"
        return PlainTextResponse(f"1\n{cue}" if comma else f"WEBVTT\n\n{cue}")
    usage = {"type": "duration", "seconds": max(1, round(duration))}  # OpenAI bills whole seconds
    if response_format == "json":
        return JSONResponse({"text": text, "usage": usage})
    from transformers.models.whisper.tokenization_whisper import LANGUAGES  # code -> English name

    segment = {"id": 0, "seek": 0, "start": 0.0, "end": duration, "text": text, "temperature": 0.0}
    segment |= {  # Whisper's own per-segment figures (one segment: the whole window)
        "tokens": list(getattr(result, "tokens", ())),
        "avg_logprob": float(getattr(result, "avg_logprob", 0.0)),
        "compression_ratio": compression_ratio(text),
        "no_speech_prob": float(getattr(result, "no_speech_prob", 0.0)),
    }
    body = {"task": "transcribe", "language": LANGUAGES.get(result.language, result.language)}
    return JSONResponse(body | {"duration": duration, "text": text, "segments": [segment], "usage": usage})
