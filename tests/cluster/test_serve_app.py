"""The Serve application on a local Ray: two demo-tiny CPU replicas behind one ingress (one cluster for
the module). Skipped where ``requirements-cluster.txt`` is not installed."""

from __future__ import annotations

import io
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf

pytest.importorskip("ray.serve")

from engine.demo.make_model import build_model_dir
from tests.cluster.support import LONG, SHORT, Cluster, local_cluster, wait_until
from tests.sounds import speech_like

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("cluster")
    with local_cluster(build_model_dir(root / "model", "cosyvoice3", "tiny"), root / "voices") as c:
        yield c


def prompt_wav(seconds: float = 2.0) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, speech_like(seconds), 24000, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def speech(text: str, **extra: object) -> dict[str, object]:
    return {"model": "tts-1", "input": text, "response_format": "pcm", "stream_format": "audio"} | extra


def test_stock_openai_client_streams_through_the_ingress(cluster: Cluster) -> None:
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=60)
    with client, client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="alloy", input=SHORT, response_format="pcm",
        extra_body={"mode": "cross_lingual", "ref_audio": _b64(prompt_wav())},
    ) as response:  # fmt: skip
        pieces = [p for p in response.iter_bytes() if p]
    pcm = np.frombuffer(b"".join(pieces), "<i2")
    assert len(pieces) >= 2 and len(pcm) > 24000 // 2  # streamed in pieces, over half a second of audio
    assert np.abs(pcm).max() > 0


async def test_voice_saved_on_one_replica_serves_concurrent_requests_on_both(cluster: Cluster) -> None:
    async with httpx.AsyncClient(base_url=cluster.url, timeout=60) as client:
        files = {"audio_sample": ("carol.wav", prompt_wav(), "audio/wav")}
        created = await client.post("/v1/audio/voices", data={"name": "carol", "ref_text": "hi"}, files=files)
        assert created.status_code == 201, created.text
        voice = created.json()["id"]
        assert voice in (await client.get("/v1/audio/voices")).json()["voices"]
        before = settled(cluster)
        first = await _open(client, speech(LONG, voice=voice))  # streaming on one replica ...
        second = await _open(client, speech(SHORT, voice=voice))  # ... so the router picks the other
        await _drain(second)
        await first.aclose()  # type: ignore[attr-defined]  # an async generator
    # the long request ends when its cancel reaches the replica, or at its end on a loaded 2-core machine;
    # this test is about where requests ran (test_disconnect_cancels_... checks the cancel itself)
    assert wait_until(lambda: sum(handled(cluster).values()) == sum(before.values()) + 2)
    after = handled(cluster)
    assert {r: after[r] - before[r] for r in before} == dict.fromkeys(before, 1.0)  # one each


def settled(cluster: Cluster) -> dict[str, float]:
    """``handled`` once no stream is active and two reports in a row agree: the counts reach the board
    every ``report_interval_s``, so a request an earlier test finished may not be in the first read."""
    assert wait_until(lambda: sum(r.stats.active_streams for r in cluster.reports()) == 0)
    last: list[dict[str, float]] = [handled(cluster)]

    def steady() -> bool:
        time.sleep(1.0)  # > 2 report intervals (support.local_cluster reports every 0.2 s)
        now = handled(cluster)
        same, last[0] = now == last[0], now
        return same

    assert wait_until(steady)
    return last[0]


def handled(cluster: Cluster) -> dict[str, float]:
    """Requests each replica finished, completed or cancelled."""
    done, left = cluster.replica_counters("completed"), cluster.replica_counters("cancelled")
    return {r: done[r] + left.get(r, 0.0) for r in done}


def test_disconnect_cancels_the_request_on_its_replica(cluster: Cluster) -> None:
    before = sum(cluster.replica_counters("cancelled").values())
    with httpx.stream("POST", f"{cluster.url}/v1/audio/speech", json=_cross(LONG), timeout=60) as r:
        assert r.status_code == 200
        next(r.iter_bytes())  # audio is flowing; now leave
    assert wait_until(lambda: sum(cluster.replica_counters("cancelled").values()) == before + 1)
    assert wait_until(lambda: sum(r.stats.active_streams for r in cluster.reports()) == 0)


def test_ui_and_probes_are_served(cluster: Cluster) -> None:
    page = httpx.get(cluster.url + "/", timeout=30)
    assert page.status_code == 200 and "gradio" in page.text.lower()
    assert httpx.get(cluster.url + "/ready", timeout=10).json()["status"] == "ready"
    assert httpx.get(cluster.url + "/health", timeout=10).status_code == 200
    assert set(cluster.replica_counters("ready").values()) == {1.0}


def test_a_killed_replica_fails_its_stream_and_the_other_serves(cluster: Cluster) -> None:
    import ray

    with httpx.stream("POST", f"{cluster.url}/v1/audio/speech", json=_cross(LONG), timeout=60) as r:
        pieces = r.iter_bytes()
        next(pieces)
        assert wait_until(lambda: any(rep.stats.active_streams for rep in cluster.reports()), 10)
        victim = next(rep for rep in cluster.reports() if rep.stats.active_streams)
        ray.kill(ray.get_actor(victim.actor, namespace="serve"), no_restart=True)
        with pytest.raises(httpx.HTTPError):  # the stream breaks off; it does not end as if complete
            for _ in pieces:
                pass
    survivor_ok = httpx.post(f"{cluster.url}/v1/audio/speech", json=_cross(SHORT), timeout=60)
    assert survivor_ok.status_code == 200 and len(survivor_ok.content) > 0
    assert httpx.get(cluster.url + "/health", timeout=10).status_code == 200
    # Serve replaces the dead replica: two replicas report again, one of them new
    assert wait_until(lambda: _replaced(cluster, victim.replica), 120)


def _replaced(cluster: Cluster, dead: str) -> bool:
    ids = {r.replica for r in cluster.reports()}
    return len(ids) == 2 and dead not in ids


def _cross(text: str) -> dict[str, object]:
    return speech(text, mode="cross_lingual", ref_audio=_b64(prompt_wav()))


def _b64(data: bytes) -> str:
    import base64

    return base64.b64encode(data).decode()


async def _open(client: httpx.AsyncClient, body: dict[str, object]) -> AsyncIterator[bytes]:
    """Send, and wait for the first audio bytes (the request is then running on a replica); the rest of
    the body follows from the returned iterator."""
    response = await client.send(client.build_request("POST", "/v1/audio/speech", json=body), stream=True)
    assert response.status_code == 200, await response.aread()
    pieces = response.aiter_bytes()
    await anext(pieces)
    return pieces


async def _drain(pieces: AsyncIterator[bytes]) -> None:
    async for _ in pieces:
        pass
