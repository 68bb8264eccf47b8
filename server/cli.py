"""The server's command line: flags -> ``EngineConfig``, the engine built once (``build_engine``) and shared
by the UI and the API (``server.web``), or Ray Serve replicas (``cluster/``) with ``--replicas``.

Nothing heavy is imported at module level: torch, gradio and the engine load inside the functions.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from engine.config import (
    DEFAULT_MODEL,
    DEMO_TINY,
    MODEL_HELP,
    EngineConfig,
    Flags,
    Limits,
    StreamConfig,
    add_device_flags,
    add_fast_start_flag,
    add_first_lane_flags,
    add_flow_aot_flag,
    add_flow_attention_flag,
    add_flow_compile_flags,
    add_flow_reuse_flags,
    add_lm_handover_flags,
    add_model_flag,
    add_number,
    add_overlap_flags,
    add_switch,
    fast_start_choice,
)
from engine.serving.startup import Timeline
from webui.texts import UI_LANG_CHOICES


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


class HelpFormatter(argparse.HelpFormatter):
    """``--help`` shows every flag's default after its help, unless the help already says what it is (an
    ``auto`` resolved at load, an environment variable)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if not action.option_strings or action.default is argparse.SUPPRESS or "default" in text.lower():
            return text
        if action.default is None:  # a paired --no-X flag: its --X says the default
            return text
        shown = "off" if action.default is False else "%(default)s"
        return f"{text} (default: {shown})"


ENV_DEFAULTS = {  # flags whose default an environment variable sets (the Docker image, a Space)
    "--model": "COSYSTREAM_MODEL",
    "--device": "COSYSTREAM_DEVICE",
    "--cache-dir": "COSYSTREAM_CACHE",
    "--api-key": "COSYSTREAM_API_KEY",
}
# more flags, shell-quoted, for hosts that set variables but no command line (a Space): before the command
# line's, which win where both give one
ENV_FLAGS = "COSYSTREAM_ARGS"
EPILOG = (
    "Environment: " + ", ".join(f"{env} ({flag})" for flag, env in ENV_DEFAULTS.items())
    + f"; {ENV_FLAGS}: more flags, e.g. '--no-lm-handover --single-stream-graphs-at-load'."
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """The server's flags in their ``--help`` groups (docs/configuration.md is checked against it)."""
    p = argparse.ArgumentParser(
        prog="cosystream", description="Streaming CosyVoice2/3 studio and speech API.",
        formatter_class=HelpFormatter, epilog=EPILOG,
    )  # fmt: skip
    add_serving_flags(p.add_argument_group("serving"))
    add_model_flags(p.add_argument_group("model"))
    add_limit_flags(p.add_argument_group("limits (docs/limits.md)"))
    add_gpu_flags(p.add_argument_group("GPU tuning (ignored on the CPU)"))
    add_cluster_flags(p)
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(_with_env_flags(p, argv))
    if not 0 <= args.shutdown_grace_s <= 600:
        p.error(f"--shutdown-grace-s must be within [0, 600], got {args.shutdown_grace_s}")
    if args.replicas < 0:
        p.error(f"--replicas must be >= 0, got {args.replicas}")
    if args.replicas and args.share:
        p.error("--share opens a tunnel to one process: put a proxy in front of the cluster instead")
    try:
        engine_config(args)  # the config's own checks (ranges, combinations) answer as usage errors too
    except ValueError as err:
        p.error(str(err))
    return args


def _with_env_flags(p: argparse.ArgumentParser, argv: Sequence[str] | None) -> list[str]:
    """``ENV_FLAGS``'s flags, then the command line's (``sys.argv`` where ``argv`` is None)."""
    extra = os.environ.get(ENV_FLAGS, "")
    try:
        flags = shlex.split(extra)
    except ValueError as err:  # an unclosed quote
        p.error(f"{ENV_FLAGS} ({extra!r}): {err}")
    return flags + list(sys.argv[1:] if argv is None else argv)


def add_serving_flags(g: Flags) -> None:
    """Where the studio and the API listen, who may call them, how they stop."""
    g.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 to serve the network)")
    g.add_argument("--port", type=int, default=7860, help="the studio at /, the API under /v1")
    g.add_argument("--share", action="store_true", help="also open a public Gradio share link")
    g.add_argument(
        "--api-key", action="append", default=None,
        help="a bearer key the API requires; repeat for several (each its own voice namespace). The studio "
        "then asks for a login: any user name, one of the keys as the password (default: "
        "COSYSTREAM_API_KEY, comma-separated; unset: no key)",
    )  # fmt: skip
    g.add_argument(
        "--ui-lang", choices=UI_LANG_CHOICES, default="auto",
        help="language of the web UI (auto: the browser's; zh or en force one)",
    )  # fmt: skip
    g.add_argument(
        "--shutdown-grace-s", type=float, default=5.0,
        help="on SIGINT/SIGTERM, streams in flight get this long to finish before they end with an error; "
        "new requests get 503 at once, a second signal exits at once",
    )  # fmt: skip
    g.add_argument(
        "--profile-startup", type=Path, default=None, metavar="DIR",
        help="diagnostics: sample each start-up phase's thread every 10 ms and write where its time went to "
        "DIR (a summary .txt and flame-graph stacks .folded per phase; default: none)",
    )  # fmt: skip


def add_model_flags(g: Flags) -> None:
    """Which checkpoint, where it runs, where its files and the saved voices live."""
    model = os.environ.get("COSYSTREAM_MODEL", DEFAULT_MODEL)
    add_model_flag(g, model, f"{MODEL_HELP}; env COSYSTREAM_MODEL")
    add_device_flags(g, os.environ.get("COSYSTREAM_DEVICE", "auto"), llm_variant=True)
    g.add_argument(
        "--asr-model", default="auto",
        help="Whisper that transcribes prompts: auto (large-v3-turbo on GPU, small on CPU), a Hugging Face "
        f"id or local dir, or none; '{DEMO_TINY}' uses a tiny random-weight Whisper",
    )  # fmt: skip
    add_fast_start_flag(g)
    g.add_argument(
        "--cache-dir", default=None,
        help="the cache root: models, compile caches (Inductor, Triton, vLLM) and saved voices "
        "(default: COSYSTREAM_CACHE, else ~/.cache/cosystream)",
    )  # fmt: skip
    g.add_argument(
        "--voices-dir", default=None,
        help="saved voices (default: the cache's voices/); with replicas on several hosts, a shared mount",
    )  # fmt: skip


def add_limit_flags(g: Flags) -> None:
    """What one caller may ask for and how many may ask at once (``engine.config.Limits``)."""
    g.add_argument(
        "--max-concurrency", type=_positive_int, default=Limits.max_concurrency,
        help="requests computing at once (engine slots and the UI's GPU queue)",
    )  # fmt: skip
    g.add_argument("--max-queue", type=int, default=Limits.max_queue, help="requests waiting for a slot")
    g.add_argument(
        "--max-text-chars", type=_positive_int, default=Limits.max_text_chars,
        help="characters of text, prompt transcript or instruction in one request",
    )  # fmt: skip
    g.add_argument(
        "--max-upload-mb", type=float, default=Limits.max_upload_bytes / 2**20,
        help="an uploaded or base64 audio file, in MiB",
    )  # fmt: skip
    g.add_argument(
        "--max-prompt-s", type=float, default=Limits.max_prompt_s, help="prompt audio in seconds, at most 30"
    )
    g.add_argument(
        "--request-timeout-s", type=float, default=Limits.request_timeout_s,
        help="a request's whole time in the engine, in seconds",
    )  # fmt: skip
    g.add_argument(
        "--admit-slack-s", type=float, default=Limits.admit_slack_s,
        help="admission by SLO: refuse new requests (429 + Retry-After) while a running stream has this "
        "little playback slack left (s; default: slots alone)",
    )  # fmt: skip
    g.add_argument(
        "--allow-forced-tokens", action="store_true",
        help="benchmarks over HTTP: the API honours forced_tokens (a fixed length; not for a public server)",
    )  # fmt: skip


def add_gpu_flags(g: Flags) -> None:
    """The flow solver, CUDA graphs, vLLM's memory and CUDA MPS: none of them changes the audio's words."""
    g.add_argument(
        "--flow-dtype", choices=("bfloat16", "float32"), default=EngineConfig.flow_dtype,
        help="GPU flow solver precision (float32: the reference's, slower under load)",
    )  # fmt: skip
    add_flow_attention_flag(g)
    add_flow_compile_flags(g)
    add_flow_aot_flag(g)
    add_switch(g, "flow-precompiled")
    add_switch(g, "flow-step-graphs")
    add_switch(g, "flow-compile-child")
    add_switch(g, "flow-voice-pages")
    add_switch(g, "native-lm-graphs")
    add_flow_reuse_flags(g)
    add_overlap_flags(g)
    add_lm_handover_flags(g)
    add_first_lane_flags(g)
    add_switch(g, "lm-fork-server")
    add_switch(g, "lm-start-after-ready")
    add_switch(g, "lm-host")
    add_switch(g, "weights-onto-device")
    add_switch(g, "t2w-own-stream")
    add_switch(g, "lm-host-prefix")
    add_switch(g, "single-stream-graphs-at-load")
    add_number(g, "gil-switch-ms")
    add_number(g, "t2w-kept-prompts")
    add_switch(g, "t2w-prompt-in-frontend")
    g.add_argument(
        "--flow-reuse-gb", type=float, default=EngineConfig.flow_reuse_gb,
        help="memory all streams' flow frame caches may hold together (GiB); past it, streams recompute. "
        "Default: 4 eager; with CUDA graphs 40%% of the memory free after vLLM starts",
    )  # fmt: skip
    g.add_argument(
        "--ready-graph-wait-s", type=float, default=EngineConfig.ready_graph_wait_s,
        help="after the warm-up, ready waits up to this long (s) for the background graphs and the flow's "
        "programs, so the first requests meet none of them in flight (default: 0, ready at once)",
    )  # fmt: skip
    g.add_argument(
        "--graph-warmup-s", type=float, default=EngineConfig.graph_warmup_s,
        help="capture the flow/HiFT CUDA graphs for mel up to this many seconds at load; 0: on first use",
    )  # fmt: skip
    g.add_argument(
        "--gpu-memory-utilization", type=float, default=EngineConfig.gpu_memory_utilization,
        help="share of GPU memory vLLM takes for the speech LM (weights + KV cache) with --lm-kv-cache-gib 0",
    )  # fmt: skip
    g.add_argument(
        "--lm-kv-cache-gib", type=float, default=EngineConfig.lm_kv_cache_gib,
        help="vLLM's KV cache at this size (GiB; 6 hold 128 streams of 4096 tokens): vLLM then skips "
        "profiling the device's memory, so the first graphs are captured beside its start; 0: what "
        "--gpu-memory-utilization leaves after it profiles, and the first graphs after it",
    )  # fmt: skip
    g.add_argument(
        "--graphs-before-serving", dest="background_graphs", action="store_false",
        help="capture every CUDA graph before serving (default: the first of each kind, the rest in the "
        "background while requests run uncaptured)",
    )  # fmt: skip
    g.add_argument(
        "--first-graphs-early", action=argparse.BooleanOptionalAction, default=None,
        help="capture the first CUDA graphs while vLLM's engine core starts, not after it (default: where "
        "vLLM's KV cache has a fixed size, --lm-kv-cache-gib; forced on, it races vLLM's memory profiling)",
    )  # fmt: skip


def add_cluster_flags(p: argparse.ArgumentParser) -> None:
    """Scale-out (``cluster/``, needs requirements-cluster.txt): engine replicas on Ray Serve."""
    g = p.add_argument_group("scale out on Ray Serve (pip install -r requirements-cluster.txt)")
    g.add_argument(
        "--replicas", type=int, default=0,
        help="N >= 1: start a local Ray with N engine replicas behind one ingress (0: one process, no Ray)",
    )  # fmt: skip
    g.add_argument("--min-replicas", type=_positive_int, default=1, help="autoscaling floor")
    g.add_argument(
        "--max-replicas", type=_positive_int, default=None, help="set to autoscale (default: a fixed count)"
    )
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
        lm_kv_cache_gib=args.lm_kv_cache_gib or None,  # 0: sized by vLLM
        flow_dtype=args.flow_dtype,
        flow_attention=args.flow_attention,
        flow_compile=args.flow_compile,
        flow_aot=args.flow_aot,
        flow_precompiled=args.flow_precompiled,
        flow_step_graphs=args.flow_step_graphs,
        lm_native_graphs=args.native_lm_graphs,
        flow_reuse=args.flow_reuse,
        cuda_mps=args.cuda_mps,
        mps_flow_percent=args.mps_flow_percent,
        mps_flow_below_normal=args.mps_flow_below_normal,
        flow_reuse_gb=args.flow_reuse_gb,
        gil_switch_ms=args.gil_switch_ms,
        t2w_kept_prompts=args.t2w_kept_prompts,
        t2w_prompt_in_frontend=args.t2w_prompt_in_frontend,
        graph_warmup_s=args.graph_warmup_s,
        background_graphs=args.background_graphs,
        first_graphs_early=args.first_graphs_early,
        single_stream_graphs_at_load=args.single_stream_graphs_at_load,
        ready_graph_wait_s=args.ready_graph_wait_s,
        lm_handover=args.lm_handover,
        lm_fork_server=args.lm_fork_server,
        weights_onto_device=args.weights_onto_device,
        lm_start_after_ready=args.lm_start_after_ready,
        lm_host=args.lm_host,
        flow_compile_child=args.flow_compile_child,
        flow_voice_pages=args.flow_voice_pages,
        t2w_first_lane=args.t2w_first_lane,
        cache_dir=args.cache_dir,
        voices_dir=args.voices_dir,
        limits=limits,
        stream=StreamConfig(
            fast_start=fast_start_choice(args.fast_start), fast_start_trim=args.fast_start_trim
        ),
        asr_model=args.asr_model,
    )


def build_engine(
    cfg: EngineConfig,
    timeline: Timeline | None = None,
    idle_work: Sequence[tuple[str, Callable[[], object]]] = (),
) -> Any:
    """Load the checkpoint (downloading it on first use) and return the resident engine.

    ``demo-tiny`` writes a tiny random-weight model in the released layout first (offline, seconds), so the
    whole stack runs on a fresh CPU machine; its audio is noise and the UI says so. With ``--asr-model auto``
    it gets a tiny random-weight Whisper too (its transcripts are noise, and the UI says so as well).
    ``idle_work`` runs while the engine waits for its LM backend's start (``TTSEngine.load``).
    """
    timeline = timeline or Timeline()
    with timeline.phase("engine import"):
        from engine.serving.engine import TTSEngine  # torch and the models load here, not at import

    if cfg.model != DEMO_TINY:
        return TTSEngine.load(cfg, timeline=timeline, idle_work=idle_work)
    from engine.demo.make_model import demo_tiny

    with timeline.phase("demo model"):  # built on the first start, reused after (under the cache root)
        cfg, model_dir = demo_tiny(cfg)
    return TTSEngine.load(cfg, model_dir=model_dir, timeline=timeline, idle_work=idle_work)
