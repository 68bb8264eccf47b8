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
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from api.auth import bearer_token, matching_key, owner_of
from api.context import ApiContext
from api.contract import check_fields, check_piece
from api.encode import StreamEncoder, stream_encoder
from api.errors import ApiError, from_engine
from api.lexicons import lexicon_pieces
from api.ops import check_model
from api.schemas import VoiceRef
from api.speech import SPEECH_PARAMS, check_ready, close, decode_audio_field
from engine.errors import EngineError
from engine.request import AudioChunk, Mode, SynthesisRequest
from engine.text.checks import speakable
from engine.text.script import cut_at_breaks

log = logging.getLogger(__name__)
PATH = "/v1/audio/speech/realtime"
_END = None  # queued after the last text piece
# SynthesisRequest field -> the event field at fault: the appended text, or the session's own fields
REALTIME_PARAMS = {field: "text" if p == "input" else f"session.{p}" for field, p in SPEECH_PARAMS.items()}


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
    voice: str | VoiceRef | None = None  # a saved voice id, or OpenAI's object form {"id": ...}
    ref_audio: str | None = None
    ref_text: str = ""
    mode: Literal["zero_shot", "cross_lingual", "instruct"] | None = None
    instructions: str = ""
    language: str = "auto"
    response_format: Literal["pcm", "wav"] = "pcm"
    sample_rate: int = Field(24000, ge=8000, le=48000)
    seed: int | None = Field(None, ge=0, lt=2**63)
    lexicon: str | None = Field(None, max_length=64)  # a saved lexicon, applied as the text arrives

    def voice_id(self) -> str | None:
        return self.voice.id if isinstance(self.voice, VoiceRef) else self.voice

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
        await speak(ctx, out, req, session, text)
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
            text = TextInput(ctx.limits.max_text_chars, ctx.engine.family, ctx.limits.text_idle_s)
            return session, await build_request(ctx, session, text.segment(), owner), text
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
    texts = {f"session.{p}": getattr(session, p) for p in ("ref_text", "instructions")}
    check_fields(texts, ctx.limits.max_text_chars)
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
        voice_id=None if prompt is not None else session.voice_id(),
        voice_owner=owner,
        prompt_text=session.ref_text,
        instruct_text=session.instructions,
        language=session.language,
        seed=session.seed,
        text_stream=text,
    )


@dataclass(frozen=True)
class Silence:
    """A ``<break/>`` in the streamed text: this much exact silence between the speech around it."""

    seconds: float


_Item = str | Silence | None  # a piece of text, a break, or the end (None)


class TextInput:
    """The request's text as the client writes it: pieces and breaks, then the end (a commit, or the client
    gone). The text between two breaks is one segment: one engine request each (``speak``).

    Every piece is checked as it comes (the contract's characters: a refused piece is one error event,
    the text goes on without it), and the text so far against the limit and the supported markup: a text
    over ``max_chars`` or with markup the server does not support fails the request at once (``failure``),
    before its audio, as does a committed text with nothing to say. Text after an unclosed ``<`` is held
    back until its ``>`` (it may be a break)."""

    def __init__(self, max_chars: int, family: str, idle_s: float = 30.0) -> None:
        self.queue: asyncio.Queue[_Item] = asyncio.Queue()
        self.ended = self.cancelled = False
        self.max_chars, self.family, self.idle_s = max_chars, family, idle_s
        self.text = ""  # every accepted piece so far
        self.held = ""  # the tail after an unclosed "<"
        self.back: list[_Item] = []  # an item a segment read but did not take (its end)
        self.silence: list[float] = []  # breaks read before the next segment's speech, not yet sent
        self.failure: ApiError | None = None

    def append(self, event: dict[str, Any]) -> None:
        piece = event.get("text")
        if not isinstance(piece, str):
            message = f"input_text_buffer.append needs a string 'text', got {type(piece).__name__}"
            raise BadEvent(message, param="text", code="invalid_type", event=event)
        if self.ended:
            raise BadEvent("the text is already committed", code="text_committed", event=event)
        refused = check_piece(piece, "text", self.max_chars)
        if refused is not None and refused.status_code != 413:
            raise BadEvent(refused.message, param="text", code=refused.code, event=event, status=422)
        self.text += piece
        self.check_text(complete=False)
        self.release(self.held + piece)

    def release(self, text: str, final: bool = False) -> None:
        """Queue ``text``'s pieces and breaks, holding back a tail that opens a ``<`` it does not close."""
        opened = text.rfind("<")
        self.held = "" if final or opened < 0 or ">" in text[opened:] else text[opened:]
        for part in cut_at_breaks(text[: len(text) - len(self.held)]):
            self.queue.put_nowait(part if isinstance(part, str) else Silence(part.seconds))

    def commit(self, event: dict[str, Any]) -> None:
        if self.ended:
            raise BadEvent("the text is already committed", code="text_committed", event=event)
        self.check_text(complete=True)
        self.release(self.held, final=True)
        self.end()

    def check_text(self, complete: bool) -> None:
        """The text so far: its length and the markup closed so far (breaks within their limits); once
        complete, that it says something. A refusal here ends the request (``Fatal``)."""
        try:
            fields, family = {"text": self.text}, self.family or None
            check_fields(fields, self.max_chars, spoken="text", family=family, partial=not complete)
        except ApiError as err:
            raise Fatal(err) from None

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            self.queue.put_nowait(_END)

    def cancel(self) -> None:
        self.cancelled = True
        self.end()

    async def next(self, timed: bool = False) -> _Item:
        """The next item; ``timed``: between two segments, where no engine request waits for the text with
        its own idle timeout."""
        if self.back:
            return self.back.pop()
        try:
            async with asyncio.timeout(self.idle_s if timed else None):
                return await self.queue.get()
        except TimeoutError:
            message = f"no text arrived for {self.idle_s:g} s"
            raise ApiError(408, message, param="text", code="text_idle") from None

    async def first_words(self, timed: bool = False) -> str | None:
        """The next segment's text up to its first piece with something to say (None: the text ended
        first). Breaks before it are kept in ``silence``; text with nothing to say before a break is
        dropped (the engine would have nothing to speak)."""
        held = ""
        while (item := await self.next(timed)) is not _END:
            if isinstance(item, Silence):
                self.silence.append(item.seconds)
                held = ""
            elif speakable(held + item, self.family or None):
                return held + item
            else:
                held += item
        self.back.append(_END)
        return None

    async def segment(self, first: str | None = None) -> AsyncIterator[str]:
        """One segment's pieces: from its first words to the next break or the end (left for the next)."""
        first = first if first is not None else await self.first_words()
        if first is None:
            return
        yield first
        while isinstance(item := await self.next(), str):
            yield item
        self.back.append(item)

    async def at_end(self) -> bool:
        item = await self.next()
        self.back.append(item)
        return item is _END


class Fatal(Exception):
    """A client event that ends the request: its ``error`` is sent, then the socket closes."""

    def __init__(self, error: ApiError):
        super().__init__(error.message)
        self.error = error


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
    except Fatal as fatal:  # the speaking task sends it, once the aborted stream has ended
        text.failure = fatal.error
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
        text.cancel()  # no segment after this one
        ctx.engine.abort(request_id)
    elif kind == "session.update":
        message = (
            "the session is already open: its voice and format are set once, by the first session.update"
        )
        raise BadEvent(message, param="type", code="session_already_open", event=event)
    else:
        raise BadEvent(f"unknown event type {kind!r}", param="type", code="unknown_event", event=event)


async def speak(
    ctx: ApiContext, out: Outbox, req: SynthesisRequest, session: Session, text: TextInput
) -> None:
    """Engine chunks -> ``response.audio.delta`` events, then the done events with the final metrics. Each
    segment of the text (between two breaks) is one engine request under the session's id, one after
    another; the breaks are exact silence between them. The first opens at once (the voice's prompt is
    ready when the text starts), the others once their first words arrive."""
    encoder = Resampled(stream_encoder(session.response_format, ctx.engine.sample_rate), session.sample_rate)
    rid, rate = req.request_id, ctx.engine.sample_rate
    said = Said()

    async def deliver(pcm: np.ndarray) -> None:
        for seconds in text.silence:  # the breaks before this audio
            await deliver_pcm(np.zeros(round(seconds * rate), np.float32))
        text.silence.clear()
        await deliver_pcm(pcm)

    async def deliver_pcm(pcm: np.ndarray) -> None:
        said.audio_s += len(pcm) / rate
        if data := encoder.feed(pcm):
            await out.send("response.audio.delta", response_id=rid, delta=base64.b64encode(data).decode())

    pieces = req.text_stream  # the first segment's (build_request)
    finished = False  # every segment spoken to its end
    ctx.telemetry.api_streams.inc()
    try:
        while pieces is not None and not text.cancelled:
            last = await speak_segment(ctx, replace(req, text_stream=pieces), deliver, said, text)
            if last is None or not last.is_last:
                break
            first = None if await text.at_end() else await text.first_words(timed=True)
            pieces, finished = (None, True) if first is None else (text.segment(first), False)
        if text.failure is not None:  # refused between two segments
            raise text.failure
        await deliver(np.zeros(0, np.float32))  # trailing breaks
    finally:
        ctx.telemetry.api_streams.dec()
    if tail := encoder.finish():
        await out.send("response.audio.delta", response_id=rid, delta=base64.b64encode(tail).decode())
    await out.send("response.audio.done", response_id=rid)
    status = "completed" if finished else "cancelled"
    await out.send("response.done", response={"id": rid, "status": status, "metrics": said.metrics()})


class Said:
    """What the segments said so far: the last chunk, the text and speech tokens, the seconds sent."""

    def __init__(self) -> None:
        self.last: AudioChunk | None = None
        self.text_tokens = self.lm_tokens = 0
        self.audio_s = 0.0

    def ended(self, last: AudioChunk) -> None:
        self.last = last
        self.text_tokens += last.metrics.text_tokens
        self.lm_tokens += last.metrics.lm_tokens

    def metrics(self) -> dict[str, Any] | None:
        if self.last is None:
            return None
        totals = {"text_tokens": self.text_tokens, "lm_tokens": self.lm_tokens, "audio_s": self.audio_s}
        return asdict(self.last.metrics) | totals


async def speak_segment(
    ctx: ApiContext,
    req: SynthesisRequest,
    deliver: Callable[[np.ndarray], Awaitable[None]],
    said: Said,
    text: TextInput,
) -> AudioChunk | None:
    """One segment's engine request, its audio delivered as it comes -> its last chunk (None: no audio)."""
    last: AudioChunk | None = None
    stream = ctx.engine.stream(req)
    try:
        async for chunk in stream:
            if said.last is None and last is None:
                ctx.telemetry.first_audio(chunk.metrics)
            last = chunk
            await deliver(chunk.pcm)
    except EngineError as err:
        raise text.failure or from_engine(err, REALTIME_PARAMS) from err
    finally:
        await close(stream)  # a send that failed (the client left) frees the request now
    if text.failure is not None:
        raise text.failure
    if last is not None:
        said.ended(last)
    return last


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
