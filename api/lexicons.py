"""``/v1/audio/lexicons``: pronunciation lexicons per caller, and their use by name in the speech routes.

A lexicon is a named list of ``{word, hint, kind?, match_case?}`` entries (``engine.lexicons``: pinyin with
tones, CMU ARPAbet phones, the bracketed tokens, or a respelling). Like saved voices, each API key is its
own namespace: a caller lists the operator's public lexicons and their own, and changes only their own.

- ``GET /v1/audio/lexicons``: the summaries; ``GET /v1/audio/lexicons/{id}``: one with its entries
- ``POST /v1/audio/lexicons`` ``{name, entries}``: create (201; a name the caller has is a 409)
- ``PUT /v1/audio/lexicons/{id}`` ``{name?, entries}``: replace the caller's own
- ``DELETE /v1/audio/lexicons/{id}``
- ``POST /v1/audio/lexicons/apply`` ``{input, lexicon | entries}``: the rewritten text and every place an
  entry was applied, without synthesising (what the studio shows)

``POST /v1/audio/speech`` takes ``lexicon`` (a name or id): its entries are applied to ``input`` before
synthesis and the response's ``X-Lexicon-Applied`` header counts each applied word (JSON, ASCII-escaped).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anyio
from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from api.auth import require_key
from api.context import ApiContext
from api.errors import ApiError, from_engine
from api.route import guarded_route
from engine.errors import EngineError
from engine.lexicons import MAX_ENTRIES, Applied, Lexicon, LexiconLibrary, StreamApplier, make_entries

BODY_CAP = MAX_ENTRIES * 2048 + 64 * 1024  # entries of at most ~600 characters, JSON-escaped
HEADER = "X-Lexicon-Applied"


class EntryBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    word: StrictStr
    hint: StrictStr
    kind: StrictStr = "auto"
    match_case: StrictBool = False


class LexiconBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: StrictStr | None = None  # PUT keeps the stored name when it is left out
    entries: list[EntryBody] = Field(max_length=MAX_ENTRIES)


class ApplyBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input: StrictStr
    lexicon: StrictStr | None = None
    entries: list[EntryBody] | None = Field(None, max_length=MAX_ENTRIES)


def library(ctx: ApiContext) -> LexiconLibrary:
    store = getattr(ctx.engine, "lexicons", None)
    if not isinstance(store, LexiconLibrary):
        raise ApiError(
            501, "this server keeps no pronunciation lexicons", param="lexicon", code="no_lexicons"
        )
    return store


def as_json(lexicon: Lexicon, entries: bool = True) -> dict[str, Any]:
    body: dict[str, Any] = {
        "object": "audio.lexicon",
        **lexicon.summary(),
        "updated_at": int(lexicon.updated_at),
    }
    if entries:
        body["entries"] = [{**e.as_json(), "say": e.say} for e in lexicon.entries]
    return body


def applied_json(applied: Applied) -> dict[str, Any]:
    hits = [
        {"word": h.word, "matched": h.matched, "say": h.say, "start": h.start, "end": h.end}
        for h in applied.hits
    ]
    return {"object": "audio.lexicon.applied", "text": applied.text, "hits": hits, "counts": applied.counts()}


async def run(fn: Any, *args: Any) -> Any:
    """A library call in a worker thread (it reads and writes files), engine errors as API errors."""
    try:
        return await anyio.to_thread.run_sync(fn, *args)
    except EngineError as err:
        raise from_engine(err) from err


async def apply_lexicon(ctx: ApiContext, name: str | None, text: str, owner: str | None) -> Applied | None:
    """``text`` with the caller's lexicon ``name`` applied; None when no lexicon was asked for."""
    if name is None or not name.strip():
        return None
    lexicon: Lexicon = await run(library(ctx).get, name, owner)
    return lexicon.apply(text)


async def lexicon_pieces(
    ctx: ApiContext, name: str | None, pieces: AsyncIterator[str], owner: str | None
) -> AsyncIterator[str]:
    """Text arriving in pieces with the lexicon ``name`` applied as it goes (``StreamApplier``); the lexicon
    is looked up now, so an unknown name is refused before any text is read."""
    if name is None or not name.strip():
        return pieces
    applier = StreamApplier(await run(library(ctx).get, name, owner))

    async def applied() -> AsyncIterator[str]:
        async for piece in pieces:
            if text := applier.feed(piece):
                yield text
        if rest := applier.end():
            yield rest

    return applied()


def applied_header(applied: Applied | None) -> dict[str, str]:
    return {HEADER: json.dumps(applied.counts(), separators=(",", ":"))} if applied is not None else {}


def routes(ctx: ApiContext, prefix: str = "/v1/audio/lexicons", owner: Any = None) -> APIRouter:
    """The lexicon routes under ``prefix``; ``owner``: the dependency that answers whose lexicons (the API
    key's by default; the studio's lab passes its browser id's)."""
    router = APIRouter(prefix=prefix, route_class=guarded_route(ctx.telemetry, BODY_CAP))
    owner_dep = owner if owner is not None else Depends(require_key(ctx.api_keys))

    @router.get("")
    async def list_lexicons(owner: str = owner_dep) -> dict[str, Any]:
        found = await run(library(ctx).list, owner)
        return {"object": "list", "data": [as_json(x, entries=False) for x in found]}

    @router.get("/{lexicon_id}")
    async def get_lexicon(lexicon_id: str, owner: str = owner_dep) -> dict[str, Any]:
        return as_json(await run(library(ctx).get, lexicon_id, owner))

    @router.post("", status_code=201)
    async def create_lexicon(body: LexiconBody, owner: str = owner_dep) -> dict[str, Any]:
        if body.name is None:
            raise ApiError(422, "name is required", param="name", code="missing_name")
        entries = [e.model_dump() for e in body.entries]
        return as_json(await run(library(ctx).save, body.name, entries, owner, False))

    @router.put("/{lexicon_id}")
    async def replace_lexicon(lexicon_id: str, body: LexiconBody, owner: str = owner_dep) -> dict[str, Any]:
        store = library(ctx)
        current: Lexicon = await run(store.get, lexicon_id, owner)
        if current.public:
            raise ApiError(
                403, f"lexicon {lexicon_id!r} is public: only the operator can change it", code="forbidden"
            )
        entries = [e.model_dump() for e in body.entries]
        saved: Lexicon = await run(store.save, body.name or current.name, entries, owner, True)
        if saved.id != current.id:  # renamed: the old file goes
            await run(store.delete, current.id, owner)
        return as_json(saved)

    @router.delete("/{lexicon_id}")
    async def delete_lexicon(lexicon_id: str, owner: str = owner_dep) -> dict[str, Any]:
        await run(library(ctx).delete, lexicon_id, owner)
        return {"object": "audio.lexicon.deleted", "id": lexicon_id, "deleted": True}

    @router.post("/apply")
    async def apply(body: ApplyBody, owner: str = owner_dep) -> dict[str, Any]:
        if len(body.input) > ctx.limits.max_text_chars:
            message = f"input has {len(body.input)} characters; the limit is {ctx.limits.max_text_chars}"
            raise ApiError(413, message, param="input", code="text_too_long")
        if body.entries is not None:
            store = library(ctx)
            raw = [e.model_dump() for e in body.entries]
            entries = await run(make_entries, raw, store.family)
            return applied_json(Lexicon("draft", "draft", entries).apply(body.input))
        applied = await apply_lexicon(ctx, body.lexicon, body.input, owner)
        if applied is None:
            raise ApiError(422, "give lexicon (a name) or entries", param="lexicon", code="missing_lexicon")
        return applied_json(applied)

    return router
