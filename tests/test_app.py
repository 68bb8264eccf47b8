"""CLI flags -> EngineConfig; the app mounts the UI and the studio routes around an injected engine."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import textwrap
import threading
import time
import types
from typing import ClassVar

import httpx
import pytest

import app
from engine.config import DEFAULT_MODEL, EngineConfig, Limits
from tests.fakes import FakeEngine


def test_defaults() -> None:
    args = app.parse_args([])
    assert (args.model, args.host, args.port, args.ui_lang, args.share) == (
        DEFAULT_MODEL, "127.0.0.1", 7860, "auto", False,
    )  # fmt: skip
    assert app.engine_config(args) == EngineConfig(asr_model="auto")  # the library's default is "none"


def test_flags_reach_the_engine_config() -> None:
    args = app.parse_args(
        ["--model", "demo-tiny", "--device", "cpu", "--backend", "native", "--max-concurrency", "4",
         "--ui-lang", "en", "--port", "9000", "--api-key", "k", "--api-key", "k2", "--asr-model", "none"]
    )  # fmt: skip
    cfg = app.engine_config(args)
    assert (cfg.model, cfg.device, cfg.backend) == ("demo-tiny", "cpu", "native")
    assert cfg.limits == Limits(max_concurrency=4)
    assert (args.ui_lang, args.port, args.api_key, cfg.asr_model) == ("en", 9000, ["k", "k2"], "none")
    assert cfg.stream.fast_start is None  # auto, as StreamConfig
    assert app.engine_config(app.parse_args(["--fast-start", "auto"])).stream.fast_start is None
    assert app.engine_config(app.parse_args(["--fast-start", "off"])).stream.fast_start is False
    assert app.engine_config(app.parse_args(["--fast-start", "on"])).stream.fast_start is True
    flags = ["--flow-dtype", "float32", "--graph-warmup-s", "15", "--gpu-memory-utilization", "0.5"]
    gpu = app.parse_args([*flags, "--no-flow-compile", "--no-flow-reuse", "--flow-reuse-gb", "1.5"])
    cfg = app.engine_config(gpu)
    assert cfg.flow_reuse is False and EngineConfig().flow_reuse is None  # auto: off for v2's graphs
    assert app.engine_config(app.parse_args(["--flow-reuse"])).flow_reuse is True
    assert cfg.flow_attention == "mask"
    assert app.engine_config(app.parse_args(["--flow-attention", "folded"])).flow_attention == "folded"
    with pytest.raises(SystemExit):
        app.parse_args(["--flow-reuse", "--no-flow-reuse"])
    assert cfg.flow_reuse_gb == 1.5 and EngineConfig().flow_reuse_gb is None
    assert cfg.limits.forced_tokens is False  # a public server ignores the bench's forced lengths
    assert app.engine_config(app.parse_args(["--allow-forced-tokens"])).limits.forced_tokens is True
    assert (cfg.flow_dtype, cfg.graph_warmup_s, cfg.gpu_memory_utilization) == ("float32", 15.0, 0.5)
    assert cfg.flow_compile is False and EngineConfig().flow_compile is None  # auto: v3 only
    assert app.engine_config(app.parse_args(["--flow-compile"])).flow_compile is True
    with pytest.raises(SystemExit):
        app.parse_args(["--flow-compile", "--no-flow-compile"])
    assert EngineConfig().flow_dtype == "bfloat16"  # the GPU default; the CPU path is float32 regardless


@pytest.mark.parametrize(
    "argv",
    [
        ["--device", "tpu"],
        ["--backend", "trt"],
        ["--max-concurrency", "0"],
        ["--ui-lang", "fr"],
        ["--fast-start", "x"],
        ["--flow-dtype", "float16"],
        ["--gpu-memory-utilization", "2"],
        ["--max-prompt-s", "100"],
        ["--graph-warmup-s", "-1"],
    ],
)
def test_bad_flags_exit_with_usage(argv, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        app.parse_args(argv)
    assert exc.value.code == 2 and "usage:" in capsys.readouterr().err


def test_import_is_light() -> None:
    code = textwrap.dedent(
        """
        import sys, app
        heavy = [m for m in ("torch", "gradio", "engine.engine", "uvicorn", "fastapi") if m in sys.modules]
        print(heavy)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_build_engine_imports_the_engine_lazily(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "engine.engine", None)  # "not importable": proves the import is inside
    with pytest.raises(ModuleNotFoundError):
        app.build_engine(EngineConfig())


class FakeTTSEngine:
    loads: ClassVar[list[tuple]] = []

    @classmethod
    def load(cls, cfg, model_dir=None, timeline=None):
        cls.loads.append((cfg.model, model_dir))
        return cls()


def test_demo_tiny_builds_a_random_model_offline(monkeypatch, tmp_path) -> None:
    built: list[tuple] = []
    monkeypatch.setitem(sys.modules, "engine.engine", types.SimpleNamespace(TTSEngine=FakeTTSEngine))
    monkeypatch.setattr(
        "bench.make_model.build_model_dir", lambda out, family, size: built.append((out, family, size)) or out
    )
    FakeTTSEngine.loads.clear()
    app.build_engine(EngineConfig(model="demo-tiny", cache_dir=str(tmp_path)))
    app.build_engine(EngineConfig(model="/models/cv3"))
    assert built == [(tmp_path / "demo-tiny", "cosyvoice3", "tiny")]
    assert FakeTTSEngine.loads == [("demo-tiny", tmp_path / "demo-tiny"), ("/models/cv3", None)]


def test_mount_api_is_optional(monkeypatch, caplog) -> None:
    from fastapi import FastAPI

    monkeypatch.setitem(sys.modules, "api.app", None)
    assert app.mount_api(FastAPI(), FakeEngine(), Limits(), None) is False
    assert "serving the UI only" in caplog.text


async def test_app_serves_the_ui_and_studio_routes() -> None:
    fastapi_app = app.create_app(FakeEngine(), ui_lang="en", random_weights=True)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=fastapi_app), base_url="http://t") as c:
        page = await c.get("/")
        assert page.status_code == 200 and "CosyStream" in page.text
        # the studio's routes answer (not Gradio's catch-all mount at "/", which would 404 differently)
        assert (await c.get("/webui/pcm/not-an-id")).json() == {"detail": "unknown stream"}
        missing = await c.get("/webui/audio/" + "a" * 32 + ".wav")
        assert missing.status_code == 404 and "history" in missing.json()["detail"]


def test_model_and_device_defaults_come_from_the_environment(monkeypatch):
    # Docker and Hugging Face Spaces set these instead of flags
    monkeypatch.setenv("COSYSTREAM_MODEL", "iic/CosyVoice2-0.5B")
    monkeypatch.setenv("COSYSTREAM_DEVICE", "cpu")
    import importlib

    import app

    importlib.reload(app)
    args = app.parse_args([])
    assert args.model == "iic/CosyVoice2-0.5B" and args.device == "cpu"


def test_every_limit_has_a_flag():
    import app

    args = app.parse_args(
        [
            "--max-queue",
            "3",
            "--max-text-chars",
            "500",
            "--max-upload-mb",
            "2",
            "--max-prompt-s",
            "20",
            "--request-timeout-s",
            "60",
            "--max-concurrency",
            "2",
        ]
    )
    limits = app.engine_config(args).limits
    assert (limits.max_queue, limits.max_text_chars, limits.max_upload_bytes) == (3, 500, 2 * 2**20)
    assert (limits.max_prompt_s, limits.request_timeout_s, limits.max_concurrency) == (20, 60, 2)


def test_cluster_flags_default_to_one_process_and_are_checked(capsys) -> None:
    import app

    args = app.parse_args(["--voices-dir", "/shared/voices"])
    assert args.replicas == 0 and app.engine_config(args).voices_dir == "/shared/voices"
    scaled = app.parse_args(["--replicas", "2", "--max-replicas", "4", "--gpus-per-replica", "1"])
    assert (scaled.replicas, scaled.min_replicas, scaled.max_replicas) == (2, 1, 4)
    assert scaled.gpus_per_replica == 1
    for argv in (["--replicas", "-1"], ["--replicas", "2", "--share"], ["--max-replicas", "0"]):
        with pytest.raises(SystemExit):
            app.parse_args(argv)
    assert "--replicas" in capsys.readouterr().err


async def test_a_queue_join_logs_no_deprecation_warning(recwarn) -> None:
    """Gradio's queue join used to warn about Starlette's renamed 422 constant on every Generate click."""
    fastapi_app = app.create_app(FakeEngine(), ui_lang="en", random_weights=True)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=fastapi_app), base_url="http://t") as c:
        join = {"data": [], "fn_index": 0, "session_hash": "readme0"}
        assert (await c.post("/gradio_api/queue/join", json=join)).status_code == 200
    assert not [str(w.message) for w in recwarn if "deprecated" in str(w.message)]


def test_the_url_is_logged_once_the_port_listens() -> None:
    """The "CosyStream on http://..." line gives the bound port (0 asked: the system's pick), and a client
    connecting the moment it is logged finds the socket listening."""
    fastapi_app = app.create_app(FakeEngine(), ui_lang="en", random_weights=True)
    connected: list[str] = []

    class Probe(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if message.startswith("CosyStream on http://"):
                host, port = message.split()[2].removeprefix("http://").split(":")
                with socket.create_connection((host, int(port)), timeout=5):
                    connected.append(message)

    probe, level = Probe(), app.log.level
    app.log.addHandler(probe)
    app.log.setLevel(logging.INFO)
    server = app.web_server(fastapi_app, "127.0.0.1", 0, "fake")
    thread = threading.Thread(target=server.run, daemon=True)
    try:
        thread.start()
        deadline = time.monotonic() + 60
        while not connected and time.monotonic() < deadline and thread.is_alive():
            time.sleep(0.05)
    finally:
        server.should_exit = True
        thread.join(10)
        app.log.removeHandler(probe)
        app.log.setLevel(level)
    assert len(connected) == 1 and "(model fake)" in connected[0], connected


def test_api_keys_put_the_studio_behind_a_login() -> None:
    """With keys, Gradio's own routes refuse a visitor until they log in with one of the keys."""
    from fastapi.testclient import TestClient

    with TestClient(app.create_app(FakeEngine(), ui_lang="en", api_key=["k1", "k2"])) as client:
        assert client.get("/config").status_code == 401
        assert client.post("/login", data={"username": "anyone", "password": "nope"}).status_code == 400
        assert client.post("/login", data={"username": "anyone", "password": "k2"}).status_code == 200
        assert client.get("/config").status_code == 200
        assert client.get("/v1/models", headers={"Authorization": "Bearer k1"}).status_code == 200
        assert client.get("/v1/models").status_code == 401
    with TestClient(app.create_app(FakeEngine(), ui_lang="en", api_key="")) as client:
        assert client.get("/config").status_code == 200  # no keys: an open demo


def test_the_server_answers_before_the_studio_is_built_and_mounts_it_when_done(monkeypatch) -> None:
    """main()'s create_app(studio_later=True): /health and the API answer while the UI is still being
    built (Gradio's import alone is 10-25 s on a 2-core CPU); "/" says so until the UI is mounted."""
    building, release = threading.Event(), threading.Event()
    real_mount = app.Studio.mount

    def held_mount(self, fastapi_app):
        building.set()
        assert release.wait(120)
        return real_mount(self, fastapi_app)

    monkeypatch.setattr(app.Studio, "mount", held_mount)
    engine = FakeEngine()
    fastapi_app = app.create_app(engine, ui_lang="en", random_weights=True, studio_later=True)
    server = app.web_server(fastapi_app, "127.0.0.1", 0, "fake")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 120
        while not (server.started and building.is_set()) and time.monotonic() < deadline:
            time.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        loading = httpx.get(url + "/", timeout=30)
        assert loading.status_code == 503 and "loading" in loading.text and loading.headers["retry-after"]
        release.set()
        page = loading
        while page.status_code != 200 and time.monotonic() < deadline + 120:
            time.sleep(0.2)
            page = httpx.get(url + "/", timeout=30)
        assert page.status_code == 200 and "CosyStream" in page.text
    finally:
        release.set()
        server.should_exit = True
        thread.join(30)
