"""CLI flags -> EngineConfig; the app mounts the UI and the studio routes around an injected engine."""

from __future__ import annotations

import asyncio
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

from engine.config import DEFAULT_MODEL, EngineConfig, Limits
from server import cli, web
from tests.conftest import WAIT_S
from tests.fakes import FakeEngine


def test_defaults() -> None:
    args = cli.parse_args([])
    assert (args.model, args.host, args.port, args.ui_lang, args.share) == (
        DEFAULT_MODEL, "127.0.0.1", 7860, "auto", False,
    )  # fmt: skip
    assert cli.engine_config(args) == EngineConfig(asr_model="auto")  # the library's default is "none"


def test_flags_reach_the_engine_config() -> None:
    args = cli.parse_args(
        ["--model", "demo-tiny", "--device", "cpu", "--backend", "native", "--max-concurrency", "4",
         "--ui-lang", "en", "--port", "9000", "--api-key", "k", "--api-key", "k2", "--asr-model", "none"]
    )  # fmt: skip
    cfg = cli.engine_config(args)
    assert (cfg.model, cfg.device, cfg.backend) == ("demo-tiny", "cpu", "native")
    assert cfg.limits == Limits(max_concurrency=4)
    assert (args.ui_lang, args.port, args.api_key, cfg.asr_model) == ("en", 9000, ["k", "k2"], "none")
    assert cfg.stream.fast_start is None  # auto, as StreamConfig
    assert cli.engine_config(cli.parse_args(["--fast-start", "auto"])).stream.fast_start is None
    assert cli.engine_config(cli.parse_args(["--fast-start", "off"])).stream.fast_start is False
    assert cli.engine_config(cli.parse_args(["--fast-start", "on"])).stream.fast_start is True
    assert cfg.stream.fast_start_trim == 0  # the reference's audio unless asked
    assert cli.engine_config(cli.parse_args(["--fast-start-trim", "12"])).stream.fast_start_trim == 12
    flags = ["--flow-dtype", "float32", "--graph-warmup-s", "15", "--gpu-memory-utilization", "0.5"]
    gpu = cli.parse_args([*flags, "--no-flow-compile", "--no-flow-reuse", "--flow-reuse-gb", "1.5"])
    cfg = cli.engine_config(gpu)
    assert cfg.flow_reuse is False and EngineConfig().flow_reuse is None  # auto: off for v2's graphs
    assert cli.engine_config(cli.parse_args(["--flow-reuse"])).flow_reuse is True
    assert cfg.lm_handover is None and cfg.hands_over  # auto: on with the default fixed KV cache
    assert not cli.engine_config(cli.parse_args(["--no-lm-handover"])).hands_over
    assert cli.engine_config(cli.parse_args(["--lm-handover"])).lm_handover is True
    with pytest.raises(SystemExit):  # a profiling vLLM would race the native loop beside it
        cli.parse_args(["--lm-handover", "--lm-kv-cache-gib", "0"])
    assert cfg.flow_attention == "mask"
    assert cli.engine_config(cli.parse_args(["--flow-attention", "folded"])).flow_attention == "folded"
    with pytest.raises(SystemExit):
        cli.parse_args(["--flow-reuse", "--no-flow-reuse"])
    assert cfg.flow_reuse_gb == 1.5 and EngineConfig().flow_reuse_gb is None
    assert cfg.limits.forced_tokens is False  # a public server ignores the bench's forced lengths
    assert cli.engine_config(cli.parse_args(["--allow-forced-tokens"])).limits.forced_tokens is True
    assert (cfg.flow_dtype, cfg.graph_warmup_s, cfg.gpu_memory_utilization) == ("float32", 15.0, 0.5)
    assert cfg.flow_compile is False and EngineConfig().flow_compile is None  # auto: v3 only
    assert cli.engine_config(cli.parse_args(["--flow-compile"])).flow_compile is True
    assert cli.engine_config(cli.parse_args(["--flow-aot"])).flow_aot is True and cfg.flow_aot is False
    off = cli.engine_config(cli.parse_args(["--no-flow-precompiled"]))
    assert off.flow_precompiled is False and cfg.flow_precompiled is True  # measured: on by default
    # the last of --flow-precompiled / --no-flow-precompiled wins: an A/B adds the other to one command
    undone = cli.parse_args(["--flow-precompiled", "--no-flow-precompiled"])
    assert cli.engine_config(undone).flow_precompiled is False
    assert cli.engine_config(cli.parse_args(["--no-flow-precompiled", "--flow-precompiled"])).flow_precompiled
    assert cfg.lm_native_graphs is True
    assert cfg.flow_step_graphs is True  # measured at start-up: on by default
    assert cli.engine_config(cli.parse_args(["--no-flow-step-graphs"])).flow_step_graphs is False
    assert cfg.lm_fork_server is True  # measured at start-up: on by default
    assert cli.engine_config(cli.parse_args(["--no-lm-fork-server"])).lm_fork_server is False
    assert cfg.weights_onto_device is True  # the page-locked reader: on by default
    assert cli.engine_config(cli.parse_args(["--no-weights-onto-device"])).weights_onto_device is False
    assert cli.engine_config(cli.parse_args(["--no-native-lm-graphs"])).lm_native_graphs is False
    # with the flow not compiled (or AOT-compiled) the kept programs are moot, not an error
    assert cli.engine_config(cli.parse_args(["--no-flow-compile"])).flow_precompiled is True
    # the defaults: a fixed 6 GiB KV cache for vLLM, so the first graphs come beside its start (auto)
    assert (cfg.lm_kv_cache_gib, cfg.first_graphs_early, cfg.graphs_early) == (6.0, None, True)
    profiled = cli.engine_config(cli.parse_args(["--lm-kv-cache-gib", "0"]))
    assert (profiled.lm_kv_cache_gib, profiled.graphs_early) == (None, False)
    forced = cli.engine_config(cli.parse_args(["--lm-kv-cache-gib", "0", "--first-graphs-early"]))
    assert (forced.first_graphs_early, forced.graphs_early) == (True, True)
    late = cli.engine_config(cli.parse_args(["--no-first-graphs-early", "--lm-kv-cache-gib", "8"]))
    assert (late.lm_kv_cache_gib, late.graphs_early) == (8.0, False)
    with pytest.raises(SystemExit):  # the config's range check, answered as a usage error
        cli.parse_args(["--lm-kv-cache-gib=-1"])
    with pytest.raises(SystemExit):
        cli.parse_args(["--flow-compile", "--no-flow-compile"])
    assert EngineConfig().flow_dtype == "bfloat16"  # the GPU default; the CPU path is float32 regardless
    assert (cfg.cuda_mps, cfg.mps_flow_percent) == (None, None)  # auto
    assert cli.engine_config(cli.parse_args(["--no-cuda-mps"])).cuda_mps is False
    mps = cli.engine_config(cli.parse_args(["--cuda-mps", "--mps-flow-percent", "70"]))
    assert (mps.cuda_mps, mps.mps_flow_percent) == (True, 70)


@pytest.mark.parametrize(
    "argv",
    [
        ["--device", "tpu"],
        ["--backend", "trt"],
        ["--max-concurrency", "0"],
        ["--ui-lang", "fr"],
        ["--fast-start", "x"],
        ["--fast-start-trim", "13"],
        ["--flow-dtype", "float16"],
        ["--gpu-memory-utilization", "2"],
        ["--max-prompt-s", "100"],
        ["--graph-warmup-s", "-1"],
    ],
)
def test_bad_flags_exit_with_usage(argv, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(argv)
    assert exc.value.code == 2 and "usage:" in capsys.readouterr().err


def test_import_is_light() -> None:
    code = textwrap.dedent(
        """
        import sys, app
        heavy = ("torch", "gradio", "engine.serving.engine", "uvicorn", "fastapi", "ray", "cluster")
        heavy = [m for m in heavy if m in sys.modules]
        print(heavy)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_entry_picks_the_single_process_server_or_the_replicas(monkeypatch) -> None:
    """app.py sits above server/ and cluster/: one process without --replicas, Ray Serve with it (cluster's
    launcher, imported only then), the process prepared (logging, SIGUSR1) before either reads its flags."""
    import app

    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(app, "prepare_process", lambda: calls.append(("prepare", 0)))
    monkeypatch.setattr(app, "serve", lambda args: calls.append(("serve", args.replicas)))
    launcher = types.ModuleType("cluster.application")
    launcher.run_local = lambda args: calls.append(("replicas", args.replicas))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cluster.application", launcher)  # no Ray started by this test
    app.main(["--model", "demo-tiny"])
    app.main(["--model", "demo-tiny", "--replicas", "2"])
    assert calls == [("prepare", 0), ("serve", 0), ("prepare", 0), ("replicas", 2)]


def test_build_engine_imports_the_engine_lazily(monkeypatch) -> None:
    monkeypatch.setitem(
        sys.modules, "engine.serving.engine", None
    )  # "not importable": proves the import is inside
    with pytest.raises(ModuleNotFoundError):
        cli.build_engine(EngineConfig())


class FakeTTSEngine:
    loads: ClassVar[list[tuple]] = []

    @classmethod
    def load(cls, cfg, model_dir=None, timeline=None, idle_work=()):
        cls.loads.append((cfg.model, model_dir, [name for name, _ in idle_work]))
        return cls()


def test_demo_tiny_builds_a_random_model_offline(monkeypatch, tmp_path) -> None:
    built: list[tuple] = []
    monkeypatch.setitem(sys.modules, "engine.serving.engine", types.SimpleNamespace(TTSEngine=FakeTTSEngine))
    monkeypatch.setattr(
        "engine.demo.make_model.build_model_dir",
        lambda out, family, size: built.append((out, family, size)) or out,
    )
    FakeTTSEngine.loads.clear()
    cli.build_engine(EngineConfig(model="demo-tiny", cache_dir=str(tmp_path)))
    cli.build_engine(EngineConfig(model="/models/cv3"), idle_work=(("studio import", web.import_studio),))
    assert built == [(tmp_path / "demo-tiny", "cosyvoice3", "tiny")]
    assert FakeTTSEngine.loads == [
        ("demo-tiny", tmp_path / "demo-tiny", []),
        ("/models/cv3", None, ["studio import"]),  # handed on to the engine's load
    ]


def test_the_studio_import_ahead_loads_gradio_and_never_fails_the_load(monkeypatch, caplog) -> None:
    """``import_studio`` runs inside the engine's load: it imports Gradio, and an import that fails there
    is a warning (the build after ready imports again), not an error that would stop the load."""
    web.import_studio()
    assert "gradio" in sys.modules
    monkeypatch.setitem(sys.modules, "gradio", None)  # `import gradio` now raises ImportError
    with caplog.at_level(logging.WARNING, "cosystream"):
        web.import_studio()
    assert "importing the studio ahead failed" in caplog.text


def test_mount_api_is_optional(monkeypatch, caplog) -> None:
    from fastapi import FastAPI

    monkeypatch.setitem(sys.modules, "api.app", None)
    assert web.mount_api(FastAPI(), FakeEngine(), Limits(), None) is False
    assert "serving the UI only" in caplog.text


async def test_app_serves_the_ui_and_studio_routes() -> None:
    fastapi_app = web.create_app(FakeEngine(), ui_lang="en", random_weights=True)
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

    from server import cli

    importlib.reload(cli)
    args = cli.parse_args([])
    assert args.model == "iic/CosyVoice2-0.5B" and args.device == "cpu"


def test_more_flags_come_from_the_environment_before_the_command_line(monkeypatch, capsys):
    """A Space sets variables, not a command line: COSYSTREAM_ARGS's flags (shell-quoted) apply, the
    command line's win where both give one, and a broken value is a usage error that names the variable."""
    from server import cli

    flags = "--no-lm-handover --single-stream-graphs-at-load --ready-graph-wait-s 5 --ui-lang 'zh'"
    monkeypatch.setenv("COSYSTREAM_ARGS", flags)
    args = cli.parse_args(["--ui-lang", "en"])
    assert (args.lm_handover, args.single_stream_graphs_at_load, args.ui_lang) == (False, True, "en")
    assert (cli.engine_config(args).lm_handover, cli.engine_config(args).ready_graph_wait_s) == (False, 5.0)
    monkeypatch.setenv("COSYSTREAM_ARGS", "--ui-lang 'zh")
    with pytest.raises(SystemExit):
        cli.parse_args([])
    assert "COSYSTREAM_ARGS" in capsys.readouterr().err
    monkeypatch.setenv("COSYSTREAM_ARGS", "--no-such-flag")
    with pytest.raises(SystemExit):
        cli.parse_args([])
    monkeypatch.delenv("COSYSTREAM_ARGS")
    assert cli.parse_args([]).lm_handover is None


def test_every_limit_has_a_flag():
    from server import cli

    args = cli.parse_args(
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
    limits = cli.engine_config(args).limits
    assert (limits.max_queue, limits.max_text_chars, limits.max_upload_bytes) == (3, 500, 2 * 2**20)
    assert (limits.max_prompt_s, limits.request_timeout_s, limits.max_concurrency) == (20, 60, 2)


def test_cluster_flags_default_to_one_process_and_are_checked(capsys) -> None:
    from server import cli

    args = cli.parse_args(["--voices-dir", "/shared/voices"])
    assert args.replicas == 0 and cli.engine_config(args).voices_dir == "/shared/voices"
    scaled = cli.parse_args(["--replicas", "2", "--max-replicas", "4", "--gpus-per-replica", "1"])
    assert (scaled.replicas, scaled.min_replicas, scaled.max_replicas) == (2, 1, 4)
    assert scaled.gpus_per_replica == 1
    for argv in (["--replicas", "-1"], ["--replicas", "2", "--share"], ["--max-replicas", "0"]):
        with pytest.raises(SystemExit):
            cli.parse_args(argv)
    assert "--replicas" in capsys.readouterr().err


async def test_a_queue_join_logs_no_deprecation_warning(recwarn) -> None:
    """Gradio's queue join used to warn about Starlette's renamed 422 constant on every Generate click."""
    fastapi_app = web.create_app(FakeEngine(), ui_lang="en", random_weights=True)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=fastapi_app), base_url="http://t") as c:
        join = {"data": [], "fn_index": 0, "session_hash": "readme0"}
        assert (await c.post("/gradio_api/queue/join", json=join)).status_code == 200
    assert not [str(w.message) for w in recwarn if "deprecated" in str(w.message)]


def test_the_url_is_logged_once_the_port_listens() -> None:
    """The "CosyStream on http://..." line gives the bound port (0 asked: the system's pick), and a client
    connecting the moment it is logged finds the socket listening."""
    fastapi_app = web.create_app(FakeEngine(), ui_lang="en", random_weights=True)
    connected: list[str] = []

    class Probe(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if message.startswith("CosyStream on http://"):
                host, port = message.split()[2].removeprefix("http://").split(":")
                with socket.create_connection((host, int(port)), timeout=WAIT_S):
                    connected.append(message)

    probe, level = Probe(), web.log.level
    web.log.addHandler(probe)
    web.log.setLevel(logging.INFO)
    server = web.web_server(fastapi_app, "127.0.0.1", 0, "fake")
    thread = threading.Thread(target=server.run, daemon=True)
    try:
        thread.start()
        deadline = time.monotonic() + WAIT_S
        while not connected and time.monotonic() < deadline and thread.is_alive():
            time.sleep(0.05)
    finally:
        server.should_exit = True
        thread.join(10)
        web.log.removeHandler(probe)
        web.log.setLevel(level)
    assert len(connected) == 1 and "(model fake)" in connected[0], connected


def test_api_keys_put_the_studio_behind_a_login() -> None:
    """With keys, Gradio's own routes refuse a visitor until they log in with one of the keys."""
    from fastapi.testclient import TestClient

    with TestClient(web.create_app(FakeEngine(), ui_lang="en", api_key=["k1", "k2"])) as client:
        assert client.get("/config").status_code == 401
        assert client.post("/login", data={"username": "anyone", "password": "nope"}).status_code == 400
        assert client.post("/login", data={"username": "anyone", "password": "k2"}).status_code == 200
        assert client.get("/config").status_code == 200
        assert client.get("/v1/models", headers={"Authorization": "Bearer k1"}).status_code == 200
        assert client.get("/v1/models").status_code == 401
    with TestClient(web.create_app(FakeEngine(), ui_lang="en", api_key="")) as client:
        assert client.get("/config").status_code == 200  # no keys: an open demo


def test_the_login_page_names_the_product_and_how_to_sign_in() -> None:
    from fastapi.testclient import TestClient

    with TestClient(web.create_app(FakeEngine(), ui_lang="auto", api_key=["k1"])) as client:
        refused = client.get("/gradio_api/login_check")
        assert refused.status_code == 401
        message = refused.json()["detail"]["auth_message"]
        assert "CosyStream" in message and "any user name" in message and "API 密钥" in message


def test_studio_routes_need_the_login_when_keys_are_set() -> None:
    """/webui/pcm and /webui/audio answer 401 without the studio's session, and serve once signed in."""
    from fastapi.testclient import TestClient

    rid = "0123456789abcdef0123456789abcdef"
    with TestClient(web.create_app(FakeEngine(), ui_lang="en", api_key=["k1", "k2"])) as client:
        for method, path in [("POST", f"/webui/pcm/{rid}"), ("GET", f"/webui/pcm/{rid}")]:
            assert client.request(method, path).status_code == 401
        assert client.get(f"/webui/audio/{rid}.wav").status_code == 401
        assert client.get(f"/webui/pcm/{rid}", headers={"Authorization": "Bearer k1"}).status_code == 401
        # as Gradio's login page sends it: multipart form data
        form = [("username", (None, "alice")), ("password", (None, "k2"))]
        assert client.post("/login", files=form).status_code == 200
        assert client.get(f"/webui/pcm/{rid}").status_code == 404  # signed in: unknown, at once
        assert client.post(f"/webui/pcm/{rid}").status_code == 204
        assert client.get(f"/webui/audio/{rid}.wav").status_code == 404  # signed in: not in the history


def test_voices_saved_after_signing_in_belong_to_the_key(tmp_path) -> None:
    """The studio saves in the namespace the API gives the same key: the API with that key lists the
    voice, another key does not, and the browser id the page sends does not pick the namespace."""
    from gradio_client import Client, handle_file

    from api.auth import owner_of
    from tests.sounds import write_wav
    from tests.webui.support import serving

    engine = FakeEngine()
    wav = write_wav(tmp_path / "prompt.wav", seconds=4.0)
    with serving(web.create_app(engine, ui_lang="en", api_key=["k1", "k2"])) as url:
        studio = Client(url, auth=("alice", "k1"), verbose=False)
        studio.predict("Mine", handle_file(str(wav)), "hello there", "ab" * 16, api_name="/save_voice")

        def names(key: str) -> list[str]:
            got = httpx.get(url + "v1/audio/voices", headers={"Authorization": f"Bearer {key}"}, timeout=30)
            return [v["name"] for v in got.json()["data"]]

        assert "Mine" in names("k1") and "Mine" not in names("k2")
    assert [owner for owner, _ in engine.voices] == [owner_of("k1")]


def test_a_pending_live_reader_does_not_hold_the_shutdown() -> None:
    """A reader waits for an announced request that never starts: on exit it is answered at once (204)
    instead of holding uvicorn's graceful shutdown for the request timeout (300 s here)."""
    fastapi_app = web.create_app(FakeEngine(), ui_lang="en", limits=Limits(request_timeout_s=300.0))
    port = socket.socket()
    port.bind(("127.0.0.1", 0))
    number = port.getsockname()[1]
    port.close()
    server = web.web_server(fastapi_app, "127.0.0.1", number, "fake")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{number}/webui/pcm/{'9' * 32}"
    deadline = time.monotonic() + 120
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the app did not start"
        time.sleep(0.05)
    assert httpx.post(base, timeout=30).status_code == 204
    answers: list[int] = []
    reader = threading.Thread(target=lambda: answers.append(httpx.get(base, timeout=120).status_code))
    reader.start()
    while not fastapi_app.state.stream_hub.waiting:
        assert time.monotonic() < deadline and reader.is_alive(), "the reader never started waiting"
        time.sleep(0.05)
    started = time.monotonic()
    server.should_exit = True
    thread.join(60)
    reader.join(60)
    assert not thread.is_alive() and answers == [204]
    assert time.monotonic() - started < 60  # far below the 300 s the reader would otherwise hold it


def test_the_studio_is_built_while_the_engine_warms_up_not_beside_the_first_requests(monkeypatch) -> None:
    """Behind a PendingEngine whose load imported Gradio ahead, the UI is built once the engine is built,
    during its warm-up: built after ready, its Python held the interpreter while the first request ran (its
    extra TTFA on the H200). The build reads the model's facts (family, presets, example voices) from the
    engine that is not warm yet."""
    from engine.serving.startup import Timeline
    from server.pending_engine import PendingEngine

    warming, release, seen = threading.Event(), threading.Event(), []
    real_mount = web.StudioMount.mount

    class Warming(FakeEngine):
        async def warmup(self) -> None:
            warming.set()
            assert await asyncio.to_thread(release.wait, 60)
            self.ready = True

    def watched_mount(self, fastapi_app):
        seen.append(self.engine.ready)  # the engine the studio is built over: the server's PendingEngine
        out = real_mount(self, fastapi_app)
        release.set()
        return out

    monkeypatch.setattr(web.StudioMount, "mount", watched_mount)
    monkeypatch.setattr(web, "studio_imported", lambda: True)  # as after import_studio, on a GPU's load
    built = Warming()
    built.ready = False
    pending = PendingEngine("fake", lambda: built, Timeline())
    fastapi_app = web.create_app(pending, ui_lang="en", random_weights=True, studio_later=True)
    server = web.web_server(fastapi_app, "127.0.0.1", 0, "fake")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        assert warming.wait(120) and release.wait(90), "the studio was not built during the warm-up"
        deadline = time.monotonic() + 120
        while not pending.ready and time.monotonic() < deadline:
            time.sleep(0.05)
        assert seen == [False] and pending.ready
        port = server.servers[0].sockets[0].getsockname()[1]
        page = httpx.get(f"http://127.0.0.1:{port}/", timeout=30)
        while page.status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
            page = httpx.get(f"http://127.0.0.1:{port}/", timeout=30)
        assert page.status_code == 200 and "CosyStream" in page.text
    finally:
        release.set()
        server.should_exit = True
        thread.join(30)


def test_without_gradio_imported_ahead_the_studio_is_built_after_ready(monkeypatch) -> None:
    """A CPU load has no wait for vLLM to import Gradio in: its import's seconds would delay ready, so the
    studio is built once the engine is warm, as before."""
    from engine.serving.startup import Timeline
    from server.pending_engine import PendingEngine

    seen: list[bool] = []
    built_at = threading.Event()
    real_mount = web.StudioMount.mount

    def watched_mount(self, fastapi_app):
        seen.append(self.engine.ready)
        built_at.set()
        return real_mount(self, fastapi_app)

    monkeypatch.setattr(web.StudioMount, "mount", watched_mount)
    monkeypatch.setattr(web, "studio_imported", lambda: False)
    built = FakeEngine()
    built.ready = False

    async def warmup() -> None:
        built.ready = True

    built.warmup = warmup  # type: ignore[attr-defined]
    pending = PendingEngine("fake", lambda: built, Timeline())
    server = web.web_server(web.create_app(pending, ui_lang="en", studio_later=True), "127.0.0.1", 0, "fake")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        assert built_at.wait(120) and seen == [True]
    finally:
        server.should_exit = True
        thread.join(30)


def test_the_server_answers_before_the_studio_is_built_and_mounts_it_when_done(monkeypatch) -> None:
    """main()'s create_app(studio_later=True): /health and the API answer while the UI is still being
    built (Gradio's import alone is 10-25 s on a 2-core CPU); "/" says so until the UI is mounted."""
    building, release = threading.Event(), threading.Event()
    real_mount = web.StudioMount.mount

    def held_mount(self, fastapi_app):
        building.set()
        assert release.wait(120)
        return real_mount(self, fastapi_app)

    monkeypatch.setattr(web.StudioMount, "mount", held_mount)
    engine = FakeEngine()
    fastapi_app = web.create_app(engine, ui_lang="en", random_weights=True, studio_later=True)
    server = web.web_server(fastapi_app, "127.0.0.1", 0, "fake")
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


def test_a_stream_cut_mid_body_reaches_the_client_truncated_and_logs_no_trace() -> None:
    """The served app over real uvicorn: an engine that ends the stream after its first chunk (as a shutdown
    does) leaves the client an incomplete chunked body, and uvicorn's log no trace of it."""
    from api.app import build_api
    from engine.errors import NotReady
    from tests.api.support import RecordingEngine

    engine = RecordingEngine(fail_after=NotReady("the server is shutting down"))
    engine.add_voice("alice", "x", "t")
    records: list[logging.LogRecord] = []
    keep = logging.Handler()
    keep.emit = records.append  # type: ignore[method-assign]
    server = web.web_server(build_api(engine, api_key=""), "127.0.0.1", 0, "fake")
    logging.getLogger("uvicorn.error").addHandler(keep)
    thread = threading.Thread(target=server.run, daemon=True)
    try:
        thread.start()
        url = wait_listening(server)
        with pytest.raises(httpx.RemoteProtocolError, match="incomplete"):
            speech = {"input": "Hello there.", "voice": "alice", "response_format": "pcm", "stream": True}
            httpx.post(url + "/v1/audio/speech", json=speech, timeout=WAIT_S)
    finally:
        server.should_exit = True
        thread.join(10)
        logging.getLogger("uvicorn.error").removeHandler(keep)
    assert not [r for r in records if r.exc_info], [r.getMessage() for r in records]


def wait_listening(server: web.GracefulServer) -> str:
    """The URL of a server started on port 0, once it listens (the port the system picked)."""
    deadline = time.monotonic() + WAIT_S
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    return f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
