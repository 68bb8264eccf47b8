"""Live PCM hand-off (either side first, closes, caps) and the studio's HTTP routes."""

from __future__ import annotations

import asyncio
import io
import re
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile as sf
from fastapi import FastAPI

from webui.stream_route import ALIVE_PATH, AudioStore, StreamHub, router

RID = "0123456789abcdef0123456789abcdef"


async def waiting_reader(hub: StreamHub, ceiling_s: float = 30.0) -> None:
    """Until a reader is inside its wait for the handler (state, not a fixed sleep; ceiling_s at most)."""

    async def poll() -> None:
        while not hub.waiting:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), ceiling_s)


async def read_all(hub: StreamHub, rid: str) -> bytes:
    return b"".join([chunk async for chunk in hub.read(rid)])


async def test_reader_first_then_writer() -> None:
    hub = StreamHub()
    waiting = asyncio.create_task(hub.wait_open(RID, 5.0))
    await asyncio.sleep(0)
    hub.open(RID, 24000)
    hub.publish(RID, b"ab")
    hub.publish(RID, b"cd")
    hub.close(RID)
    assert await waiting == 24000
    assert await read_all(hub, RID) == b"abcd"
    assert len(hub) == 0  # the reader's end removes the channel


async def test_writer_finishes_before_the_reader_arrives() -> None:
    hub = StreamHub()
    hub.open(RID, 16000)
    hub.publish(RID, b"xyz")
    hub.close(RID)
    assert await hub.wait_open(RID, 1.0) == 16000
    assert await read_all(hub, RID) == b"xyz"


async def test_closed_before_opening_means_no_stream() -> None:
    hub = StreamHub()
    hub.close(RID)  # the request failed validation
    assert await hub.wait_open(RID, 1.0) is None
    assert len(hub) == 0


async def test_wait_times_out_and_a_second_reader_is_refused() -> None:
    hub = StreamHub()
    assert await hub.wait_open(RID, 0.01) is None
    hub.open(RID, 24000)
    assert await hub.wait_open(RID, 1.0) == 24000
    assert await hub.wait_open(RID, 1.0) is None


async def test_unread_data_is_capped() -> None:
    hub = StreamHub(max_buffer_bytes=4)
    hub.open(RID, 24000)
    for part in (b"ab", b"cd", b"ef"):
        hub.publish(RID, part)
    hub.close(RID)
    await hub.wait_open(RID, 1.0)
    assert await read_all(hub, RID) == b"abcd"
    hub.publish("f" * 32, b"nobody")  # no channel: dropped, no error


async def test_abandoned_channels_expire() -> None:
    hub = StreamHub(max_channels=2, ttl_s=1e9)
    for rid in ("a" * 32, "b" * 32, "c" * 32):
        hub.open(rid, 24000)
    assert len(hub) == 2  # the oldest made room
    hub = StreamHub(ttl_s=0.0)
    hub.open("a" * 32, 24000)
    hub.open("b" * 32, 24000)
    assert len(hub) == 1


def test_audio_store_keeps_wav_and_makes_mp3(tmp_path) -> None:
    store = AudioStore(tmp_path, max_items=2)
    pcm = (0.3 * np.sin(np.arange(24000) / 10)).astype(np.float32)
    wav = store.save(RID, pcm, 24000)
    back, rate = sf.read(wav, dtype="float32")
    assert rate == 24000 and np.abs(back - pcm).max() < 1e-4
    mp3 = store.path(RID, "mp3")
    assert mp3 is not None and mp3.read_bytes()[:3] in (b"ID3", b"\xff\xfb", b"\xff\xf3")
    assert store.path(RID, "ogg") is None and store.path("e" * 32, "wav") is None
    store.save("a" * 32, pcm, 24000)
    store.save("b" * 32, pcm, 24000)
    assert store.path(RID, "wav") is None and not wav.exists() and not mp3.exists()  # oldest evicted


@pytest.fixture
def client_parts(tmp_path):
    hub, store = StreamHub(), AudioStore(tmp_path)
    app = FastAPI()
    app.include_router(router(hub, store, open_timeout_s=2.0))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    return client, hub, store


async def test_pcm_route_streams_with_rate_header(client_parts) -> None:
    client, hub, _ = client_parts
    hub.open(RID, 24000)
    hub.publish(RID, b"\x01\x00\x02\x00")
    hub.close(RID)
    resp = await client.get(f"/webui/pcm/{RID}")
    assert resp.status_code == 200 and resp.headers["x-sample-rate"] == "24000"
    assert resp.content == b"\x01\x00\x02\x00"


async def test_pcm_route_statuses(client_parts) -> None:
    client, hub, _ = client_parts
    assert (await client.get("/webui/pcm/not-a-request-id")).status_code == 404
    hub.close(RID)
    assert (await client.get(f"/webui/pcm/{RID}")).status_code == 204


async def test_audio_route_serves_wav_and_mp3(client_parts) -> None:
    client, _, store = client_parts
    store.save(RID, np.zeros(2400, np.float32), 24000)
    wav = await client.get(f"/webui/audio/{RID}.wav")
    assert wav.status_code == 200 and wav.headers["content-type"] == "audio/wav"
    assert sf.info(io.BytesIO(wav.content)).frames == 2400
    mp3 = await client.get(f"/webui/audio/{RID}.mp3")
    assert mp3.status_code == 200 and mp3.headers["content-type"] == "audio/mpeg"
    assert "attachment" in mp3.headers["content-disposition"]
    assert (await client.get(f"/webui/audio/{'c' * 32}.wav")).status_code == 404
    assert (await client.get("/webui/audio/..%2Fetc.wav")).status_code == 404


async def test_an_unknown_id_is_refused_at_once_and_an_announced_one_waits(tmp_path) -> None:
    hub = StreamHub()
    app = FastAPI()
    app.include_router(router(hub, AudioStore(tmp_path), open_timeout_s=300.0))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        # a 300 s wait would trip the 30 s ceiling: the answer comes without waiting
        unknown = await asyncio.wait_for(client.get(f"/webui/pcm/{RID}"), 30)
        assert unknown.status_code == 404 and len(hub) == 0  # nothing kept for it either
        assert (await client.post("/webui/pcm/not-an-id")).status_code == 404
        assert (await client.post(f"/webui/pcm/{RID}")).status_code == 204
        reading = asyncio.create_task(client.get(f"/webui/pcm/{RID}"))
        await waiting_reader(hub)
        hub.open(RID, 24000)
        hub.publish(RID, b"\x05\x00")
        hub.close(RID)
        resp = await asyncio.wait_for(reading, 30)
        assert resp.status_code == 200 and resp.content == b"\x05\x00"


async def test_shutdown_ends_waiting_and_streaming_readers() -> None:
    hub = StreamHub()
    hub.announce(RID)
    waiting = asyncio.create_task(hub.wait_open(RID, 300.0))
    other = "e" * 32
    hub.open(other, 24000)
    hub.publish(other, b"ab")
    assert await hub.wait_open(other, 1.0) == 24000
    streaming = asyncio.create_task(read_all(hub, other))
    await waiting_reader(hub)
    hub.shutdown()
    assert await asyncio.wait_for(waiting, 30) is None  # answered now, not after 300 s
    assert await asyncio.wait_for(streaming, 30) == b"ab"  # the reader keeps what it had, then ends
    assert not hub.known(RID) and await hub.wait_open("f" * 32, 300.0) is None


async def test_every_route_needs_the_session_when_there_is_a_login(tmp_path) -> None:
    hub, store = StreamHub(), AudioStore(tmp_path)
    store.save(RID, np.zeros(240, np.float32), 24000)
    app = FastAPI()
    app.include_router(router(hub, store, 2.0, signed_in=lambda req: req.cookies.get("session") == "ok"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        for method, path in [("POST", f"/webui/pcm/{RID}"), ("GET", f"/webui/pcm/{RID}")]:
            assert (await client.request(method, path)).status_code == 401
        assert (await client.get(f"/webui/audio/{RID}.wav")).status_code == 401
        client.cookies.set("session", "ok")
        assert (await client.get(f"/webui/audio/{RID}.wav")).status_code == 200
        assert (await client.post(f"/webui/pcm/{RID}")).status_code == 204


def test_the_alive_socket_names_its_server_and_needs_the_session(tmp_path) -> None:
    """The page's line (``link.js``): each server process names itself once; with a login, a socket
    without the studio's session is closed with 1008 (policy) before anything is said."""
    from fastapi.testclient import TestClient
    from starlette.websockets import WebSocketDisconnect

    def app_with(signed_in: Any = None) -> FastAPI:
        app = FastAPI()
        app.include_router(router(StreamHub(), AudioStore(tmp_path), 2.0, signed_in=signed_in))
        return app

    first, again = TestClient(app_with()), TestClient(app_with())
    with first.websocket_connect(ALIVE_PATH) as ws, first.websocket_connect(ALIVE_PATH) as same:
        name = ws.receive_json()["instance"]
        assert re.fullmatch(r"[0-9a-f]{16}", name) and same.receive_json()["instance"] == name
    with again.websocket_connect(ALIVE_PATH) as ws:
        assert ws.receive_json()["instance"] != name  # a restarted server is another process
    locked = TestClient(app_with(lambda conn: conn.cookies.get("session") == "ok"))
    with pytest.raises(WebSocketDisconnect) as refused, locked.websocket_connect(ALIVE_PATH) as ws:
        ws.receive_json()
    assert refused.value.code == 1008
    locked.cookies.set("session", "ok")
    with locked.websocket_connect(ALIVE_PATH) as ws:
        assert "instance" in ws.receive_json()


async def test_a_voice_recording_is_served_to_its_browser_only(tmp_path) -> None:
    from tests.fakes import FakeEngine
    from tests.sounds import write_wav

    engine = FakeEngine()
    wav = write_wav(tmp_path / "v.wav", 1.0)
    engine.add_voice("Mine", str(wav), "words", "studio:" + "a" * 32)
    engine.add_voice("Bare", "", "no recording kept", "studio:" + "a" * 32)
    app = FastAPI()
    app.include_router(router(StreamHub(), AudioStore(tmp_path / "s"), previews=engine.voice_preview))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        mine = await client.get("/webui/voice/mine", params={"owner": "a" * 32})
        assert mine.status_code == 200 and mine.content == wav.read_bytes()
        for path, owner in (("mine", "b" * 32), ("mine", ""), ("bare", "a" * 32), ("..", "a" * 32)):
            assert (await client.get(f"/webui/voice/{path}", params={"owner": owner})).status_code == 404


async def test_with_a_login_a_recording_is_the_signed_in_keys(tmp_path) -> None:
    """With the key login the studio saves a visitor's voices under the key's namespace, not the browser
    id: the play button finds them through the session, and a browser id alone finds nothing."""
    from tests.fakes import FakeEngine
    from tests.sounds import write_wav

    engine = FakeEngine()
    wav = write_wav(tmp_path / "v.wav", 1.0)
    engine.add_voice("Mine", str(wav), "words", "api:key:k1")
    engine.add_voice("Yours", str(wav), "words", "studio:" + "a" * 32)
    keys = {"alice": "api:key:k1", "bob": "api:key:k2"}
    app = FastAPI()
    app.include_router(
        router(
            StreamHub(), AudioStore(tmp_path / "s"), signed_in=lambda conn: "user" in conn.cookies,
            previews=engine.voice_preview, account=lambda conn: keys.get(conn.cookies.get("user", "")),
        )
    )  # fmt: skip
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        client.cookies.set("user", "alice")
        mine = await client.get("/webui/voice/mine", params={"owner": "a" * 32})
        assert mine.status_code == 200 and mine.content == wav.read_bytes()
        # the browser's own namespace is no one's with a login: the page cannot name one
        assert (await client.get("/webui/voice/yours", params={"owner": "a" * 32})).status_code == 404
        client.cookies.set("user", "bob")  # another key: not its voice
        assert (await client.get("/webui/voice/mine")).status_code == 404
        client.cookies.set("user", "mallory")  # signed in by no key: no namespace at all
        assert (await client.get("/webui/voice/mine")).status_code == 404
        client.cookies.clear()
        assert (await client.get("/webui/voice/mine")).status_code == 401


def test_the_studio_with_keys_plays_the_signed_in_keys_own_voice(tmp_path) -> None:
    """The whole app as ``--api-key`` serves it: after the key login the library's play button finds the
    voice the studio saved under the key's namespace (it was a 404: the route looked under the browser id)."""
    from fastapi.testclient import TestClient

    from api.auth import owner_of
    from server import web
    from tests.fakes import FakeEngine
    from tests.sounds import write_wav

    engine = FakeEngine()
    wav = write_wav(tmp_path / "v.wav", 1.0)
    engine.add_voice("Mine", str(wav), "words", owner_of("k1"))
    with TestClient(web.create_app(engine, ui_lang="en", api_key=["k1", "k2"])) as client:
        assert client.get("/webui/voice/mine", params={"owner": "a" * 32}).status_code == 401
        form = [("username", (None, "alice")), ("password", (None, "k1"))]
        assert client.post("/login", files=form).status_code == 200
        mine = client.get("/webui/voice/mine", params={"owner": "a" * 32})
        assert mine.status_code == 200 and mine.content == wav.read_bytes()
