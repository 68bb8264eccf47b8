"""Live PCM hand-off (either side first, closes, caps) and the studio's HTTP routes."""

from __future__ import annotations

import asyncio
import io

import httpx
import numpy as np
import pytest
import soundfile as sf
from fastapi import FastAPI

from webui.stream_route import AudioStore, StreamHub, router

RID = "0123456789abcdef0123456789abcdef"


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
