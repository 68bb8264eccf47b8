"""The studio's own HTTP routes: live PCM for the WebAudio player, finished audio as wav / mp3.

Gradio's streamed ``gr.Audio`` buffers seconds before it plays, so the Generate handler also publishes each
chunk's PCM into a ``StreamHub`` channel named by the request id (a 32-hex uuid the browser draws at click
time), and the browser reads it from ``GET /webui/pcm/{rid}`` as raw little-endian int16 mono with the rate
in the ``X-Sample-Rate`` header. The handler and the route run on the same event loop, so plain asyncio
queues connect them. Finished audio is kept on disk by ``AudioStore`` for the history's download links.

The browser announces its id first (``POST /webui/pcm/{rid}``, at the click, while the Generate event may
still wait in Gradio's queue); an id nobody announced or opened is refused at once (404), never waited on.
On shutdown ``StreamHub.shutdown`` ends every wait and stream, so no reader holds the server open. With a
login (``signed_in``) every route answers 401 to a request without the studio's session.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
import shutil
import tempfile
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import numpy as np
import soundfile as sf
from fastapi import APIRouter, Depends, HTTPException, Request, Response, WebSocket, WebSocketDisconnect
from fastapi.responses import FileResponse, StreamingResponse
from starlette.requests import HTTPConnection

from engine.errors import EngineError

log = logging.getLogger(__name__)

RID = re.compile(r"^[0-9a-f]{32}$")
ALIVE_PATH = "/webui/alive"  # the page's line to its server (``link.js``): held open, never work in flight
BROWSER_ID = re.compile(r"^[0-9a-f]{32}$")  # 128 random bits drawn in the browser (static/browser_id.js)
STUDIO_OWNER = "studio:"  # keeps browser ids apart from API keys in the voice library
# a voice id as the page may send it: the engine's library judges it; no path separators, no "." or ".."
VOICE_ID = re.compile(r"^(?!\.\.?$)[^/\\\x00]{1,128}$")
MEDIA_TYPES = {"wav": "audio/wav", "mp3": "audio/mpeg"}


class _Channel:
    def __init__(self) -> None:
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.opened = asyncio.Event()
        self.sample_rate = 0  # 0 = closed before it opened (the request failed validation)
        self.buffered = 0  # bytes published and not read yet
        self.reader = False
        self.waiting = 0  # readers waiting for the handler to open it
        self.created = time.monotonic()


class StreamHub:
    """Per-request PCM channels from the Generate handler to one browser reader.

    Either side may come first (the browser usually asks before the handler has run). Unread data is capped
    at ``max_buffer_bytes`` per channel, and channels nobody reads expire after ``ttl_s``.
    """

    def __init__(self, max_channels: int = 256, max_buffer_bytes: int = 16 << 20, ttl_s: float = 600.0):
        self.max_channels, self.max_buffer_bytes, self.ttl_s = max_channels, max_buffer_bytes, ttl_s
        self._channels: OrderedDict[str, _Channel] = OrderedDict()
        self.closed = False  # the server is shutting down: no new waits

    def _channel(self, rid: str) -> _Channel:
        channel = self._channels.get(rid)
        if channel is None:
            self._expire()
            channel = self._channels[rid] = _Channel()
        return channel

    def _expire(self) -> None:
        now = time.monotonic()
        for rid, ch in list(self._channels.items()):
            if len(self._channels) >= self.max_channels or (not ch.reader and now - ch.created > self.ttl_s):
                del self._channels[rid]

    def announce(self, rid: str) -> None:
        """The browser will read ``rid``: its reader may wait for the handler (until ``ttl_s``)."""
        self._channel(rid)

    def known(self, rid: str) -> bool:
        """Announced by the browser or opened / closed by the handler (and not read or expired yet)."""
        return not self.closed and rid in self._channels

    def shutdown(self) -> None:
        """End every wait and every stream now (the server is stopping; the readers get what they had)."""
        self.closed = True
        for channel in self._channels.values():
            channel.queue.put_nowait(None)
            channel.opened.set()

    def open(self, rid: str, sample_rate: int) -> None:
        channel = self._channel(rid)
        channel.sample_rate = sample_rate
        channel.opened.set()

    def publish(self, rid: str, data: bytes) -> None:
        channel = self._channels.get(rid)
        if channel is None or channel.buffered + len(data) > self.max_buffer_bytes:
            return  # nobody is listening (or the reader stalled): the final file still has everything
        channel.buffered += len(data)
        channel.queue.put_nowait(data)

    def close(self, rid: str) -> None:
        """End of stream: normal end, stop, or an error before the first chunk."""
        channel = self._channel(rid)  # created if the browser has not asked yet, so it gets a quick 204
        channel.queue.put_nowait(None)
        channel.opened.set()

    async def wait_open(self, rid: str, timeout_s: float) -> int | None:
        """Sample rate once the handler opens ``rid``; None if it failed first, timed out, or is taken."""
        channel = self._channel(rid)
        if channel.reader or self.closed:
            return None
        channel.waiting += 1
        try:
            await asyncio.wait_for(channel.opened.wait(), timeout_s)
        except TimeoutError:
            self._channels.pop(rid, None)
            return None
        finally:
            channel.waiting -= 1
        if not channel.sample_rate or self.closed:
            self._channels.pop(rid, None)
            return None
        channel.reader = True
        return channel.sample_rate

    async def read(self, rid: str) -> AsyncIterator[bytes]:
        channel = self._channels[rid]
        try:
            while (data := await channel.queue.get()) is not None:
                channel.buffered -= len(data)
                yield data
        finally:
            self._channels.pop(rid, None)

    @property
    def waiting(self) -> int:
        """Readers waiting for their request to start."""
        return sum(ch.waiting for ch in self._channels.values())

    def __len__(self) -> int:
        return len(self._channels)


class AudioStore:
    """Finished generations as 16-bit wav files in a private temp dir; mp3 made on first download."""

    def __init__(self, root: Path | None = None, max_items: int = 200):
        self._root, self.max_items = root, max_items
        self._items: OrderedDict[str, Path] = OrderedDict()

    @property
    def root(self) -> Path:
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix="cosystream-webui-"))
        return self._root

    def save(self, rid: str, pcm: np.ndarray, sample_rate: int) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / f"{rid}.wav"
        sf.write(path, np.clip(pcm, -1.0, 1.0), sample_rate, subtype="PCM_16")
        self._items[rid] = path
        while len(self._items) > self.max_items:
            _, old = self._items.popitem(last=False)
            for stale in old.parent.glob(f"{old.stem}.*"):
                stale.unlink(missing_ok=True)
            shutil.rmtree(old.parent / old.stem, ignore_errors=True)  # its copies named for people
        return path

    def path(self, rid: str, ext: str) -> Path | None:
        wav = self._items.get(rid)
        if wav is None or ext not in MEDIA_TYPES:
            return None
        if ext == "wav":
            return wav
        mp3 = wav.with_suffix(".mp3")
        if not mp3.exists():
            encode_mp3(wav, mp3)
        return mp3

    def cleanup(self) -> None:
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)


def encode_mp3(wav: Path, mp3: Path) -> None:
    """16-bit wav -> mp3 (LAME via PyAV, imported here because only downloads need it)."""
    import av

    pcm, rate = sf.read(wav, dtype="int16", always_2d=True)
    tmp = mp3.with_suffix(".part")
    with av.open(str(tmp), "w", format="mp3") as out:
        stream = out.add_stream("libmp3lame", rate=rate, layout="mono")
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm.T[:1]), format="s16", layout="mono")
        frame.sample_rate = rate
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            out.mux(packet)
    tmp.replace(mp3)


def browser_owner(browser_id: str | None) -> str | None:
    """The voice namespace of a browser id the page drew (``handlers.OWNER_JS``); None for anything else."""
    return STUDIO_OWNER + browser_id if browser_id and BROWSER_ID.match(browser_id) else None


def router(
    hub: StreamHub, store: AudioStore, open_timeout_s: float = 300.0,
    signed_in: Callable[[HTTPConnection], bool] | None = None,
    previews: Callable[[str, str | None], Path | None] | None = None,
    account: Callable[[HTTPConnection], str | None] | None = None,
) -> APIRouter:  # fmt: skip
    """``/webui/pcm/{rid}`` (announce, then live PCM), ``/webui/audio/{rid}.{wav|mp3}`` (finished audio),
    ``/webui/voice/{id}?owner=<browser id>`` (a voice's recording, for the voice library's preview) and the
    ``/webui/alive`` socket. ``signed_in``: whether a request carries the studio's login (None: the studio
    has no login); ``previews``: the engine's ``voice_preview`` (None: no previews); ``account`` (with a
    login): the signed-in session's voice namespace, which replaces the page's browser id as a recording's
    owner (the studio saves a signed-in visitor's voices under its key, never its browser)."""

    def owner_of(request: Request, owner: str) -> str | None:
        return (account(request) or None) if account is not None else browser_owner(owner)

    def session(request: Request) -> None:
        if signed_in is not None and not signed_in(request):
            raise HTTPException(401, "sign in to the studio first")

    routes = APIRouter(prefix="/webui", dependencies=[Depends(session)])
    outer = APIRouter()  # the socket: a Request dependency cannot serve one, so it checks the login itself
    instance = secrets.token_hex(8)  # this server process: a page that sees another one reloads

    @routes.post("/pcm/{rid}", status_code=204)
    async def announce(rid: str) -> Response:
        if not RID.match(rid):
            raise HTTPException(404, "not a request id")
        if hub.closed:
            raise HTTPException(503, "the server is stopping")
        hub.announce(rid)
        return Response(status_code=204)

    @routes.get("/pcm/{rid}")
    async def pcm(rid: str) -> Response:
        if not RID.match(rid) or not hub.known(rid):
            raise HTTPException(404, "unknown stream")  # at once: nobody said this id would come
        rate = await hub.wait_open(rid, open_timeout_s)
        if rate is None:
            return Response(status_code=204)  # failed validation, stopped early, or never started
        headers = {"X-Sample-Rate": str(rate), "Cache-Control": "no-store", "X-Accel-Buffering": "no"}
        return StreamingResponse(hub.read(rid), media_type="application/octet-stream", headers=headers)

    @routes.get("/audio/{name}")
    async def audio(name: str) -> Response:
        rid, _, ext = name.partition(".")
        path = await asyncio.to_thread(store.path, rid, ext) if RID.match(rid) else None
        if path is None:
            raise HTTPException(404, f"no audio {name!r} in this server's history")
        return FileResponse(path, media_type=MEDIA_TYPES[ext], filename=f"cosystream-{rid[:8]}.{ext}")

    @routes.get("/voice/{voice_id}")
    async def voice(request: Request, voice_id: str, owner: str = "") -> Response:
        path = None
        if previews is not None and VOICE_ID.match(voice_id):
            try:
                path = await asyncio.to_thread(previews, voice_id, owner_of(request, owner))
            except EngineError:  # not found, not this browser's: as for no recording
                path = None
        if path is None:
            raise HTTPException(404, f"no recording of voice {voice_id!r}")
        return FileResponse(path, media_type="audio/wav", headers={"Cache-Control": "private, max-age=60"})

    @outer.websocket(ALIVE_PATH)
    async def alive(ws: WebSocket) -> None:
        """The page learns which server process answers (``instance``) and, by the socket's close, when
        it goes away: uvicorn closes every socket with 1012 when it stops, a killed process drops it. It
        waits for the page's close, never on a timer."""
        if signed_in is not None and not signed_in(ws):
            await ws.close(code=1008)  # policy: sign in first
            return
        await ws.accept()
        await ws.send_json({"instance": instance})
        with contextlib.suppress(WebSocketDisconnect):
            while True:
                await ws.receive_text()  # the page sends nothing: this returns at the close

    outer.include_router(routes)
    return outer
