"""Operations routes: ``/health`` (liveness), ``/ready`` (model loaded and warm), ``/metrics``
(Prometheus), and OpenAI's ``/v1/models``. Probes and ``/metrics`` need no API key; ``/v1/models`` does."""

from __future__ import annotations

import os
import time

from fastapi import APIRouter, Depends, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from api.auth import require_key
from api.context import ApiContext, EngineLike
from api.errors import ApiError, retry_after
from api.route import guarded_route
from api.schemas import ModelCard, ModelList
from engine.errors import shown

# Accepted as the served model: OpenAI's TTS names (stock clients work unchanged) and "cosyvoice", the
# README's name for whichever model this server runs (v2 or v3).
MODEL_ALIASES = ("cosyvoice", "tts-1", "tts-1-hd", "gpt-4o-mini-tts")
# Accepted by the transcription route for the server's Whisper: OpenAI's transcription names.
ASR_ALIASES = ("whisper-1", "gpt-4o-transcribe", "gpt-4o-mini-transcribe")
PROBE_BODY_CAP = 64 * 1024
READY_RETRY_S = 5.0


def model_ids(engine: EngineLike) -> list[str]:
    """Names that select the loaded model: its id or path, that path's last part, its family."""
    names = [engine.model_name, os.path.basename(engine.model_name.rstrip("/")), engine.family]
    return list(dict.fromkeys(n for n in names if n))


def speech_ids(engine: EngineLike) -> list[str]:
    """Every ``model`` the speech route accepts."""
    return list(dict.fromkeys([*model_ids(engine), *MODEL_ALIASES]))


def transcription_ids(engine: EngineLike) -> list[str]:
    """Every ``model`` the transcription route accepts: none when transcription is off."""
    served = engine.asr_model
    if not served:
        return []
    names = [*ASR_ALIASES, served, os.path.basename(served.rstrip("/"))]
    return list(dict.fromkeys(names))


def check_model(name: str | None, engine: EngineLike) -> None:
    """One model per server: any of its names (or an OpenAI TTS alias) is fine; anything else is a 404."""
    if not name or name in model_ids(engine) or name in MODEL_ALIASES:
        return
    known = ", ".join(dict.fromkeys([*model_ids(engine), *MODEL_ALIASES]))  # OpenAI's names too
    raise ApiError(
        404, f"model {shown(name)} is not served here; use {known}", param="model", code="model_not_found"
    )


def model_cards(engine: EngineLike, started: int) -> list[ModelCard]:
    """One card per accepted id (``started``: unix seconds the API came up, OpenAI's ``created``)."""
    ready = bool(engine.ready)
    speech = [
        ModelCard(
            id=name,
            created=started,
            kind="speech",
            root=engine.model_name,
            ready=ready,
            family=engine.family,
            sample_rate=engine.sample_rate,
        )
        for name in speech_ids(engine)
    ]
    asr = str(engine.asr_model or "")
    transcription = [
        ModelCard(id=name, created=started, kind="transcription", root=asr, ready=ready)
        for name in transcription_ids(engine)
    ]
    return speech + transcription


def routes(ctx: ApiContext) -> APIRouter:
    router = APIRouter(route_class=guarded_route(ctx.telemetry, PROBE_BODY_CAP))
    engine, started = ctx.engine, int(time.time())
    auth = [Depends(require_key(ctx.api_keys))]

    @router.get("/health")
    async def health() -> dict[str, str]:
        if not engine.healthy:  # a dead LM backend or vocoder worker: liveness fails, so it gets restarted
            raise ApiError(503, "the speech engine has stopped; restart the server", code="unhealthy")
        return {"status": "ok"}

    @router.get("/ready", response_model=None)
    async def ready() -> JSONResponse:
        if not engine.healthy:  # the server exits for its supervisor (server.shutdown): route traffic away
            message = (
                "the speech engine has stopped (its LM backend or vocoder worker died); it is restarting"
            )
            raise ApiError(503, message, code="unhealthy", headers=retry_after(READY_RETRY_S))
        if not engine.ready:
            message = "the model is still loading or warming up"
            raise ApiError(503, message, code="not_ready", headers=retry_after(READY_RETRY_S))
        body = {"status": "ready", "model": engine.model_name, "family": engine.family}
        timeline = getattr(engine, "startup", None)  # the start-up's phases (engine.serving.startup.Timeline)
        if timeline is not None:  # stage: warming (first audio may be slower) until no start-up work is left
            body |= {"stage": timeline.stage(), "startup": timeline.as_dict()}
        lm_backend = getattr(engine, "lm_backend", None)  # the one new requests go to (native, then vllm)
        if lm_backend is not None:
            body["lm_backend"] = lm_backend
        return JSONResponse(body)

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.telemetry.exposition(), media_type=CONTENT_TYPE_LATEST)

    @router.get("/v1/models", dependencies=auth)
    async def list_models() -> ModelList:
        return ModelList(data=model_cards(engine, started))

    @router.get("/v1/models/{model_id:path}", dependencies=auth)
    async def get_model(model_id: str) -> ModelCard:
        for card in model_cards(engine, started):
            if card.id == model_id:  # the first: a speech id wins where the two lists share a name
                return card
        if not engine.ready:  # the loading server does not know yet what it will serve (its Whisper)
            message = "the model is still loading or warming up; retry shortly"
            raise ApiError(503, message, code="not_ready", headers=retry_after(READY_RETRY_S))
        known = ", ".join(card.id for card in model_cards(engine, started))
        message = f"model {shown(model_id)} is not served here; this server has {known}"
        raise ApiError(404, message, param="model", code="model_not_found")

    return router
