"""``WS /v1/audio/speech/realtime``: text in as it is written, audio out as it is spoken (bistream).

Message shapes follow OpenAI Realtime's event naming (JSON text frames, each with a ``type``):

client -> server
  ``session.update``          {"session": {voice | ref_audio + ref_text, mode, instructions, language,
                               response_format: "pcm" | "wav", sample_rate, seed}}; first, once
  ``input_text_buffer.append`` {"text": "..."}; any number, as the text is written
  ``input_text_buffer.commit`` {}: the text is complete
  ``response.cancel``          {}: stop now
server -> client
  ``session.updated``          {"session": {..., "id"}}: the request is open, send text
  ``response.audio.delta``     {"response_id", "delta": base64 of pcm s16le / wav bytes}
  ``response.audio.done``, then ``response.done`` {"response": {"id", "status", "metrics"}}
  ``error``                    {"error": {"message", "type", "param", "code", "event_id", "event_type"}}
                               (OpenAI's error body; ``event_id`` / ``event_type`` name the client event)

The API key (``Authorization: Bearer``) is checked at the handshake; a client that leaves aborts the
request. A client event the session cannot use (a binary frame, malformed JSON, an unknown type, a field of
the wrong type, a second ``session.update``) gets one ``error`` event and the session goes on as before; a
``session.update`` the server refuses can be sent again, fixed. A failure of the request itself becomes one
``error`` event, then the socket closes; the server keeps serving.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from api.auth import bearer_token, matching_key, owner_of
from api.context import ApiContext
from api.encode import StreamEncoder, stream_encoder
from api.errors import ApiError, from_engine
from api.lexicons import lexicon_pieces
from api.ops import check_model
from api.speech import SPEECH_PARAMS, check_length, check_ready, close, decode_audio_field
from engine.errors import EngineError
from engine.request import AudioChunk, Mode, SynthesisRequest

log = logging.getLogger(__name__)
PATH = "/v1/audio/speech/realtime"
_END = None  # queued after the last text piece


class BadEvent(ApiError):
    """A client event the session cannot use: one ``error`` event naming it, then the session goes on."""

    def __init__(
        self, message: str, *, code: str, param: str | None = None, event: Any = None, status: int = 400
    ):
        super().__init__(status, message, param=param, code=code)
        fields = event if isinstance(event, dict) else {}
        self.event_id = fields.get("event_id") if isinstance(fields.get("event_id"), str) else None
        self.event_type = fields.get("type") if isinstance(fields.get("type"), str) else None

    def body(self) -> dict[str, Any]:
        body = super().body()
        body["error"] |= {"event_id": self.event_id, "event_type": self.event_type}
        return body


class Outbox:
    """The session's socket for sending: one event at a time (the reader's error events and the audio
    events come from two tasks)."""

    def __init__(self, ws: WebSocket):
        self.ws, self.lock = ws, asyncio.Lock()

    async def send(self, kind: str, **fields: Any) -> None:
        async with self.lock:
            await send(self.ws, kind, **fields)

    async def error(self, err: ApiError) -> None:
        async with self.lock:
            await send(self.ws, "error", **err.body())


class Session(BaseModel):
    """``session.update``'s ``session``: the voice and output, as in ``POST /v1/audio/speech``."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    voice: str | None = None
    ref_audio: str | None = None
    ref_text: str = ""
    mode: Literal["zero_shot", "cross_lingual", "instruct"] | None = None
    instructions: str = ""
    language: str = "auto"
    response_format: Literal["pcm", "wav"] = "pcm"
    sample_rate: int = Field(24000, ge=8000, le=48000)
    seed: int | None = Field(None, ge=0, lt=2**63)
    lexicon: str | None = Field(None, max_length=64)  # a saved lexicon, applied as the text arrives

    def resolved_mode(self) -> Mode:
        if self.mode is not None:
            return Mode(self.mode)
        return Mode.INSTRUCT if self.instructions.strip() else Mode.ZERO_SHOT


def routes(ctx: ApiContext) -> APIRouter:
    router = APIRouter()

    @router.websocket(PATH)
    async def realtime(ws: WebSocket) -> None:
        await ws.accept()
        try:
            await serve(ctx, ws)
        except ApiError as err:
            await send_error(ws, err)
        except WebSocketDisconnect:
            log.info("realtime client left")
        except Exception:  # a bug: logged with its trace, the client gets a plain server error
            log.exception("realtime session failed")
            await send_error(ws, ApiError(500, "internal error", code="internal_error"))

    return router


async def serve(ctx: ApiContext, ws: WebSocket) -> None:
    owner = check_key(ctx, ws)
    out = Outbox(ws)
    session, req, text = await open_request(ctx, ws, out, owner)
    await out.send(
        "session.updated", session={**session.model_dump(exclude={"ref_audio"}), "id": req.request_id}
    )
    reader = asyncio.create_task(read_text(ws, out, text, ctx, req.request_id))
    try:
        await speak(ctx, out, req, session)
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
    await ws.close()


async def open_request(
    ctx: ApiContext, ws: WebSocket, out: Outbox, owner: str
) -> tuple[Session, SynthesisRequest, TextInput]:
    """Client events until a ``session.update`` opens a request. Each refused event gets its error event and
    the client may send a fixed one; a refused key, a server that is not ready or a fault end the socket."""
    while True:
        try:
            session = await first_session(ws)
            check_ready(ctx.engine)
            check_model(session.model, ctx.engine)
            text = TextInput()
            return session, await build_request(ctx, session, text.pieces(), owner), text
        except ApiError as err:
            if err.status_code >= 500 or err.status_code in (401, 429):
                raise
            await out.error(err)


def check_key(ctx: ApiContext, ws: WebSocket) -> str:
    """The caller's voice owner (as for the HTTP routes), or 401 without one of the server's keys."""
    if not ctx.api_keys:
        return owner_of(None)
    token = bearer_token(ws.headers.get("authorization"))
    key = matching_key(token, ctx.api_keys)
    if key is None:
        raise ApiError(401, "missing API key" if token is None else "invalid API key", code="invalid_api_key")
    return owner_of(key)


async def receive(ws: WebSocket) -> dict[str, Any]:
    """The next client event (a JSON object with a string ``type``); WebSocketDisconnect once it left."""
    message = await ws.receive()
    if message["type"] == "websocket.disconnect":
        raise WebSocketDisconnect(message.get("code", 1000), message.get("reason"))
    raw = message.get("text")
    if raw is None:
        raise BadEvent(
            "binary frames are not events: send each event as a JSON text frame", code="binary_frame"
        )
    try:
        event = json.loads(raw)
    except json.JSONDecodeError as err:
        raise BadEvent(
            f"the event is not JSON ({err.msg} at character {err.pos})", code="invalid_json"
        ) from err
    if not isinstance(event, dict) or not isinstance(event.get("type"), str):
        needs = "every event is a JSON object with a string 'type'"
        raise BadEvent(needs, param="type", code="invalid_event", event=event)
    return event


async def first_session(ws: WebSocket) -> Session:
    event = await receive(ws)
    if event["type"] != "session.update":
        message = f"the first event must be session.update, got {event['type']!r}"
        raise BadEvent(message, param="type", code="invalid_event", event=event)
    fields = event.get("session", {})
    if not isinstance(fields, dict):
        message = f"session must be an object, got {type(fields).__name__}"
        raise BadEvent(message, param="session", code="invalid_type", event=event, status=422)
    try:
        return Session.model_validate(fields)
    except ValidationError as err:
        first = err.errors()[0]
        param = "session." + ".".join(str(p) for p in first.get("loc", ()))
        raise BadEvent(
            f"{param}: {first.get('msg')}", param=param, code="invalid_value", event=event, status=422
        ) from err


async def build_request(
    ctx: ApiContext, session: Session, text: AsyncIterator[str], owner: str
) -> SynthesisRequest:
    for param in ("ref_text", "instructions"):
        check_length(getattr(session, param), f"session.{param}", ctx.limits.max_text_chars)
    mode = session.resolved_mode()
    if mode == Mode.ZERO_SHOT and session.ref_audio and not session.ref_text.strip():
        message = "zero-shot cloning needs ref_text, the transcript of ref_audio (or mode 'cross_lingual')"
        raise ApiError(422, message, param="session.ref_text", code="missing_ref_text")
    if mode == Mode.INSTRUCT and not session.instructions.strip():
        message = "mode 'instruct' needs instructions"
        raise ApiError(422, message, param="session.instructions", code="missing_instructions")
    prompt = await decode_audio_field(session.ref_audio, "ref_audio", ctx) if session.ref_audio else None
    text = await lexicon_pieces(ctx, session.lexicon, text, owner)
    return SynthesisRequest(
        mode=mode,
        prompt_audio=prompt,
        voice_id=None if prompt is not None else session.voice,
        voice_owner=owner,
        prompt_text=session.ref_text,
        instruct_text=session.instructions,
        language=session.language,
        seed=session.seed,
        text_stream=text,
    )


class TextInput:
    """The request's text as the client writes it: pieces, then the end (a commit, or the client gone)."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[str | None] = asyncio.Queue()
        self.ended = False

    def append(self, event: dict[str, Any]) -> None:
        piece = event.get("text")
        if not isinstance(piece, str):
            message = f"input_text_buffer.append needs a string 'text', got {type(piece).__name__}"
            raise BadEvent(message, param="text", code="invalid_type", event=event)
        if self.ended:
            raise BadEvent("the text is already committed", code="text_committed", event=event)
        self.queue.put_nowait(piece)

    def commit(self, event: dict[str, Any]) -> None:
        if self.ended:
            raise BadEvent("the text is already committed", code="text_committed", event=event)
        self.end()

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            self.queue.put_nowait(_END)

    async def pieces(self) -> AsyncIterator[str]:
        while (piece := await self.queue.get()) is not _END:
            yield piece


async def read_text(ws: WebSocket, out: Outbox, text: TextInput, ctx: ApiContext, request_id: str) -> None:
    """Client events -> the text; a bad event gets its error event and the reading goes on. Whatever ends
    the reading (the client left, the response is over) aborts the request: no more text can come."""
    try:
        while True:
            try:
                handle(await receive(ws), text, ctx, request_id)
            except BadEvent as err:
                await out.error(err)
    except WebSocketDisconnect:
        ctx.telemetry.disconnects.inc()
    finally:
        ctx.engine.abort(request_id)
        text.end()


def handle(event: dict[str, Any], text: TextInput, ctx: ApiContext, request_id: str) -> None:
    kind = event["type"]
    if kind == "input_text_buffer.append":
        text.append(event)
    elif kind == "input_text_buffer.commit":
        text.commit(event)
    elif kind == "response.cancel":
        ctx.engine.abort(request_id)
    elif kind == "session.update":
        message = (
            "the session is already open: its voice and format are set once, by the first session.update"
        )
        raise BadEvent(message, param="type", code="session_already_open", event=event)
    else:
        raise BadEvent(f"unknown event type {kind!r}", param="type", code="unknown_event", event=event)


async def speak(ctx: ApiContext, out: Outbox, req: SynthesisRequest, session: Session) -> None:
    """Engine chunks -> ``response.audio.delta`` events, then the done events with the final metrics."""
    encoder = Resampled(stream_encoder(session.response_format, ctx.engine.sample_rate), session.sample_rate)
    last: AudioChunk | None = None
    rid = req.request_id
    ctx.telemetry.api_streams.inc()
    stream = ctx.engine.stream(req)
    try:
        async for chunk in stream:
            if last is None:
                ctx.telemetry.first_audio(chunk.metrics)
            last = chunk
            if data := encoder.feed(chunk.pcm):
                await out.send("response.audio.delta", response_id=rid, delta=base64.b64encode(data).decode())
    except EngineError as err:
        raise from_engine(err, SPEECH_PARAMS) from err  # the session's fields are speech's
    finally:
        ctx.telemetry.api_streams.dec()
        await close(stream)  # a send that failed (the client left) frees the request now
    if tail := encoder.finish():
        await out.send("response.audio.delta", response_id=rid, delta=base64.b64encode(tail).decode())
    done = last is not None and last.is_last
    await out.send("response.audio.done", response_id=rid)
    metrics = asdict(last.metrics) if last is not None else None
    response = {"id": rid, "status": "completed" if done else "cancelled", "metrics": metrics}
    await out.send("response.done", response=response)


class Resampled:
    """The format's encoder fed at the client's sample rate (soxr's streaming resampler: no seams)."""

    def __init__(self, encoder: StreamEncoder, rate: int):
        import soxr

        self.encoder, source = encoder, encoder.sample_rate
        encoder.sample_rate = rate  # the wav header states the rate the client gets
        self.stream = None if rate == source else soxr.ResampleStream(source, rate, 1, dtype="float32")

    def feed(self, pcm: np.ndarray) -> bytes:
        if self.stream is not None:
            pcm = self.stream.resample_chunk(np.asarray(pcm, np.float32))
        return self.encoder.feed(pcm)

    def finish(self) -> bytes:
        tail = b""
        if self.stream is not None:
            tail = self.encoder.feed(self.stream.resample_chunk(np.zeros(0, np.float32), last=True))
        return tail + self.encoder.finish()


async def send(ws: WebSocket, kind: str, **fields: Any) -> None:
    await ws.send_text(json.dumps({"type": kind, **fields}))


async def send_error(ws: WebSocket, err: ApiError) -> None:
    """The error event, then close (1008 for a refused key, 1011 for a server fault, else 1000)."""
    with contextlib.suppress(WebSocketDisconnect, RuntimeError):  # the client may be gone already
        await send(ws, "error", **err.body())
        code = 1008 if err.status_code == 401 else (1011 if err.status_code >= 500 else 1000)
        await ws.close(code=code)
