"""``POST /v1/audio/transcriptions``: OpenAI's transcription API over the engine's Whisper.

Multipart ``file`` (up to 30 s: one Whisper window, the prompt limit), ``model`` (``whisper-1`` or the
loaded model's name), optional ``language`` (ISO code; detected when absent) and ``response_format``
(``json`` -> {"text"}, ``text`` -> the text alone, ``verbose_json`` -> task, language name, duration, text
and one segment). The same ``read_prompt`` checks as a voice upload apply, so a bad file is a clear 4xx.
"""

from __future__ import annotations

from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Depends, File, Form, UploadFile
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from api.auth import require_key
from api.context import ApiContext
from api.errors import ApiError, from_engine
from api.route import guarded_route
from api.speech import read_prompt
from engine.errors import EngineError

FORMATS = ("json", "text", "verbose_json")
OPENAI_ASR_MODELS = ("whisper-1", "gpt-4o-transcribe", "gpt-4o-mini-transcribe")
FORM_SLACK_BYTES = 64 * 1024


def routes(ctx: ApiContext) -> APIRouter:
    router = APIRouter(
        route_class=guarded_route(ctx.telemetry, ctx.limits.max_upload_bytes + FORM_SLACK_BYTES)
    )
    auth = [Depends(require_key(ctx.api_keys))]

    @router.post("/v1/audio/transcriptions", dependencies=auth, response_model=None)
    async def create_transcription(
        file: Annotated[UploadFile | None, File()] = None,
        model: Annotated[str, Form()] = "whisper-1",
        language: Annotated[str, Form()] = "",
        response_format: Annotated[str, Form()] = "json",
    ) -> Response:
        check_request(ctx, model, response_format)
        if file is None:
            raise ApiError(
                422, "file (the audio to transcribe) is required", param="file", code="missing_file"
            )
        audio = await read_upload(ctx, file)
        try:
            result = await ctx.engine.transcribe(audio, language.strip() or None)
        except EngineError as err:
            raise from_engine(err) from err
        return respond(result, response_format)

    return router


def check_request(ctx: ApiContext, model: str, response_format: str) -> None:
    served = ctx.engine.asr_model
    if not served:
        message = "transcription is off on this server (started with --asr-model none)"
        raise ApiError(501, message, code="asr_disabled")
    if model not in (*OPENAI_ASR_MODELS, served):
        message = f"model {model!r} is not served here; use whisper-1 or {served}"
        raise ApiError(404, message, param="model", code="model_not_found")
    if response_format not in FORMATS:
        message = f"response_format must be one of {', '.join(FORMATS)}"
        raise ApiError(422, message, param="response_format", code="unsupported_format")


async def read_upload(ctx: ApiContext, file: UploadFile) -> Any:
    data = await file.read(ctx.limits.max_upload_bytes + 1)
    if len(data) > ctx.limits.max_upload_bytes:
        message = f"file is over the upload limit of {ctx.limits.max_upload_bytes} bytes"
        raise ApiError(413, message, param="file", code="upload_too_large")
    return await anyio.to_thread.run_sync(read_prompt, data, ctx, "file")


def respond(result: Any, response_format: str) -> Response:
    text = str(result.text)
    if response_format == "text":
        return PlainTextResponse(text)
    if response_format == "json":
        return JSONResponse({"text": text})
    from transformers.models.whisper.tokenization_whisper import LANGUAGES  # code -> English name

    duration = round(float(result.duration_s), 3)
    segment = {"id": 0, "seek": 0, "start": 0.0, "end": duration, "text": text}
    body = {"task": "transcribe", "language": LANGUAGES.get(result.language, result.language)}
    return JSONResponse(body | {"duration": duration, "text": text, "segments": [segment]})
