"""CosyStream server: ``python app.py`` serves the Gradio studio at / and the HTTP API on one uvicorn server.

Flags become an ``EngineConfig``; the engine is built once (``build_engine``) and shared by the UI and the
API. Nothing heavy is imported at module level: torch, gradio and the engine load inside the functions.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import secrets
import socket
import threading
import warnings
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from engine.config import (
    BACKENDS,
    DEFAULT_MODEL,
    DEVICES,
    FAST_START_CHOICES,
    EngineConfig,
    Limits,
    StreamConfig,
    add_flow_attention_flag,
    add_flow_compile_flags,
    add_flow_reuse_flags,
    fast_start_choice,
    fast_start_flag,
)
from webui.texts import UI_LANG_CHOICES

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI

log = logging.getLogger("cosystream")

DEMO_TINY = "demo-tiny"  # the engine builds a tiny random-weight model offline; the UI says it is noise


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="cosystream", description="Streaming CosyVoice2/3 studio and speech API."
    )
    p.add_argument(
        "--model", default=os.environ.get("COSYSTREAM_MODEL", DEFAULT_MODEL),
        help=f"local model dir, ModelScope / Hugging Face id, or '{DEMO_TINY}' (offline, random weights)",
    )  # fmt: skip
    p.add_argument("--device", choices=DEVICES, default=os.environ.get("COSYSTREAM_DEVICE", "auto"))
    p.add_argument(
        "--backend", choices=BACKENDS, default="auto", help="speech LM backend (auto: vllm on GPU)"
    )
    p.add_argument(
        "--llm-variant", choices=("base", "rl"), default="base", help="rl: use llm.rl.pt if present"
    )
    p.add_argument(
        "--flow-dtype", choices=("bfloat16", "float32"), default=EngineConfig.flow_dtype,
        help="GPU flow solver precision (float32: the reference's, slower under load)",
    )  # fmt: skip
    add_flow_attention_flag(p)
    add_flow_compile_flags(p)
    add_flow_reuse_flags(p)
    p.add_argument(
        "--flow-reuse-gb", type=float, default=EngineConfig.flow_reuse_gb,
        help="memory all streams' flow frame caches may hold together (GiB); past it, streams recompute. "
        "Default: 4 eager; with CUDA graphs 40%% of the memory free after vLLM starts",
    )  # fmt: skip
    p.add_argument(
        "--graph-warmup-s", type=float, default=EngineConfig.graph_warmup_s,
        help="capture the flow/HiFT CUDA graphs for mel up to this many seconds at load; 0: on first use",
    )  # fmt: skip
    p.add_argument(
        "--gpu-memory-utilization", type=float, default=EngineConfig.gpu_memory_utilization,
        help="share of GPU memory vLLM takes for the speech LM (weights + KV cache)",
    )  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 to serve the network)")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--share", action="store_true", help="also open a public Gradio share link")
    p.add_argument(
        "--max-concurrency", type=_positive_int, default=Limits.max_concurrency,
        help="requests computing at once (engine slots and the UI's GPU queue)",
    )  # fmt: skip
    p.add_argument("--max-queue", type=int, default=Limits.max_queue, help="requests waiting for a slot")
    p.add_argument("--max-text-chars", type=_positive_int, default=Limits.max_text_chars)
    p.add_argument("--max-upload-mb", type=float, default=Limits.max_upload_bytes / 2**20)
    p.add_argument("--max-prompt-s", type=float, default=Limits.max_prompt_s, help="prompt audio, at most 30")
    p.add_argument("--request-timeout-s", type=float, default=Limits.request_timeout_s)
    p.add_argument(
        "--admit-slack-s", type=float, default=Limits.admit_slack_s,
        help="admission by SLO: refuse new requests (429 + Retry-After) while a running stream has this "
        "little playback slack left (s; default: slots alone)",
    )  # fmt: skip
    p.add_argument(
        "--allow-forced-tokens", action="store_true",
        help="benchmarks over HTTP: the API honours forced_tokens (a fixed length; not for a public server)",
    )  # fmt: skip
    p.add_argument(
        "--fast-start", choices=FAST_START_CHOICES, default=fast_start_flag(StreamConfig.fast_start),
        help="split the first stream chunk at the chunk grid (auto: v3 while at most 2 requests compute)",
    )  # fmt: skip
    p.add_argument(
        "--voices-dir", default=None,
        help="saved voices (default: the cache's voices/); with replicas on several hosts, a shared mount",
    )  # fmt: skip
    p.add_argument(
        "--ui-lang", choices=UI_LANG_CHOICES, default="auto",
        help="language of the web UI (auto: the browser's; zh or en force one)",
    )  # fmt: skip
    p.add_argument(
        "--api-key", action="append", default=None,
        help="a bearer key the API requires; repeat for several (each its own voice namespace). The studio "
        "then asks for a login: any user name, one of the keys as the password (default: "
        "COSYSTREAM_API_KEY, comma-separated)",
    )  # fmt: skip
    p.add_argument(
        "--asr-model", default="auto",
        help="Whisper that transcribes prompts: auto (large-v3-turbo on GPU, small on CPU), a Hugging Face "
        f"id or local dir, or none; '{DEMO_TINY}' uses a tiny random-weight Whisper",
    )  # fmt: skip
    add_cluster_flags(p)
    args = p.parse_args(argv)
    if args.replicas < 0:
        p.error(f"--replicas must be >= 0, got {args.replicas}")
    if args.replicas and args.share:
        p.error("--share opens a tunnel to one process: put a proxy in front of the cluster instead")
    try:
        engine_config(args)  # the config's own checks (ranges, combinations) answer as usage errors too
    except ValueError as err:
        p.error(str(err))
    return args


def add_cluster_flags(p: argparse.ArgumentParser) -> None:
    """Scale-out (``cluster/``, needs requirements-cluster.txt): engine replicas on Ray Serve."""
    g = p.add_argument_group("scale out on Ray Serve (pip install -r requirements-cluster.txt)")
    g.add_argument(
        "--replicas", type=int, default=0,
        help="N >= 1: start a local Ray with N engine replicas behind one ingress (0: one process, no Ray)",
    )  # fmt: skip
    g.add_argument("--min-replicas", type=_positive_int, default=1, help="autoscaling floor")
    g.add_argument("--max-replicas", type=_positive_int, default=None, help="set to autoscale")
    g.add_argument(
        "--gpus-per-replica", type=float, default=None, help="default: 1 when Ray sees GPUs, else 0"
    )
    g.add_argument("--cpus-per-replica", type=float, default=1.0, help="CPUs Ray reserves per replica")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    limits = Limits(
        max_concurrency=args.max_concurrency,
        max_queue=args.max_queue,
        max_text_chars=args.max_text_chars,
        max_upload_bytes=int(args.max_upload_mb * 2**20),
        max_prompt_s=args.max_prompt_s,
        request_timeout_s=args.request_timeout_s,
        forced_tokens=args.allow_forced_tokens,
        admit_slack_s=args.admit_slack_s,
    )
    return EngineConfig(
        model=args.model,
        device=args.device,
        backend=args.backend,
        llm_variant=args.llm_variant,
        gpu_memory_utilization=args.gpu_memory_utilization,
        flow_dtype=args.flow_dtype,
        flow_attention=args.flow_attention,
        flow_compile=args.flow_compile,
        flow_reuse=args.flow_reuse,
        flow_reuse_gb=args.flow_reuse_gb,
        graph_warmup_s=args.graph_warmup_s,
        voices_dir=args.voices_dir,
        limits=limits,
        stream=StreamConfig(fast_start=fast_start_choice(args.fast_start)),
        asr_model=args.asr_model,
    )


def build_engine(cfg: EngineConfig) -> Any:
    """Load the checkpoint (downloading it on first use) and return the resident engine.

    ``demo-tiny`` writes a tiny random-weight model in the released layout first (offline, seconds), so the
    whole stack runs on a fresh CPU machine; its audio is noise and the UI says so. With ``--asr-model auto``
    it gets a tiny random-weight Whisper too (its transcripts are noise, and the UI says so as well).
    """
    from engine.engine import TTSEngine  # torch and the models load here, not at import

    if cfg.model != DEMO_TINY:
        return TTSEngine.load(cfg)
    from bench.make_model import build_demo_tiny, demo_tiny_whisper

    cfg = replace(cfg, asr_model=demo_tiny_whisper(cfg.cache_dir, cfg.asr_model))
    return TTSEngine.load(cfg, model_dir=build_demo_tiny(cfg.cache_dir))


def mount_api(app: FastAPI, engine: Any, limits: Limits, api_key: str | Sequence[str] | None) -> bool:
    """Add the OpenAI-style API (``api.app.mount_api``) when that package is present; before the UI mount."""
    try:
        from api.app import mount_api as mount
    except ModuleNotFoundError as err:
        if err.name not in ("api", "api.app"):
            raise
        log.warning("api/ is not available (%s): serving the UI only", err)
        return False
    mount(app, engine, limits, api_key)
    return True


def create_app(
    engine: Any,
    *,
    ui_lang: str = "auto",
    limits: Limits | None = None,
    api_key: str | Sequence[str] | None = None,
    random_weights: bool = False,
) -> FastAPI:
    """One FastAPI app: the API, the studio's PCM / download routes, then the Gradio UI at "/" (last,
    because a mount at "/" catches every path registered after it). With API keys the studio needs a
    Gradio login (any user name, a key as the password), so nobody uses it without a key."""
    import gradio as gr
    from fastapi import FastAPI

    from api.auth import resolve_api_keys
    from webui import stream_route
    from webui.layout import build_demo, page_options

    quiet_gradio_deprecations()
    limits = limits or Limits()
    hub, store = stream_route.StreamHub(), stream_route.AudioStore()

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if not engine.ready:  # the engine serves only once warm; warm it on the server's event loop
            await engine.warmup()
        try:
            yield
        finally:
            store.cleanup()
            close = getattr(engine, "close", None)  # test fakes have nothing to release
            if close is not None:
                close()

    app = FastAPI(title="CosyStream", lifespan=lifespan)
    mount_api(app, engine, limits, api_key)
    app.include_router(stream_route.router(hub, store, open_timeout_s=limits.request_timeout_s))
    demo = build_demo(engine, ui_lang, limits, hub=hub, store=store, random_weights=random_weights)
    # uploads over the limit are refused before they are written to disk
    options = page_options(ui_lang) | {"max_file_size": limits.max_upload_bytes}
    keys = resolve_api_keys(api_key)
    if keys:
        options["auth"] = studio_login(keys)
    return gr.mount_gradio_app(app, demo, path="/", **options)


def quiet_gradio_deprecations() -> None:
    """Gradio 6's queue join reads ``starlette.status.HTTP_422_UNPROCESSABLE_ENTITY`` (renamed in Starlette)
    and calls pandas options pandas 3 deprecates: a warning per Generate click in the server log, about
    Gradio's own code, which nothing here can change. Only those messages from gradio's modules are muted."""
    for message in (
        r"'HTTP_422_UNPROCESSABLE_ENTITY' is deprecated",
        r"'future\.no_silent_downcasting' is deprecated",
        r"The copy keyword is deprecated",
    ):
        warnings.filterwarnings("ignore", message=message, module=r"gradio\.")


def studio_login(keys: Sequence[str]) -> Callable[[str, str], bool]:
    """Gradio's auth check: any user name with one of the API keys as the password."""
    from api.auth import matching_key

    def check(_username: str, password: str) -> bool:
        return matching_key(password, keys) is not None

    return check


def open_share_link(host: str, port: int) -> None:
    """A public *.gradio.live tunnel to this server (needs internet; failures are logged, not fatal)."""
    from gradio import networking

    def run() -> None:
        try:
            local = "127.0.0.1" if host in ("0.0.0.0", "::") else host
            url = networking.setup_tunnel(local, port, secrets.token_urlsafe(32), None, None)
            log.info("public share link: %s", url)
        except Exception as err:  # the tunnel is optional: the local server keeps running
            log.error("could not open a share link: %s", err)

    threading.Thread(target=run, name="share-tunnel", daemon=True).start()


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.replicas > 0:  # Ray Serve serves the same app; this process only starts it and waits
        from cluster.application import run_local

        run_local(args)
        return
    cfg = engine_config(args)
    engine = build_engine(cfg)
    app = create_app(
        engine, ui_lang=args.ui_lang, limits=cfg.limits, api_key=args.api_key,
        random_weights=cfg.model == DEMO_TINY,
    )  # fmt: skip
    if args.share:
        open_share_link(args.host, args.port)
    web_server(app, args.host, args.port, cfg.model).run()


def web_server(app: FastAPI, host: str, port: int, model: str) -> uvicorn.Server:
    """uvicorn for ``app``; "CosyStream on http://..." is logged once the socket listens (port 0: the port
    the system picked), after the lifespan has warmed the engine, so the URL it gives answers at once."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started:
                for server in self.servers:
                    for sock in server.sockets:
                        bound_host, bound_port = sock.getsockname()[:2]
                        log.info("CosyStream on http://%s:%d (model %s)", bound_host, bound_port, model)

    return Server(uvicorn.Config(app, host=host, port=port, log_level="info"))


if __name__ == "__main__":
    main()
