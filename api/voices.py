"""``/v1/audio/voices``: list, create (multipart: audio + transcript) and delete saved voices.

Every route works in the caller's namespace (``api.auth.require_key`` answers who calls: one per API key):
a caller lists the examples, the public voices and their own, and deletes only their own. A missing
transcript is made by the server's ASR when it has one. Create takes OpenAI's form (``name``,
``audio_sample``, ``consent``, ``type``) and answers OpenAI's ``audio.voice`` object; the consent reference
is stored with the voice and shown with it. A name the caller already sees is a 409 ``name_taken``.

An upload is size-checked before it is read, decoded with the engine's own checks (so a bad file is a
clear 4xx here), written to a temporary file and handed to ``engine.add_voice``, which stores what it
needs (features, metadata) in its voice library; the temporary file is removed afterwards.
"""

from __future__ import annotations

import inspect
import os
import tempfile
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import anyio
from fastapi import APIRouter, Depends, File, Form, UploadFile
from fastapi.responses import JSONResponse

from api.auth import require_key
from api.context import ApiContext
from api.contract import check_fields
from api.errors import ApiError, from_engine
from api.route import guarded_route
from api.schemas import VoiceDeleted, VoiceInfo, VoiceList
from api.speech import read_prompt, transcribe_prompt
from engine.errors import EngineError

MAX_NAME_CHARS = 64
# the engine's field -> this route's form field, for an error's ``param``
VOICE_PARAMS = {"name": "name", "prompt_text": "ref_text", "consent": "consent", "prompt_wav": "audio_sample"}
MAX_CONSENT_CHARS = 256
FORM_SLACK_BYTES = 64 * 1024  # multipart boundaries, headers and the text fields


def routes(ctx: ApiContext) -> APIRouter:
    cap = ctx.limits.max_upload_bytes + ctx.limits.max_text_chars * 4 + FORM_SLACK_BYTES
    router = APIRouter(route_class=guarded_route(ctx.telemetry, cap))
    engine = ctx.engine
    # the caller's voice namespace; a default (not Annotated): string annotations cannot see this local
    owner_dep = Depends(require_key(ctx.api_keys))

    @router.get("/v1/audio/voices")
    async def list_voices(owner: str = owner_dep) -> VoiceList:
        voices = [VoiceInfo.of(v) for v in await call(engine.list_voices, owner)]
        return VoiceList(data=voices, voices=[v.id for v in voices])

    @router.get("/v1/audio/voices/{voice_id}")
    async def get_voice(voice_id: str, owner: str = owner_dep) -> VoiceInfo:
        for voice in await call(engine.list_voices, owner):
            if VoiceInfo.of(voice).id == voice_id:
                return VoiceInfo.of(voice)
        raise ApiError(404, f"no saved voice {voice_id!r}", param="voice_id", code="voice_not_found")

    @router.post("/v1/audio/voices", status_code=201, response_model=None)
    async def create_voice(
        name: Annotated[str, Form()],
        ref_text: Annotated[str, Form()] = "",
        consent: Annotated[str, Form(max_length=MAX_CONSENT_CHARS)] = "",
        type: Annotated[Literal["audio_sample", "prompt"], Form()] = "audio_sample",
        audio_sample: Annotated[UploadFile | None, File()] = None,
        file: Annotated[UploadFile | None, File()] = None,  # the field name many clients use
        owner: str = owner_dep,
    ) -> JSONResponse:
        if type == "prompt":
            message = (
                "type 'prompt' (a voice designed from a description) is not supported: send an audio_sample"
            )
            raise ApiError(422, message, param="type", code="unsupported_voice_type")
        upload = audio_sample or file
        voice = await save_voice(ctx, VoiceForm(name, ref_text, consent), upload, owner)
        return JSONResponse(VoiceInfo.of(voice).model_dump(), status_code=201)

    @router.delete("/v1/audio/voices/{voice_id}")
    async def delete_voice(voice_id: str, owner: str = owner_dep) -> VoiceDeleted:
        await call(engine.delete_voice, voice_id, owner)
        return VoiceDeleted(id=voice_id)

    return router


async def call(fn: Any, *args: Any) -> Any:
    """The engine's voice methods may be coroutines or plain (then blocking: run in a worker thread)."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    return await anyio.to_thread.run_sync(fn, *args)


@dataclass(frozen=True)
class VoiceForm:
    """The text fields of a voice upload."""

    name: str
    ref_text: str
    consent: str


def check_form(ctx: ApiContext, form: VoiceForm, upload: UploadFile | None) -> UploadFile:
    if not form.name.strip() or len(form.name) > MAX_NAME_CHARS:
        raise ApiError(
            422, f"name must have 1-{MAX_NAME_CHARS} characters", param="name", code="invalid_name"
        )
    if not form.ref_text.strip() and not ctx.engine.asr_model:
        message = "ref_text (the transcript of the audio) is required: this server has no ASR to make it"
        raise ApiError(422, message, param="ref_text", code="missing_ref_text")
    check_fields({"ref_text": form.ref_text}, ctx.limits.max_text_chars)  # the contract's, as every text
    if upload is None:
        raise ApiError(422, "audio_sample (a file) is required", param="audio_sample", code="missing_audio")
    if upload.size is not None and upload.size > ctx.limits.max_upload_bytes:
        message = f"audio_sample is over the upload limit of {ctx.limits.max_upload_bytes} bytes"
        raise ApiError(413, message, param="audio_sample", code="upload_too_large")
    return upload


async def check_name_free(ctx: ApiContext, name: str, owner: str) -> None:
    for voice in map(VoiceInfo.of, await call(ctx.engine.list_voices, owner)):
        if voice.name.casefold() == name.casefold():
            message = f"a voice is already named {voice.name!r} (id {voice.id!r}): choose another name"
            raise ApiError(409, message, param="name", code="name_taken")


async def save_voice(ctx: ApiContext, form: VoiceForm, upload: UploadFile | None, owner: str) -> Any:
    upload = check_form(ctx, form, upload)
    await check_name_free(ctx, form.name.strip(), owner)  # before the costly decode (the library rechecks)
    data = await upload.read(ctx.limits.max_upload_bytes + 1)
    if len(data) > ctx.limits.max_upload_bytes:
        raise ApiError(
            413, "audio_sample is over the upload limit", param="audio_sample", code="upload_too_large"
        )
    prompt = await anyio.to_thread.run_sync(read_prompt, data, ctx, "audio_sample")  # validate first
    ref_text = form.ref_text.strip() or await transcribe_prompt(ctx.engine, prompt, "auto")
    suffix = os.path.splitext(upload.filename or "")[1][:8] or ".wav"
    with tempfile.TemporaryDirectory(prefix="cosystream-voice-") as tmp:
        path = os.path.join(tmp, f"prompt{suffix}")
        with open(path, "wb") as f:
            f.write(data)
        add = ctx.engine.add_voice
        try:
            return await call(add, form.name.strip(), path, ref_text, owner, form.consent.strip())
        except EngineError as err:
            mapped = from_engine(err, VOICE_PARAMS)
            mapped.param = mapped.param or "audio_sample"  # the engine's audio checks name no field
            raise mapped from err
