"""The prompt lab's HTTP routes (``/lab``): its page, its takes, its code, its lexicons and its batches.

The lab is a page of its own (``webui/static/lab.js``), linked from the studio: several takes are fetched
at once, so the engine batches them, which Gradio's one-event-at-a-time listeners would not do. Every
route works in the browser's namespace: the page sends its id (``X-Cosy-Browser``, the studio's
localStorage id) and sees the public voices and lexicons and its own, as the studio does. A take is the
API's own code path (``api.speech.speak``) with that owner, so its audio is what the copied code gets.

- ``GET /lab``: the page (``?lang=zh|en``; else the browser's language)
- ``GET /lab/config``: model, voices, lexicons, presets and the limits the page must respect
- ``POST /lab/speech``: one take (a ``/v1/audio/speech`` body), wav with the metric headers
- ``POST /lab/code``: curl / Python / realtime code for a take's settings
- ``/lab/lexicons``: the lexicon routes of ``api.lexicons`` for this browser
- ``POST /lab/batch``: a text or CSV file rendered line by line; NDJSON progress, then a zip's address
  (``GET /lab/batch/{token}.zip``: the wavs and ``manifest.json`` / ``manifest.csv``); leaving the
  response cancels the batch
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
import logging
import re
import secrets
import tempfile
import time
import zipfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Depends, File, Form, Header, Request, Response, UploadFile
from fastapi.responses import FileResponse, HTMLResponse, StreamingResponse

from api.context import ApiContext
from api.encode import encode_audio
from api.errors import ApiError, from_engine
from api.lexicons import routes as lexicon_routes
from api.route import guarded_route
from api.schemas import SpeechRequest
from api.speech import SPEECH_PARAMS, body_cap, build_request, close, next_chunk, open_stream, speak
from api.voices import call
from engine.errors import EngineError
from engine.lexicons import LexiconLibrary
from engine.text.frontend import FAMILIES, instruct_presets
from webui import lab_views
from webui.lab import MAX_BATCH_BYTES, MAX_TAKES, BatchError, BatchLine, TakeSettings, code_for, parse_batch
from webui.stream_route import browser_owner as studio_owner

log = logging.getLogger(__name__)

TOKEN = re.compile(r"^[0-9a-f]{32}$")


def browser_owner(x_cosy_browser: Annotated[str | None, Header()] = None) -> str:
    """The caller's namespace: the studio's browser id, as the studio's own voice events use it."""
    owner = studio_owner(x_cosy_browser)
    if owner is None:
        raise ApiError(
            400, "the lab needs the browser's id (X-Cosy-Browser: 32 hex digits)", code="no_browser_id"
        )
    return owner


class BatchFiles:
    """Finished batch zips in one temporary folder (made at the first batch), by random token; the oldest
    go past ``keep``."""

    def __init__(self, keep: int = 32):
        self.keep = keep
        self.root: Path | None = None

    def new(self) -> tuple[str, Path]:
        if self.root is None:
            self.root = Path(tempfile.mkdtemp(prefix="cosystream-lab-"))
        files = sorted(self.root.glob("*.zip"), key=lambda p: p.stat().st_mtime)
        for old in files[: max(0, len(files) - self.keep + 1)]:
            old.unlink(missing_ok=True)
        token = secrets.token_hex(16)
        return token, self.root / f"{token}.zip"

    def path(self, token: str) -> Path | None:
        if self.root is None or not TOKEN.match(token):
            return None
        path = self.root / f"{token}.zip"
        return path if path.is_file() else None


def router(
    ctx: ApiContext,
    signed_in: Callable[[Request], bool] | None = None,
    account: Callable[[Request], str | None] | None = None,
) -> APIRouter:
    """``signed_in``/``account`` (with a login): whether a request carries the studio's session, and the
    namespace of its key (the studio's voices after signing in are the key's: the lab uses the same)."""

    def session(request: Request) -> None:
        if signed_in is not None and not signed_in(request):
            raise ApiError(401, "sign in to the studio first", code="not_signed_in")

    def caller(request: Request, x_cosy_browser: Annotated[str | None, Header()] = None) -> str:
        signed = account(request) if account is not None else None
        return signed if signed is not None else browser_owner(x_cosy_browser)

    owner_dep = Depends(caller)
    files = BatchFiles()
    routes = APIRouter(
        prefix="/lab",
        route_class=guarded_route(ctx.telemetry, body_cap(ctx)),
        dependencies=[Depends(session)],
    )

    @routes.get("", response_class=HTMLResponse)
    async def page(request: Request, lang: str | None = None) -> HTMLResponse:
        chosen = (
            lang if lang in ("zh", "en") else lab_views.language(request.headers.get("accept-language", ""))
        )
        return HTMLResponse(lab_views.page_html(chosen), headers={"Cache-Control": "no-store"})

    @routes.get("/config")
    async def config(owner: str = owner_dep) -> dict[str, Any]:
        return await lab_config(ctx, owner)

    @routes.post("/speech", response_model=None)
    async def take(body: SpeechRequest, request: Request, owner: str = owner_dep) -> Response:
        return await speak(ctx, body, request, owner)

    @routes.post("/code")
    async def code(request: Request, owner: str = owner_dep) -> dict[str, Any]:
        try:
            data = await request.json()
            settings = TakeSettings.of(data if isinstance(data, dict) else {})
        except (ValueError, TypeError) as err:
            raise ApiError(422, str(err), code="invalid_value") from err
        private = await is_private_voice(ctx, settings.voice, owner)
        base = str(request.base_url).rstrip("/")
        private_lexicon = settings.lexicon is not None and await is_private_lexicon(
            ctx, settings.lexicon, owner
        )
        snippets = code_for(settings, base, str(ctx.engine.model_name), private, private_lexicon)
        return {
            "curl": snippets.curl,
            "python": snippets.python,
            "realtime": snippets.realtime,
            "notes": snippets.notes,
        }

    @routes.post("/batch")
    async def batch(
        file: Annotated[UploadFile, File()],
        settings: Annotated[str, Form()],
        owner: str = owner_dep,
    ) -> StreamingResponse:
        data = await file.read(MAX_BATCH_BYTES + 1)
        try:
            lines = parse_batch(file.filename or "lines.txt", data, ctx.limits.max_text_chars)
            base = TakeSettings.of({**json.loads(settings), "input": ""})
        except BatchError as err:
            raise ApiError(413 if err.too_large else 422, str(err), param="file", code="bad_batch") from err
        except (ValueError, TypeError) as err:
            raise ApiError(422, f"settings: {err}", param="settings", code="invalid_value") from err
        token, path = files.new()
        events = render_batch(ctx, lines, base, owner, path, f"/lab/batch/{token}.zip")
        return StreamingResponse(
            events, media_type="application/x-ndjson", headers={"Cache-Control": "no-store"}
        )

    @routes.get("/batch/{name}")
    async def batch_zip(name: str) -> FileResponse:
        path = files.path(name.removesuffix(".zip"))
        if path is None:
            raise ApiError(
                404, f"no batch {name!r} on this server (they are kept for a while only)", code="not_found"
            )
        return FileResponse(path, media_type="application/zip", filename=f"cosystream-batch-{name[:8]}.zip")

    routes.include_router(lexicon_routes(ctx, prefix="/lexicons", owner=owner_dep))
    return routes


async def lab_config(ctx: ApiContext, owner: str) -> dict[str, Any]:
    engine = ctx.engine
    voices = [
        {
            "id": str(v.id),
            "name": str(v.name),
            "public": bool(v.public),
            "example": bool(getattr(v, "example", False)),
        }
        for v in await call(engine.list_voices, owner)
        if getattr(v, "compatible", True)
    ]
    store = getattr(engine, "lexicons", None)
    lexicons = [x.summary() for x in store.list(owner)] if isinstance(store, LexiconLibrary) else []
    family = str(engine.family)
    presets = (
        [{"label": p.label, "instruct": p.instruct} for p in instruct_presets(family)]
        if family in FAMILIES
        else []
    )
    return {
        "model": str(engine.model_name),
        "family": str(engine.family),
        "sample_rate": int(engine.sample_rate),
        "voices": voices,
        "lexicons": lexicons,
        "presets": presets,
        "limits": {"max_takes": MAX_TAKES, "max_text_chars": ctx.limits.max_text_chars},
        # one speech LM per server (--llm-variant base | rl): shown and exported, not picked per take
        "llm_variant": str(getattr(getattr(engine, "cfg", None), "llm_variant", "") or ""),
    }


async def is_private_lexicon(ctx: ApiContext, lexicon: str, owner: str) -> bool:
    store = getattr(ctx.engine, "lexicons", None)
    if not isinstance(store, LexiconLibrary):
        return False
    found = [x for x in await asyncio.to_thread(store.list, owner) if lexicon in (x.id, x.name)]
    return any(not x.public for x in found)


async def is_private_voice(ctx: ApiContext, voice: str, owner: str) -> bool:
    for v in await call(ctx.engine.list_voices, owner):
        if str(v.id) == voice:
            return not bool(v.public)
    return False


# ---------------------------------------------------------------------------------------------- batch


async def render_batch(
    ctx: ApiContext, lines: list[BatchLine], base: TakeSettings, owner: str, path: Path, url: str
) -> AsyncIterator[bytes]:
    """NDJSON: ``start`` (total, the lines refused up front), one ``line`` per line, then ``done`` with the
    zip's address. Lines render one after another (a batch never takes more than one of the engine's
    slots); a failing line is reported and the next one goes on."""
    yield event({"type": "start", "total": len(lines), "errors": [bad(x) for x in lines if x.error]})
    rows: list[dict[str, Any]] = []
    written = 0
    partial = path.with_suffix(".part")  # on disk as it grows (a batch may hold minutes of audio)
    try:
        with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as zf:
            for line in lines:
                row = await render_line(ctx, line, base, owner, zf)
                rows.append(row)
                written += not row["error"]
                yield event({"type": "line", **row})
            zf.writestr("manifest.json", json.dumps(rows, ensure_ascii=False, indent=1))
            zf.writestr("manifest.csv", manifest_csv(rows))
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)  # cancelled (the client left) or failed: no zip
    yield event({"type": "done", "rendered": written, "failed": len(rows) - written, "zip": url})


def bad(line: BatchLine) -> dict[str, Any]:
    return {"line": line.number, "error": line.error}


def event(payload: dict[str, Any]) -> bytes:
    return (json.dumps(payload, ensure_ascii=False) + "\n").encode()


async def render_line(
    ctx: ApiContext, line: BatchLine, base: TakeSettings, owner: str, zf: zipfile.ZipFile
) -> dict[str, Any]:
    settings = TakeSettings(
        line.text, line.voice or base.voice, "instruct" if line.instruct else base.mode,
        line.instruct or base.instructions, base.seed, base.speed, base.language, base.lexicon,
    )  # fmt: skip
    row: dict[str, Any] = {"line": line.number, "file": "", "error": line.error, **settings.body()}
    if line.error:
        return row
    started = time.monotonic()
    try:
        pcm, headers = await synthesize(ctx, settings, owner)
    except ApiError as err:
        return row | {"error": err.message}
    name = f"{line.number:04d}.wav"
    zf.writestr(name, await asyncio.to_thread(encode_audio, pcm, ctx.engine.sample_rate, "wav"))
    return row | {"file": name, "seconds": round(len(pcm) / ctx.engine.sample_rate, 3), **headers,
                  "elapsed_s": round(time.monotonic() - started, 3)}  # fmt: skip


async def synthesize(
    ctx: ApiContext, settings: TakeSettings, owner: str
) -> tuple[np.ndarray, dict[str, Any]]:
    """One whole take through the API's request building (lexicon included); ApiError on any refusal."""
    from api.lexicons import apply_lexicon

    try:
        body = SpeechRequest.model_validate(settings.body())
        applied = await apply_lexicon(ctx, body.lexicon, body.input, owner)
        if applied is not None:
            body = body.model_copy(update={"input": applied.text})
        req = await build_request(ctx, body, owner)
        gen, first = await open_stream(ctx.engine, req)
    except EngineError as err:
        raise from_engine(err, SPEECH_PARAMS) from err
    except ValueError as err:  # pydantic's ValidationError is one
        raise ApiError(422, str(err).splitlines()[0], code="invalid_value") from err
    pieces, last = [first.pcm], first
    try:
        while (chunk := await next_chunk(gen)) is not None:
            pieces.append(chunk.pcm)
            last = chunk
    except EngineError as err:
        raise from_engine(err, SPEECH_PARAMS) from err
    finally:
        await close(gen)
    return np.concatenate(pieces), {"seed": last.metrics.seed, "applied": applied.counts() if applied else {}}


def manifest_csv(rows: list[dict[str, Any]]) -> str:
    out = io.StringIO()
    keys = list(dict.fromkeys(k for row in rows for k in row))
    writer = csv.DictWriter(out, keys, extrasaction="ignore")
    writer.writeheader()
    for row in rows:
        writer.writerow(
            {k: json.dumps(v, ensure_ascii=False) if isinstance(v, dict) else v for k, v in row.items()}
        )
    return out.getvalue()
