"""Health, readiness, Prometheus metrics (per-app registry), models, the API key, and error mapping."""

from __future__ import annotations

import hmac

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import api.auth
from api.app import build_api, mount_api
from api.auth import ENV_VAR, bearer_token, key_matches, resolve_api_key
from api.errors import from_engine
from engine.errors import Busy, InvalidInput, ModelError, NotFound, NotReady, SynthesisFailed, TooLarge
from engine.serving.metrics import ServerStats
from tests.api.support import RecordingEngine, assert_openai_error, client_for


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """Every sample of an exposition, keyed by (name, sorted labels); fails if it does not parse."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def test_health_and_ready(client: httpx.AsyncClient, engine: RecordingEngine) -> None:
    assert (await client.get("/health")).json() == {"status": "ok"}
    ready = await client.get("/ready")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    engine.ready = False
    assert (await client.get("/health")).status_code == 200  # liveness does not depend on the model
    not_ready = await client.get("/ready")
    assert_openai_error(not_ready, 503)
    assert int(not_ready.headers["retry-after"]) >= 1


async def test_ready_returns_the_start_up_timeline(
    client: httpx.AsyncClient, engine: RecordingEngine
) -> None:
    from engine.serving.startup import Timeline

    assert "startup" not in (await client.get("/ready")).json()  # an engine without one (a fake)
    timeline = Timeline()
    with timeline.phase("weights"):
        pass
    timeline.mark_ready()
    engine.startup = timeline  # type: ignore[attr-defined]
    body = (await client.get("/ready")).json()["startup"]
    assert [p["name"] for p in body["phases"]] == ["weights"]
    assert body["ready_s"] == round(timeline.ready_s or 0.0, 3)
    assert body["pending"] == [] and body["now_s"] >= body["ready_s"]


async def test_ready_says_warming_while_start_up_work_is_left(
    client: httpx.AsyncClient, engine: RecordingEngine
) -> None:
    """A server ready on the native LM loop while vLLM starts: "warming" (first audio may be slower),
    the LM backend serving named, until the handover (a background phase) has ended."""
    from engine.serving.startup import Timeline

    timeline = Timeline()
    timeline.queue("LM handover")
    timeline.mark_ready()
    engine.startup, engine.lm_backend = timeline, "native"  # type: ignore[attr-defined]
    body = (await client.get("/ready")).json()
    assert (body["status"], body["stage"], body["lm_backend"]) == ("ready", "warming", "native")
    assert body["startup"]["pending"] == ["LM handover"]
    with timeline.phase("LM handover", background=True):
        engine.lm_backend = "vllm"  # type: ignore[attr-defined]
    body = (await client.get("/ready")).json()
    assert (body["stage"], body["lm_backend"]) == ("steady", "vllm")


async def test_health_fails_once_the_engine_has_stopped(
    client: httpx.AsyncClient, engine: RecordingEngine
) -> None:
    engine.healthy = False  # e.g. vLLM's engine-core process died: only a restart helps
    r = await client.get("/health")
    assert_openai_error(r, 503)
    assert r.json()["error"]["code"] == "unhealthy" and "restart" in r.json()["error"]["message"]


async def test_metrics_parse_and_count(client: httpx.AsyncClient, engine: RecordingEngine) -> None:
    engine.add_voice("alice", "x", "t")
    assert (await client.post("/v1/audio/speech", json={"input": "hi", "voice": "alice"})).status_code == 200
    assert (await client.post("/v1/audio/speech", json={"input": "hi", "voice": "bob"})).status_code == 404
    r = await client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    got = samples(r.text)
    speech = (("endpoint", "/v1/audio/speech"), ("status", "200"))
    assert got[("cosystream_http_requests_total", speech)] == 1
    assert got[("cosystream_http_requests_total", (("endpoint", "/v1/audio/speech"), ("status", "404")))] == 1
    for histogram in ("cosystream_ttfa_seconds", "cosystream_rtf", "cosystream_lm_tokens_per_second"):
        assert got[(f"{histogram}_count", ())] == 1, histogram
    for gauge in ("cosystream_active_streams", "cosystream_queue_depth", "cosystream_ready"):
        assert (gauge, ()) in got, gauge
    assert got[("cosystream_device_memory_bytes", (("device", "cpu"),))] == 0
    assert got[("cosystream_engine_completed_total", ())] == 1


async def test_metrics_read_engine_stats_at_scrape_time(
    client: httpx.AsyncClient, engine, monkeypatch
) -> None:
    stats = ServerStats(
        active_streams=3, queued=7, device_memory_mb=512.0, device="cuda:0", lm_tokens_total=99
    )
    monkeypatch.setattr(engine, "stats", lambda: stats)
    got = samples((await client.get("/metrics")).text)
    assert got[("cosystream_active_streams", ())] == 3 and got[("cosystream_queue_depth", ())] == 7
    assert got[("cosystream_device_memory_bytes", (("device", "cuda:0"),))] == 512 * 2**20
    assert got[("cosystream_lm_tokens_total", ())] == 99


async def test_each_app_has_its_own_registry() -> None:
    first, second = RecordingEngine(), RecordingEngine()
    app_a, app_b = build_api(first, api_key=""), build_api(second, api_key="")  # no duplicate-metric error
    async with client_for(app_a) as a, client_for(app_b) as b:
        await a.get("/health")
        await a.get("/health")
        got_a, got_b = samples((await a.get("/metrics")).text), samples((await b.get("/metrics")).text)
    key = ("cosystream_http_requests_total", (("endpoint", "/health"), ("status", "200")))
    assert got_a[key] == 2 and key not in got_b


async def test_models(client: httpx.AsyncClient, engine: RecordingEngine) -> None:
    listing = (await client.get("/v1/models")).json()
    assert listing["object"] == "list"
    cards = {card["id"]: card for card in listing["data"]}
    speech = ["fake", "cosyvoice3", "cosyvoice", "tts-1", "tts-1-hd", "gpt-4o-mini-tts"]
    asr = ["whisper-1", "gpt-4o-transcribe", "gpt-4o-mini-transcribe", "fake-whisper"]
    assert list(cards) == speech + asr
    assert cards["fake"]["family"] == "cosyvoice3" and cards["fake"]["sample_rate"] == 24000
    assert {cards[i]["kind"] for i in speech} == {"speech"} and {cards[i]["root"] for i in speech} == {"fake"}
    assert {cards[i]["kind"] for i in asr} == {"transcription"} and cards["whisper-1"][
        "root"
    ] == "fake-whisper"
    for model_id in speech + asr:  # retrieve echoes the id asked for
        assert (await client.get(f"/v1/models/{model_id}")).json()["id"] == model_id
    assert_openai_error(await client.get("/v1/models/whisper-2"), 404, "model")
    engine.asr_model = None  # transcription off: its ids are gone
    assert [c["id"] for c in (await client.get("/v1/models")).json()["data"]] == speech


async def test_api_key_guards_v1_but_not_probes(engine) -> None:
    async with client_for(build_api(engine, api_key="s3cret")) as c:
        assert_openai_error(await c.get("/v1/models"), 401)
        wrong = await c.get("/v1/models", headers={"Authorization": "Bearer nope"})
        assert assert_openai_error(wrong, 401)["code"] == "invalid_api_key"
        assert wrong.headers["www-authenticate"] == "Bearer"
        assert_openai_error(await c.post("/v1/audio/speech", json={"input": "x"}), 401)
        assert (await c.get("/v1/models", headers={"Authorization": "Bearer s3cret"})).status_code == 200
        for path in ("/health", "/ready", "/metrics"):
            assert (await c.get(path)).status_code == 200, path


async def test_api_key_from_environment(engine, monkeypatch) -> None:
    monkeypatch.setenv(ENV_VAR, "from-env")
    async with client_for(build_api(engine)) as c:
        assert (await c.get("/v1/models")).status_code == 401
        assert (await c.get("/v1/models", headers={"Authorization": "Bearer from-env"})).status_code == 200
    async with client_for(build_api(engine, api_key="")) as c:  # explicit empty = off, even with the env
        assert (await c.get("/v1/models")).status_code == 200


def test_resolve_and_parse_keys(monkeypatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert resolve_api_key(None) is None and resolve_api_key("k") == "k" and resolve_api_key("") is None
    assert bearer_token("Bearer abc") == "abc" and bearer_token("bearer  abc ") == "abc"
    assert bearer_token("Basic abc") is None and bearer_token("Bearer") is None and bearer_token(None) is None


def test_key_comparison_is_constant_time(monkeypatch) -> None:
    calls, real = [], hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(api.auth.hmac, "compare_digest", spy)
    assert key_matches("abc", "abc") and not key_matches("abd", "abc") and not key_matches(None, "abc")
    assert calls == [(b"abc", b"abc"), (b"abd", b"abc")]


@pytest.mark.parametrize(
    ("error", "status", "code"),
    [
        (NotReady("loading", retry_after_s=0.2), 503, "not_ready"),
        (Busy("full", retry_after_s=4.0), 429, "queue_full"),
        (TooLarge("long"), 413, "too_large"),
        (NotFound("missing"), 404, "not_found"),
        (InvalidInput("bad"), 422, "invalid_input"),
        (SynthesisFailed("nan"), 500, "synthesisfailed"),
        (ModelError("keys"), 500, "modelerror"),
    ],
)
def test_engine_error_mapping(error: Exception, status: int, code: str) -> None:
    mapped = from_engine(error)  # type: ignore[arg-type]
    assert (mapped.status_code, mapped.code, mapped.message) == (status, code, str(error))
    if isinstance(error, Busy):
        assert mapped.headers == {"Retry-After": "1" if status == 503 else "4"}  # rounded up, at least 1 s
    body = mapped.body()["error"]
    assert body["type"] == {
        503: "service_unavailable_error",
        429: "rate_limit_error",
        404: "not_found_error",
    }.get(status, "server_error" if status >= 500 else "invalid_request_error")


async def test_mount_on_an_existing_app_keeps_its_routes(engine) -> None:
    from fastapi import FastAPI

    app = FastAPI()

    @app.get("/ui-probe")
    async def ui_probe() -> dict[str, str]:
        return {"ui": "here"}

    ctx = mount_api(app, engine, api_key="")
    assert app.state.cosystream_api is ctx
    async with client_for(app) as c:
        assert (await c.get("/ui-probe")).json() == {"ui": "here"}
        assert (await c.get("/health")).status_code == 200
