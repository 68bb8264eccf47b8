"""``python -m bench``: sweep concurrency x modes with fixed-length requests; write JSON, markdown, a plot.

    python -m bench --random-full v3 --concurrency 1,4,16,64,128 --modes stream,offline --tokens 250 \\
        --baseline --out bench-results/v3 --hardware "1x NVIDIA H200"
    python -m bench --random-tiny v2 --concurrency 1,2 --tokens 60 --out /tmp/bench   # CPU smoke run
    python -m bench --url http://127.0.0.1:7860 --concurrency 1,4 --out /tmp/http     # a running server
    python -m bench --random-full v3 --arrivals poisson --rate 1,2,4 --arrival-s 60 --concurrency 64 \
        --modes stream --out bench-results/v3-open     # open loop: Poisson arrivals, 64 engine slots
    python -m bench --random-full v3 --arrivals poisson --find-capacity --rate 2,3,4,5,6 --concurrency 96 \
        --modes stream --trace --out bench-results/v3-capacity   # the highest rate within the SLO

An open-loop rate is 120 s of arrivals (--arrival-s; rate x 120 requests) run once per arrival seed (--seeds,
default 0,1), its TTFA reported whole and per 30-s window of arrivals (--window-s): flat windows are a
steady state, rising ones a queue still building. A capacity search counts a rate met only when every seed
meets the SLO.

Random-weight model directories are built once into ``<cache-dir>/bench/<family>-<size>`` and reused.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import logging
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.load import EngineTarget, HttpTarget, Level, Target, Workload, prompt_audio, prompt_set, run_level
from bench.report import write_report
from engine.config import (
    FAST_START_CHOICES,
    EngineConfig,
    StreamConfig,
    add_device_flags,
    add_fast_start_flag,
    add_first_lane_flags,
    add_flow_aot_flag,
    add_flow_attention_flag,
    add_flow_compile_flags,
    add_flow_reuse_flags,
    add_model_flag,
    add_number,
    add_overlap_flags,
    add_switch,
    fast_start_flag,
)

log = logging.getLogger("bench")
FAMILIES = {"v2": "cosyvoice2", "v3": "cosyvoice3"}
MODES = ("stream", "offline")


def int_list(text: str) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"concurrency levels must be >= 1, got {text!r}")
    return values


def rate_list(text: str) -> list[float]:
    try:
        values = sorted({float(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or values[0] <= 0:
        raise argparse.ArgumentTypeError(f"rates must be > 0 requests per second, got {text!r}")
    return values


def seed_list(text: str) -> list[int]:
    try:
        values = list(dict.fromkeys(int(v) for v in text.split(",") if v.strip()))  # as given, once each
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"seeds are integers >= 0, got {text!r}")
    return values


def mode_list(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        raise argparse.ArgumentTypeError(f"modes are a comma-separated subset of {MODES}, got {text!r}")
    return modes


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    add_model_flag(src, None, "a model directory or hub id (real or random weights)")
    src.add_argument(
        "--random-full", choices=sorted(FAMILIES), help="full-size random weights, released layout"
    )
    src.add_argument("--random-tiny", choices=sorted(FAMILIES), help="tiny random weights (CPU smoke runs)")
    p.add_argument("--url", help="drive a running server's HTTP API instead of an in-process engine")
    p.add_argument("--concurrency", type=int_list, default=[1, 4, 16], help="levels, e.g. 1,4,16,64,128")
    p.add_argument(
        "--offline-concurrency", type=int_list, metavar="LEVELS",
        help="offline levels when they differ from --concurrency (e.g. stream 1,16,64; offline 64,128)",
    )  # fmt: skip
    p.add_argument("--modes", type=mode_list, default=list(MODES), help="stream,offline or one of them")
    p.add_argument("--tokens", type=int, default=250, help="speech tokens per request (25 = 1 s of audio)")
    p.add_argument("--requests", type=int, default=0, help="requests per level (at least the concurrency)")
    p.add_argument(
        "--arrivals", choices=("closed", "poisson"), default="closed",
        help="closed: waves of --concurrency workers; poisson: open loop at each --rate (the largest "
        "--concurrency is then the engine's slot count)",
    )  # fmt: skip
    p.add_argument("--rate", type=rate_list, default=[1.0], help="open loop: requests per second, e.g. 1,2,4")
    p.add_argument(
        "--arrival-s", "--duration-s", dest="arrival_s", type=float, default=120.0,
        help="open loop: seconds of arrivals per rate and seed (rate x this many requests; long enough for "
        "the active streams to build up to their steady state)",
    )  # fmt: skip
    p.add_argument(
        "--window-s", type=float, default=30.0,
        help="open loop: TTFA p50/p95 and active streams per this many seconds of arrivals, beside the whole",
    )  # fmt: skip
    p.add_argument(
        "--seeds", type=seed_list, default=[0, 1],
        help="open loop: each rate once per arrival seed (its arrivals and lengths; request i: seed + i), "
        "e.g. 0,1; a capacity search counts a rate met only when every seed meets the SLO",
    )  # fmt: skip
    p.add_argument(
        "--warmup-arrival-s", type=float, default=None, metavar="S",
        help="open loop: S s of arrivals at the first rate before measuring, not measured (default: 20 "
        "with --ab, so neither arm runs on a colder engine; 0 without)",
    )  # fmt: skip
    p.add_argument(
        "--length-spread", type=float, default=0.5,
        help="open loop: lengths uniform in [tokens x (1 - s), tokens x (1 + s)]",
    )  # fmt: skip
    p.add_argument(
        "--find-capacity", action="store_true",
        help="open loop: run the --rate values upwards, stop after the first that misses the SLO (a failed "
        "request, a stream that ran dry, TTFA p95 over --slo-ttfa-ms); results.json records every rate tried "
        "and the capacity",
    )  # fmt: skip
    p.add_argument(
        "--all-rates", action="store_true",
        help="--find-capacity: measure every --rate, not stopping at the first miss (a fixed list in one "
        "load, e.g. 2,3,4,5); the capacity is still the highest rate met below the first miss",
    )  # fmt: skip
    p.add_argument("--slo-ttfa-ms", type=float, default=300.0, help="--find-capacity: the TTFA p95 SLO (ms)")
    p.add_argument(
        "--overload", type=float, default=None, metavar="FACTOR",
        help="--find-capacity, in process: after the search, one rate at FACTOR x the best arm's capacity "
        "(none met: x the lowest rate tried), run without admission by SLO and then with each "
        "--overload-admit-s guard, the same arrivals each time (is the promise to admitted streams kept?)",
    )  # fmt: skip
    p.add_argument(
        "--closed-after", type=int_list, default=None, metavar="LEVELS",
        help="open loop, in process: after the rates (and --overload), closed-loop waves at each of LEVELS "
        "streams in the same load, e.g. 16 (one untimed wave, then --requests or 4 waves of them; with --ab "
        "each arm's)",
    )  # fmt: skip
    p.add_argument(
        "--overload-admit-s", type=rate_list, default=[1.0],
        help="--overload: the admission guards (s of playback slack) of its admitted arms, e.g. 0.5,1.5",
    )  # fmt: skip
    p.add_argument(
        "--min-requests", type=int, default=100,
        help="--find-capacity: arrivals per rate and seed at least (whatever rate x --arrival-s gives)",
    )  # fmt: skip
    p.add_argument(
        "--trace", action="store_true",
        help="open loop, in process: every chunk's timeline (engine.serving.metrics.ChunkTrace) to "
        "OUT/trace.jsonl; "
        "python -m bench.trace summarises it",
    )  # fmt: skip
    p.add_argument("--out", default="bench-results", help="directory for results.json/.md/.png")
    p.add_argument("--baseline", action="store_true", help="also run the reference-style baseline")
    p.add_argument("--baseline-max-concurrency", type=int, default=4, help="it serialises: keep it small")
    add_device_flags(p)
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "cosystream"))
    p.add_argument("--warmup", type=int, default=1, help="untimed bench requests per mode before measuring")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--hardware", default="", help="hardware line for the report (default: this host's CPU)")
    p.add_argument("--api-key", default=None, help="bearer key for --url")
    p.add_argument("--seed", type=int, default=0, help="closed loop: request i uses seed + i")
    p.add_argument(
        "--flow-dtype",
        default=EngineConfig.flow_dtype,
        choices=("float32", "bfloat16"),
        help="GPU flow solver",
    )
    p.add_argument("--no-cuda-graphs", action="store_true", help="run the flow solver eagerly on CUDA")
    p.add_argument("--no-hift-graphs", action="store_true", help="v3: run the HiFT vocoder eagerly on CUDA")
    p.add_argument(
        "--no-ras-graphs", action="store_true", help="vLLM: run the LM's per-step RAS op by op, not replayed"
    )
    p.add_argument(
        "--lm-kv-cache-gib", type=float, default=EngineConfig.lm_kv_cache_gib,
        help="vLLM: its KV cache at this size (GiB), no memory profiling; 0: from its memory share",
    )  # fmt: skip
    add_flow_attention_flag(p)
    add_flow_compile_flags(p)
    add_flow_aot_flag(p)
    add_switch(p, "flow-precompiled")
    add_switch(p, "flow-step-graphs")
    add_switch(p, "flow-voice-pages")
    add_switch(p, "native-lm-graphs")
    add_switch(p, "lm-host")  # vLLM's client in a process of its own: an arm of its own (run.sh ARMS=lm-host)
    add_flow_reuse_flags(p)
    add_overlap_flags(p)
    p.add_argument(
        "--flow-batch",
        type=int,
        default=EngineConfig.flow_batch,
        help="chunks per flow/HiFT call (1: no batching)",
    )
    p.add_argument(
        "--prompt-cache",
        type=int,
        default=EngineConfig.prompt_cache_size,
        help="prompts whose features are kept (0: none)",
    )
    p.add_argument(
        "--admit-slack-s", type=float, default=None,
        help="admission by SLO: refuse new requests while a running stream has this little playback slack "
        "left (s; refused requests count as failed, and apart as refused)",
    )  # fmt: skip
    add_switch(p, "t2w-own-stream")
    add_switch(p, "lm-host-prefix")
    add_number(p, "gil-switch-ms")
    add_number(p, "t2w-kept-prompts")
    add_switch(p, "t2w-prompt-in-frontend")
    p.add_argument(
        "--t2w-fifo", action="store_true", help="token2wav in arrival order (the deadline scheduler's A/B)"
    )
    p.add_argument(
        "--t2w-relaxed-cap", choices=FAST_START_CHOICES, nargs="?", const="on",
        default=fast_start_flag(EngineConfig.t2w_relaxed_cap),
        help="token2wav calls of chunks with plenty of audio buffered kept short, so first chunks do not "
        "wait behind them: on (the flag alone), off, or auto (while a stream has little audio buffered)",
    )  # fmt: skip
    p.add_argument(
        "--no-t2w-yield", action="store_true",
        help="token2wav runs every call whole before the next (no urgent batch between a call's flow and "
        "vocoder: the A/B of EngineConfig.t2w_yield_to_urgent)",
    )  # fmt: skip
    p.add_argument(
        "--t2w-quiet-first", action="store_true",
        help="token2wav holds calls of chunks with plenty of audio buffered while a request's LM decodes its "
        "first chunk (up to 0.25 s; EngineConfig.t2w_quiet_first, off by default)",
    )  # fmt: skip
    add_first_lane_flags(p)
    p.add_argument(
        "--t2w-lane-priority", action="store_true",
        help="the first-chunk lane's calls on a high-priority CUDA stream (EngineConfig.t2w_lane_priority, "
        "off by default)",
    )  # fmt: skip
    p.add_argument(
        "--ab", type=ab_levers, metavar="LEVER[,LEVER]",
        help="open loop, in process: each rate twice in one load, with this switched off (A) and on (B), "
        "alternating which goes first (with several levers, A and one arm per lever, each with only its own "
        "lever on, in order and reversed every other run; a+b: one arm with both on): relaxed-cap: the "
        "rule of --t2w-relaxed-cap (auto or on); "
        "burst-start: the fast start counted by recent starts (StreamConfig.fast_start_burst_s, the "
        "default; A: by requests computing); yield: urgent batches between a relaxed call's flow and "
        "vocoder (A: every call whole); quiet-first: calls of buffered chunks held while a first chunk is "
        "decoded (A: never held, the default); first-lane: a second token2wav worker for first chunks "
        "(the default on a GPU; A: the one worker; its graphs are captured for both); busy-start: the fast "
        "start by recent starts whatever the number computing (StreamConfig.fast_start_busy, the default; "
        "A: not while adaptive hops are on); lane-priority: the first-chunk lane's calls on a high-priority "
        "stream (EngineConfig.t2w_lane_priority; A: a normal one, the default; needs the lane); short-split: "
        "the fast start also where the first chunk's grid offset is 8-11 tokens (StreamConfig.min_first_hop "
        "8; A: 12, the default; see --prompt-spread); prompt-trim: the fast start for every prompt length, "
        "the flow's prompt cut by up to 12 tokens at its start where its offset is short "
        "(StreamConfig.fast_start_trim 12; A: 0, the default; see --prompt-spread); fast-start-on: every "
        "request's first chunk split where its offset allows, whatever the load (StreamConfig.fast_start "
        "on; A: auto, by the load rules); voice-pages: a kept voice's later requests start their first "
        "flow call after its prompt pages (EngineConfig.flow_voice_pages; A: off, the default; needs CUDA "
        "graphs with flow reuse; see --prompt-spread); own-stream: the main token2wav worker's calls on a "
        "CUDA stream of their own, so a new request's prompt embeddings and copies on the default stream "
        "need not wait for them (EngineConfig.t2w_own_stream, the default; A: the default stream); "
        "host-prefix: a request's LM prompt embeddings gathered from a host copy of the LM's tables "
        "(EngineConfig.lm_host_prefix, the default; A: looked up on the device and copied back); "
        "gil-switch: the interpreter's switch interval at 1 ms (A: the engine's, EngineConfig.gil_switch_ms, "
        "else Python's 5 ms); kept-prompts: 64 voices' prompt tensors kept on the device (A: the engine's, "
        "EngineConfig.t2w_kept_prompts, none by default); prompt-in-frontend: a request's flow prompt "
        "tensors made in its frontend's thread (EngineConfig.t2w_prompt_in_frontend; A: the engine's, off "
        "by default: on the event loop as its audio starts); both "
        "arms on "
        "one machine, load and set of graphs; the search goes on while either arm meets the SLO",
    )  # fmt: skip
    add_fast_start_flag(p)
    p.add_argument(
        "--prompt-spread", action="store_true",
        help="open loop: 25 voices whose lengths (3.50-4.46 s) step one speech token through the flow's "
        "25-token chunk grid, request i cloning the (i mod 25)-th, so the first chunks' grid offsets are "
        "a random visitor's (default: the one 3.5-s prompt, whose offset always allows the fast start)",
    )  # fmt: skip
    p.add_argument(
        "--adaptive-hop", choices=FAST_START_CHOICES, default=fast_start_flag(StreamConfig.adaptive_hop),
        help="merge reference chunks while a client has audio buffered (auto: v3 from 8 active streams)",
    )  # fmt: skip
    p.add_argument(
        "--text-workers", type=int, default=-1,
        help="processes for text normalisation (0: a thread; -1: the engine's auto, 4 on a GPU)",
    )  # fmt: skip
    p.add_argument(
        "--graph-warmup-s", type=float, default=None,
        help="mel seconds of flow graphs to pre-capture (default: the engine's, raised to cover the longest "
        "request plus the prompt, so no call runs on an uncaptured shape)",
    )  # fmt: skip
    p.add_argument(
        "--profile-dir", help="after the sweep, profile one streaming wave at each --profile-at level"
    )
    p.add_argument(
        "--profile-at", type=int_list, metavar="LEVELS",
        help="streaming levels to profile (default: 1 and the largest --concurrency)",
    )  # fmt: skip
    p.add_argument(
        "--text-stream",
        type=float,
        metavar="WPS",
        help="text-streaming input (bistream): each request's words arrive at WPS words/s; TTFA then counts "
        "from the first word",
    )
    args = p.parse_args(argv)
    if not (args.url or args.model or args.random_full or args.random_tiny):
        p.error("name a model (--model, --random-full, --random-tiny) or a server (--url)")
    if args.profile_at and not args.profile_dir:
        p.error("--profile-at needs --profile-dir")
    if args.url and args.profile_dir:
        p.error("--profile-dir profiles the in-process engine: run it without --url")
    if args.url and args.baseline:
        p.error("the baseline runs in-process: run it without --url")
    if args.text_stream is not None and (args.url or args.baseline):
        p.error("--text-stream drives the in-process engine: run it without --url and --baseline")
    if args.text_stream is not None and not 0 < args.text_stream <= 1000:
        p.error(f"--text-stream must be within (0, 1000] words/s, got {args.text_stream}")
    if not 1 <= args.tokens <= 3000:
        p.error(f"--tokens must be within [1, 3000], got {args.tokens}")
    if args.arrivals == "poisson" and (args.baseline or args.profile_dir):
        p.error("--baseline and --profile-dir run closed-loop waves: leave them out with --arrivals poisson")
    if args.find_capacity and args.arrivals != "poisson":
        p.error("--find-capacity searches open-loop rates: add --arrivals poisson")
    if args.trace and (args.arrivals != "poisson" or args.url):
        p.error("--trace records open-loop runs of the in-process engine: --arrivals poisson, no --url")
    if args.prompt_spread and args.arrivals != "poisson":
        p.error("--prompt-spread varies the open loop's prompts: add --arrivals poisson")
    if args.ab and (args.arrivals != "poisson" or args.url):
        p.error("--ab switches the in-process engine between open-loop rates: --arrivals poisson, no --url")
    args.ab = args.ab or ()
    levers = ab_lever_set(args.ab)
    if "relaxed-cap" in levers and (args.t2w_relaxed_cap == "off" or args.t2w_fifo):
        p.error("--ab relaxed-cap switches the relaxed rule: no --t2w-relaxed-cap off, no --t2w-fifo")
    if args.t2w_fifo and args.t2w_relaxed_cap == "on":
        p.error("--t2w-fifo (arrival order) has no relaxed rule: leave --t2w-relaxed-cap at auto or off")
    if "yield" in levers and (args.no_t2w_yield or args.t2w_fifo):
        p.error("--ab yield switches the seam in token2wav calls: drop --no-t2w-yield and --t2w-fifo")
    if args.t2w_fifo and args.t2w_quiet_first:
        p.error("--t2w-fifo (arrival order) has no slack to hold calls on: drop --t2w-quiet-first")
    if "quiet-first" in levers and (args.t2w_quiet_first or args.t2w_fifo):
        p.error("--ab quiet-first switches the hold in token2wav: drop --t2w-quiet-first and --t2w-fifo")
    if "lane-priority" in levers and (args.t2w_lane_priority or args.t2w_first_lane is False):
        p.error(
            "--ab lane-priority switches the lane's stream: drop --t2w-lane-priority, --no-t2w-first-lane"
        )
    if "first-lane" in levers and args.t2w_first_lane is not None:
        p.error("--ab first-lane opens the lane for its B arm: drop --t2w-first-lane / --no-t2w-first-lane")
    if "prompt-trim" in levers and args.fast_start_trim:
        p.error("--ab prompt-trim sets the trim for its B arm: drop --fast-start-trim")
    # StreamConfig's own rule (trim <= min_first_hop), for the configured schedule and short-split's B arm
    schedules = {"": StreamConfig.min_first_hop}
    if "short-split" in levers:
        schedules["--ab short-split's "] = SHORT_SPLIT
    for which, first_hop in schedules.items():
        try:
            StreamConfig(min_first_hop=first_hop, fast_start_trim=args.fast_start_trim)
        except ValueError as err:
            p.error(f"--fast-start-trim {args.fast_start_trim} with {which}min_first_hop {first_hop}: {err}")
    for lever in {"burst-start", "busy-start", "short-split", "prompt-trim", "fast-start-on"} & levers:
        if args.fast_start != "auto":
            p.error(f"--ab {lever} switches auto's rule: leave --fast-start at auto")
    if args.overload is not None and (not args.find_capacity or args.url or args.overload <= 0):
        p.error("--overload follows the in-process capacity search: --find-capacity, no --url, FACTOR > 0")
    if any(not 0 <= s <= 10 for s in args.overload_admit_s):
        p.error("--overload-admit-s: guards within [0, 10] s")
    if args.slo_ttfa_ms <= 0 or args.min_requests < 1:
        p.error("--slo-ttfa-ms must be > 0 and --min-requests >= 1")
    if args.closed_after and (args.arrivals != "poisson" or max(args.closed_after) > busiest(args)):
        p.error("--closed-after follows an open loop (--arrivals poisson), at most --concurrency streams")
    if args.all_rates and not args.find_capacity:
        p.error("--all-rates measures a capacity search's every rate: add --find-capacity")
    if args.arrival_s <= 0 or args.window_s <= 0:
        p.error(f"--arrival-s and --window-s must be > 0 s, got {args.arrival_s} and {args.window_s}")
    if args.warmup_arrival_s is None:
        args.warmup_arrival_s = 20.0 if args.ab else 0.0
    if args.warmup_arrival_s < 0:
        p.error(f"--warmup-arrival-s must be >= 0 s, got {args.warmup_arrival_s}")
    if not 0 <= args.length_spread < 1 or args.tokens * (1 + args.length_spread) > 3000:
        p.error("--length-spread must be within [0, 1) and keep the longest request at most 3000 tokens")
    return args


# ------------------------------------------------------------------------------------------- the model


def random_model(family: str, size: str, cache_dir: str | Path) -> Path:
    """A random-weight model directory, built once (atomically: a half-written one is never reused)."""
    from engine.demo.make_model import build_model_dir

    target = Path(cache_dir) / "bench" / f"{family}-{size}"
    if (target / ".complete").is_file():
        return target
    staging = target.with_name(target.name + f".partial-{os.getpid()}")
    log.info("building a %s %s random-weight model in %s (once)", size, family, target)
    build_model_dir(staging, family, size)
    (staging / ".complete").write_text("built by python -m bench\n")
    staging.rename(target)
    return target


def model_source(args: argparse.Namespace) -> str:
    if args.random_full:
        return str(random_model(FAMILIES[args.random_full], "full", args.cache_dir))
    if args.random_tiny:
        return str(random_model(FAMILIES[args.random_tiny], "tiny", args.cache_dir))
    return str(args.model)


def load_engine(args: argparse.Namespace) -> Any:
    from engine.serving.engine import TTSEngine

    return TTSEngine.load(engine_config(args))


# the bench's prompt (bench.load.prompt_audio) and a bucket's worth of margin, s
PROMPT_S, MARGIN_S = 3.5, 1.0


def warmup_s(args: argparse.Namespace) -> float:
    """``--graph-warmup-s``, or the engine's default raised to the longest flow call the run makes: its
    longest request's audio (25 tokens a second) after the prompt."""
    if args.graph_warmup_s is not None:
        return float(args.graph_warmup_s)
    longest = args.tokens * (1 + (args.length_spread if args.arrivals == "poisson" else 0.0)) / 25.0
    return max(EngineConfig.graph_warmup_s, longest + PROMPT_S + MARGIN_S)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The flags -> the engine's config (one slot per request of the busiest level: no queueing inside)."""
    from engine.config import Limits, fast_start_choice

    most = busiest(args)
    return EngineConfig(
        model=model_source(args),
        device=args.device,
        backend=args.backend,
        cache_dir=args.cache_dir,
        voices_dir=str(Path(args.cache_dir) / "bench" / "voices"),
        limits=Limits(max_concurrency=most, max_queue=most, admit_slack_s=args.admit_slack_s),
        flow_dtype=args.flow_dtype,
        flow_attention=args.flow_attention,
        cuda_graphs=not args.no_cuda_graphs,
        hift_graphs=not args.no_hift_graphs,
        flow_compile=args.flow_compile,
        flow_aot=args.flow_aot,
        flow_precompiled=args.flow_precompiled,
        flow_step_graphs=args.flow_step_graphs,
        # --ab voice-pages: the voices' windows captured at load, the store used per arm
        flow_voice_pages=args.flow_voice_pages or "voice-pages" in ab_lever_set(args.ab),
        lm_native_graphs=args.native_lm_graphs,
        flow_reuse=args.flow_reuse,
        graph_warmup_s=warmup_s(args),
        flow_batch=args.flow_batch,
        prompt_cache_size=args.prompt_cache,
        t2w_own_stream=args.t2w_own_stream,
        # --ab host-prefix: the host's table built at load, then switched per arm
        lm_host_prefix=True if "host-prefix" in ab_lever_set(args.ab) else args.lm_host_prefix,
        gil_switch_ms=args.gil_switch_ms,
        t2w_kept_prompts=args.t2w_kept_prompts,
        t2w_prompt_in_frontend=args.t2w_prompt_in_frontend,
        cuda_mps=args.cuda_mps,
        mps_flow_percent=args.mps_flow_percent,
        mps_flow_below_normal=args.mps_flow_below_normal,
        t2w_fifo=args.t2w_fifo,
        t2w_relaxed_cap=fast_start_choice(args.t2w_relaxed_cap),
        t2w_yield_to_urgent=not args.no_t2w_yield,
        t2w_quiet_first=args.t2w_quiet_first,
        # --ab first-lane, lane-priority: the lane built at load, then switched per arm
        t2w_first_lane=(
            True if {"first-lane", "lane-priority"} & ab_lever_set(args.ab) else args.t2w_first_lane
        ),
        t2w_lane_priority=args.t2w_lane_priority,
        stream=StreamConfig(
            fast_start=fast_start_choice(args.fast_start),
            adaptive_hop=fast_start_choice(args.adaptive_hop),
            fast_start_trim=args.fast_start_trim,
        ),
        text_workers=None if args.text_workers < 0 else args.text_workers,
        lm_profile_dir=getattr(args, "lm_profile_dir", None),  # bench.overlap --lm-profile
        lm_ras_graphs=not args.no_ras_graphs,
        lm_kv_cache_gib=args.lm_kv_cache_gib or None,  # 0: sized by vLLM
        lm_host=args.lm_host,
        lm_handover=False,  # every request measured on vLLM, none on the native loop serving while it starts
    )


# ------------------------------------------------------------------------------------------- the runs


# Save the levels finished so far (with the run's info): called after every level, so a run cut short (a
# GPU lease's time limit, a crash at 128 streams) keeps what it measured.
SaveRun = Callable[[list[Level], dict[str, Any]], object]
Save = Callable[[list[Level]], object]


async def sweep(
    target: Target, args: argparse.Namespace, levels: Sequence[int], save: Save, done: Sequence[Level] = ()
) -> list[Level]:
    """Every mode x concurrency level; ``done``: levels of earlier sweeps in this run (saved with these)."""
    if args.arrivals == "poisson":
        return await open_sweep(target, args, save)
    prompt = prompt_audio()
    out: list[Level] = []
    for mode in args.modes:
        workload = Workload(tokens=args.tokens, stream=mode == "stream", text_wps=args.text_stream)
        if args.warmup:
            await run_level(target, workload, 1, args.warmup, prompt, seed=10**6)
        for c in mode_levels(args, mode, levels):
            if args.warmup and c > 1:  # the same shapes once untimed (CUDA graphs capture per batch bucket)
                await run_level(target, workload, c, c, prompt, seed=10**6)
            level = await run_level(target, workload, c, max(args.requests, c), prompt, args.seed)
            log.info(_line(level))
            _check_length(level, args.tokens)
            out.append(level)
            save([*done, *out])
    return out


def busiest(args: argparse.Namespace) -> int:
    """The largest level of any mode: the engine's (or the HTTP client's) slots."""
    return max(args.concurrency + (args.offline_concurrency or []))


def mode_levels(args: argparse.Namespace, mode: str, levels: Sequence[int]) -> Sequence[int]:
    """A closed sweep's levels for ``mode``: ``--offline-concurrency`` replaces the engine's offline ones
    (the baseline's small levels stay as given)."""
    if mode == "offline" and args.offline_concurrency and levels == args.concurrency:
        return args.offline_concurrency
    return levels


async def open_sweep(target: Target, args: argparse.Namespace, save: Save) -> list[Level]:
    """Every mode x rate x seed (x arm), open loop, after a warm-up load; ``--requests`` raises a level's
    arrivals above rate x ``--arrival-s``."""
    prompt = prompt_set(args.prompt_spread)
    out: list[Level] = []
    if args.trace:  # this run's traces only
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "trace.jsonl").unlink(missing_ok=True)

    def keep(level: Level) -> None:
        """A finished level: saved with the run so far (a cut run keeps it), its chunk traces appended."""
        out.append(level)
        save(out)
        if args.trace:
            write_trace(Path(args.out) / "trace.jsonl", level)

    for mode in args.modes:
        workload = Workload(tokens=args.tokens, stream=mode == "stream")
        if args.warmup:
            await run_level(target, workload, 1, args.warmup, prompt[0], seed=10**6)
        await warmup_load(target, workload, args, prompt)  # every voice's features cached before measuring
        by_arm = await search(target, workload, args, prompt, keep)
        if args.overload:
            for level in await overload_levels(target, workload, args, prompt, by_arm):
                keep(level)
        for level in await closed_after(target, workload, args):
            out.append(level)  # no chunk traces: bench.trace reads the open loop's by rate
            save(out)
    return out


async def closed_after(target: Target, workload: Workload, args: argparse.Namespace) -> list[Level]:
    """--closed-after: closed-loop waves at each level in the load the open loop warmed (the bench's one
    prompt, one untimed wave first, then ``--requests`` or 4 waves); with --ab each arm's waves, which arm
    first alternating by level, the arm's name after the system's as in the open loop."""
    out = []
    for i, c in enumerate(args.closed_after or ()):
        for arm in arms_at(args, i):
            switch_arm(target.engine, args.ab, arm)  # type: ignore[attr-defined]
            await run_level(target, workload, c, c, prompt_audio(), seed=10**6)
            level = await run_level(target, workload, c, max(args.requests, 4 * c), prompt_audio(), args.seed)
            level = dataclasses.replace(level, system=level.system + arm)
            log.info("closed loop after the open loop: %s", _line(level))
            out.append(level)
    return out


async def warmup_load(target: Target, workload: Workload, args: argparse.Namespace, prompt: Any) -> None:
    """``--warmup-arrival-s`` of arrivals at the first rate, not measured: the first measured run (either
    arm of an A/B) then meets an engine as warm as the ones after it."""
    if not args.warmup_arrival_s:
        return
    from bench.open_loop import OpenLoop, run_open_level

    rate = args.rate[0]
    load = OpenLoop(rate, max(1, round(rate * args.warmup_arrival_s)), args.length_spread)
    log.info("warm-up load: %d arrivals at %.2f requests/s (not measured)", load.requests, rate)
    await run_open_level(target, workload, load, prompt, 10**6, args.window_s)


async def search(
    target: Target, workload: Workload, args: argparse.Namespace, prompt: Any, keep: Callable[[Level], None]
) -> dict[str, list[Level]]:
    """The rates upwards, each once per seed and arm; with --find-capacity an arm stops after the first
    rate any seed of it missed (every seed of that rate still runs), unless --all-rates."""
    missed: set[str] = set()  # arms whose search has stopped
    by_arm: dict[str, list[Level]] = {}
    turn = 0  # which arm goes first alternates per (rate, seed)
    for rate in args.rate:
        missing: set[str] = set()
        for seed in args.seeds:
            for arm in arms_at(args, turn):
                if arm in missed:
                    continue
                level = await open_level(target, workload, args, rate, prompt, arm, seed)
                by_arm.setdefault(arm, []).append(level)
                keep(level)
                if misses := slo(args).misses(level) if args.find_capacity else []:
                    log.info("%s at %.2f requests/s, seed %d misses the SLO (%s)",
                             level.system, rate, seed, "; ".join(misses))  # fmt: skip
                    missing.add(arm)
            turn += 1
        if not args.all_rates:  # the rates above cost more time and would miss too
            missed |= missing
        if missed >= set(arms_at(args, 0)):
            break
    return by_arm


OVERLOAD = " overload"  # the system suffix of --overload's levels: they are not rates of the search


def overload_rate(args: argparse.Namespace, by_arm: dict[str, list[Level]]) -> tuple[float, str]:
    """--overload's rate (requests/s) and the search arm it runs as: FACTOR x the highest capacity among
    the arms (a tie goes to the --ab arm); when no arm met the SLO, FACTOR x the lowest rate tried."""
    from bench.open_loop import capacity

    found: dict[str, float | None] = {
        arm: capacity(levels, slo(args))["capacity_rate"]  # type: ignore[misc]
        for arm, levels in by_arm.items()
    }
    best = max(found, key=lambda arm: (found[arm] or 0.0, bool(arm)))
    base = found[best]
    if base is None:
        base = min(args.rate)
        log.warning("no arm met the SLO: --overload is %g x the lowest rate (%g/s)", args.overload, base)
    return args.overload * base, best


async def overload_levels(
    target: Target, workload: Workload, args: argparse.Namespace, prompt: Any, by_arm: dict[str, list[Level]]
) -> list[Level]:
    """--overload: one rate past capacity, without admission by SLO, then with each guard of
    --overload-admit-s; the same arrivals (seed) each time, the best search arm's switch set."""
    from bench.open_loop import run_open_level

    rate, arm = overload_rate(args, by_arm)
    engine = target.engine  # type: ignore[attr-defined]
    switch_arm(engine, args.ab, arm)
    out = []
    for guard in [None, *args.overload_admit_s]:
        engine.admission.slack_guard_s = guard
        load = open_load(args, rate)
        level = await run_open_level(target, workload, load, prompt, args.seeds[0], args.window_s)
        suffix = OVERLOAD + ("" if guard is None else f" admit {guard:g} s")
        level = dataclasses.replace(level, system=level.system + arm + suffix)
        log.info("%s, %.2f requests/s, %d refused", _line(level), rate, level.refused)
        out.append(level)
    engine.admission.slack_guard_s = args.admit_slack_s  # as configured again
    return out


BURST_S = StreamConfig.fast_start_burst_s  # --ab burst-start's window (B); A counts requests computing
SHORT_SPLIT = 8  # --ab short-split's StreamConfig.min_first_hop (B; tokens): 0.32 s of audio first
PROMPT_TRIM = StreamConfig.min_first_hop  # --ab prompt-trim's StreamConfig.fast_start_trim (B; tokens)


def _relaxed_cap(engine: Any, on: bool) -> None:
    """A: never; B: the rule as configured (auto by default, always with --t2w-relaxed-cap)."""
    engine.token2wav.scheduler.relaxed_cap = engine.cfg.t2w_relaxed_cap if on else False


def _burst_start(engine: Any, on: bool) -> None:
    _set_stream(engine, fast_start_burst_s=BURST_S if on else None)


def _busy_start(engine: Any, on: bool) -> None:
    """A: no split while adaptive_min_active or more compute; B: the burst rule alone (the default)."""
    _set_stream(engine, fast_start_busy=on)


def _short_split(engine: Any, on: bool) -> None:
    """A: the split where the first chunk's grid offset is >= 12 tokens (the default); B: >= 8."""
    first_hop = SHORT_SPLIT if on else StreamConfig.min_first_hop
    _set_stream(engine, min_first_hop=first_hop)


def _prompt_trim(engine: Any, on: bool) -> None:
    """A: the split only where the prompt leaves a grid offset of >= 12 tokens (the default); B: every
    prompt, its flow's prompt cut by up to 12 tokens at the start where it leaves less."""
    _set_stream(engine, fast_start_trim=PROMPT_TRIM if on else 0)


def _fast_start_on(engine: Any, on: bool) -> None:
    """A: auto (by its load rules); B: every request's first chunk split where its grid offset allows,
    whatever the load (StreamConfig.fast_start on)."""
    _set_stream(engine, fast_start=True if on else None)


def _set_stream(engine: Any, **fields: Any) -> None:
    """The engine's StreamConfig with ``fields`` replaced, read per request: the next ones see it."""
    engine.cfg = dataclasses.replace(engine.cfg, stream=dataclasses.replace(engine.cfg.stream, **fields))


def _yield(engine: Any, on: bool) -> None:
    """A: every token2wav call whole before the next; B: urgent batches at a relaxed call's seam."""
    engine.token2wav.scheduler.yield_to_urgent = on


def _quiet_first(engine: Any, on: bool) -> None:
    """A: calls of buffered chunks run as they come; B: held while a first chunk is being decoded."""
    engine.token2wav.scheduler.quiet_first = on


def _first_lane(engine: Any, on: bool) -> None:
    """A: the one token2wav worker; B: first chunks also taken by the first-chunk lane (opened at load)."""
    engine.token2wav.first_lane = on


def _voice_pages(engine: Any, on: bool) -> None:
    """A: every first chunk computes its prompt; B: a kept voice's later requests start after its prompt
    pages (EngineConfig.flow_voice_pages, built at load for both arms)."""
    if on and getattr(engine.token2wav.flow.decoder, "voices", None) is None:
        log.warning("--ab voice-pages: no page pool here (CUDA graphs, flow reuse): both arms are one engine")
    engine.token2wav.voice_pages = on


def _lane_priority(engine: Any, on: bool) -> None:
    """A: the first-chunk lane on a normal-priority stream; B: on a high-priority one (CUDA)."""
    if on and not engine.token2wav.first_lane:
        log.warning("--ab lane-priority: no first-chunk lane is open here, both arms are the same engine")
    engine.token2wav.lane_urgent = on


def _own_stream(engine: Any, on: bool) -> None:
    """A: the main token2wav worker's calls on the default stream, where request threads queue their device
    work behind them; B: on a stream of its own, the default (read per batch; CUDA, else both arms are one
    engine)."""
    engine.token2wav.own_stream = on


def _host_prefix(engine: Any, on: bool) -> None:
    """A: the LM's prompt embeddings looked up on its device in a thread and copied back for vLLM; B:
    gathered from the host's copy of its tables on the event loop (EngineConfig.lm_host_prefix)."""
    engine.host_prefix = on


GIL_SWITCH_AB_MS = 1.0  # --ab gil-switch: B's switch interval


def _gil_switch(engine: Any, on: bool) -> None:
    """A: the engine's switch interval (EngineConfig.gil_switch_ms, else Python's 5 ms); B: 1 ms."""
    sys.setswitchinterval((GIL_SWITCH_AB_MS if on else engine.cfg.gil_switch_ms or 5.0) / 1000.0)


KEPT_PROMPTS_AB = 64  # --ab kept-prompts: B's voices kept (the frontend's prompt cache holds as many)


def _kept_prompts(engine: Any, on: bool) -> None:
    """A: the engine's kept prompts (EngineConfig.t2w_kept_prompts, 0 by default: each request copies its
    own); B: 64 voices' prompt tensors kept on the device."""
    engine.token2wav.prompts.size = KEPT_PROMPTS_AB if on else engine.cfg.t2w_kept_prompts


def _prompt_in_frontend(engine: Any, on: bool) -> None:
    """A: the engine's (EngineConfig.t2w_prompt_in_frontend, off by default: the flow's prompt copied on the
    event loop); B: in the frontend's thread."""
    engine.prompt_in_frontend = on or engine.cfg.t2w_prompt_in_frontend


# --ab NAME: how the in-process engine's B arm is switched on (and off again for A)
AB_SWITCHES: dict[str, Callable[[Any, bool], None]] = {
    "relaxed-cap": _relaxed_cap,
    "burst-start": _burst_start,
    "yield": _yield,
    "quiet-first": _quiet_first,
    "first-lane": _first_lane,
    "busy-start": _busy_start,
    "lane-priority": _lane_priority,
    "short-split": _short_split,
    "prompt-trim": _prompt_trim,
    "fast-start-on": _fast_start_on,
    "voice-pages": _voice_pages,
    "own-stream": _own_stream,
    "host-prefix": _host_prefix,
    "gil-switch": _gil_switch,
    "kept-prompts": _kept_prompts,
    "prompt-in-frontend": _prompt_in_frontend,
}


def arms_at(args: argparse.Namespace, i: int) -> list[str]:
    """The arms of run ``i`` (a rate and seed) as suffixes of the system's name: one (the engine as
    configured), or with ``--ab`` both, which first alternating by run (a slow drift of the machine, a warmer
    engine, then falls on both arms alike)."""
    arms = ["", *(f" {lever}" for lever in args.ab)]
    return arms if i % 2 == 0 else arms[::-1]


def ab_levers(text: str) -> tuple[str, ...]:
    """--ab's value: its B arms, comma-separated, each a lever of AB_SWITCHES or levers joined by ``+``
    (one arm with all of them on); each lever once."""
    arms = tuple(text.split(","))
    levers = [lever for arm in arms for lever in arm.split("+")]
    unknown = [lever for lever in levers if lever not in AB_SWITCHES]
    if unknown or len(set(levers)) != len(levers) or not all(levers):
        known = ", ".join(sorted(AB_SWITCHES))
        raise argparse.ArgumentTypeError(f"levers of {known} (a+b: one arm), each once, got {text!r}")
    return arms


def ab_lever_set(arms: tuple[str, ...]) -> set[str]:
    """Every lever of --ab's arms (``a+b`` counts as a and b)."""
    return {lever for arm in arms for lever in arm.split("+")}


def switch_arm(engine: Any, arms: tuple[str, ...], arm: str) -> None:
    """Arm `` a+b`` has levers a and b on and the others off; arm ``""`` (A) has every lever off."""
    on = set(arm.strip().split("+")) if arm else set()
    for lever in sorted(ab_lever_set(arms)):
        AB_SWITCHES[lever](engine, lever in on)


async def open_level(
    target: Target,
    workload: Workload,
    args: argparse.Namespace,
    rate: float,
    prompt: Any,
    arm: str,
    seed: int,
) -> Level:
    """One rate and seed of one arm; the arm's name follows the system's (``cosystream relaxed-cap``)."""
    from bench.open_loop import run_open_level

    switch_arm(target.engine, args.ab, arm)  # type: ignore[attr-defined]
    level = await run_open_level(target, workload, open_load(args, rate), prompt, seed, args.window_s)
    level = dataclasses.replace(level, system=level.system + arm)
    p95s = " ".join("-" if w.ttfa_p95_ms is None else f"{w.ttfa_p95_ms:.0f}" for w in level.windows)
    log.info("%s, %.2f requests/s, seed %d, active streams mean %.1f, TTFA p95 by %g s of arrivals: %s",
             _line(level), rate, seed, level.active_mean, args.window_s, p95s)  # fmt: skip
    return level


def open_load(args: argparse.Namespace, rate: float) -> Any:
    """One rate's arrivals: rate x ``--arrival-s``, at least ``--requests`` (and ``--min-requests`` in a
    search)."""
    from bench.open_loop import OpenLoop

    least = max(args.requests, args.min_requests if args.find_capacity else 1)
    return OpenLoop(rate, max(least, round(rate * args.arrival_s)), args.length_spread)


def slo(args: argparse.Namespace) -> Any:
    from bench.open_loop import Slo

    return Slo(args.slo_ttfa_ms)


def _check_length(level: Level, tokens: int) -> None:
    """Warn when requests did not get the forced length (a server that ignores ``forced_tokens``)."""
    want = tokens / 25.0
    got = [r.audio_s for r in level.per_request if r.ok and abs(r.audio_s - want) > 0.05 * want]
    if got:
        log.warning(
            "%d of %d requests returned %.2f-%.2f s of audio instead of the forced %.2f s: compute is not "
            "fixed (does the server honour forced_tokens?)",
            len(got), level.requests, min(got), max(got), want,
        )  # fmt: skip


def _line(lv: Level) -> str:
    def f(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    return (
        f"{lv.system} {lv.mode} c={lv.concurrency}: TTFA p50 {f(lv.ttfa_ms['p50'], '.0f')} ms "
        f"p95 {f(lv.ttfa_ms['p95'], '.0f')} ms, RTF p50 {f(lv.rtf['p50'], '.3f')}, "
        f"underrun streams {lv.underrun_requests}, {lv.audio_s_per_s:.2f} audio s/s, failed {lv.failed}"
        + _transport(lv)
    )


def _transport(lv: Level) -> str:
    """Over HTTP: the server's own TTFA and what the transport added to the client's (means)."""
    if lv.server_ttfa_ms_mean is None or lv.ttfa_ms["mean"] is None:
        return ""
    added = lv.ttfa_ms["mean"] - lv.server_ttfa_ms_mean
    return f"; TTFA mean {lv.ttfa_ms['mean']:.1f} ms = server {lv.server_ttfa_ms_mean:.1f} + HTTP {added:.1f}"


async def run_engine(args: argparse.Namespace, save: SaveRun) -> tuple[list[Level], dict[str, Any]]:
    from engine import device as devices

    engine = load_engine(args)
    dev = engine.model.device
    info: dict[str, Any] = {"model": f"{engine.model_name} ({engine.family})", "device": str(dev)}
    info |= {"backend": engine.backend.name, "device_peak_mb_load": devices.peak_memory_mb(dev)}
    try:
        devices.reset_peak_memory(dev)
        await engine.warmup()
        await asyncio.to_thread(engine.graph_builder.wait)  # the sweep measures the finished engine
        info["device_peak_mb_warmup"] = devices.peak_memory_mb(dev)  # where a device transient happens
        levels = await sweep(EngineTarget(engine), args, args.concurrency, lambda lv: save(lv, info))
        if args.profile_dir:
            await profile_levels(EngineTarget(engine), args)
        if args.baseline:
            from bench.baseline import ReferenceStyle

            small = [c for c in args.concurrency if c <= args.baseline_max_concurrency]
            levels += await sweep(ReferenceStyle(engine), args, small, lambda lv: save(lv, info), levels)
        return levels, info
    finally:
        engine.close()


async def profile_levels(target: Target, args: argparse.Namespace) -> None:
    from bench.profile import profile_level

    workload = Workload(tokens=args.tokens, stream=True, text_wps=args.text_stream)
    for c in args.profile_at or sorted({1, max(args.concurrency)}):
        await profile_level(target, workload, c, prompt_audio(), Path(args.profile_dir))


async def run_http(args: argparse.Namespace, save: SaveRun) -> tuple[list[Level], dict[str, Any]]:
    target = HttpTarget(args.url, busiest(args), args.api_key)
    info: dict[str, Any] = {"model": args.url, "device": "server", "backend": "server"}
    try:
        levels = await sweep(target, args, args.concurrency, lambda lv: save(lv, info))
    finally:
        await target.aclose()
    return levels, info


def meta(args: argparse.Namespace, argv: Sequence[str], info: dict[str, Any]) -> dict[str, Any]:
    return info | {
        "command": "python -m bench " + shlex.join(argv),
        "hardware": args.hardware or host_hardware(),
        "tokens": args.tokens,
        "arrivals": args.arrivals,
        "length_spread": args.length_spread,
        **open_meta(args),
        "text_stream_wps": args.text_stream,
        "git": git_commit(),
        "finished": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
    }


def open_meta(args: argparse.Namespace) -> dict[str, Any]:
    """Open loop: how each rate was measured (its arrivals' span, the windows, the seeds, the warm-up load)
    and, per rate, the requests of one seed's run; the levels carry the rest and run in this order."""
    if args.arrivals != "poisson":
        return {}
    warm = args.warmup_arrival_s
    requests = {f"{rate:g}": open_load(args, rate).requests for rate in args.rate}
    return {
        "open_loop": {
            "arrival_s": args.arrival_s, "window_s": args.window_s, "seeds": args.seeds, "rates": args.rate,
            "requests": requests, "ab": ",".join(args.ab) or None, "all_rates": args.all_rates,
            "warmup": {"rate": args.rate[0], "arrival_s": warm, "requests": round(args.rate[0] * warm)},
        }
    }  # fmt: skip


def untraced(level: dict[str, Any]) -> dict[str, Any]:
    """A level for results.json: the per-chunk traces go to trace.jsonl (``--trace``), not here."""
    for row in level["per_request"]:
        row.pop("trace", None)
    return level


def write_trace(path: Path, level: Level) -> None:
    """Append ``level``'s chunk traces to ``path`` (JSON lines: the level's mode and rate, the request)."""
    with path.open("a") as f:
        for r in level.per_request:
            for row in r.trace:
                head = {
                    "mode": level.mode, "system": level.system, "rate": level.rate, "seed": level.seed,
                    "concurrency": level.concurrency,
                }  # fmt: skip
                f.write(json.dumps(head | {"request": r.index} | row) + "\n")


def capacity_meta(args: argparse.Namespace, levels: list[Level]) -> dict[str, Any]:
    """With --find-capacity: the search's record per mode (``bench.open_loop.capacity``)."""
    if not args.find_capacity:
        return {}
    from bench.open_loop import capacity

    searched = [lv for lv in levels if OVERLOAD not in lv.system and lv.rate is not None]
    runs = sorted({(lv.mode, lv.system) for lv in searched})
    one = len({system for _, system in runs}) == 1  # one arm: keyed by mode alone, as before the A/B

    def key(mode: str, system: str) -> str:
        return mode if one else f"{mode} {system}"

    return {
        "capacity": {
            key(m, sys): capacity(
                [lv for lv in searched if (lv.mode, lv.system) == (m, sys)], slo(args), args.all_rates
            )
            for m, sys in runs
        }
    } | overload_meta(args, levels)


def overload_meta(args: argparse.Namespace, levels: list[Level]) -> dict[str, Any]:
    """With --overload: its factor and, per run, what became of the arrivals (refused, underran, TTFA)."""
    runs = [lv for lv in levels if OVERLOAD in lv.system]
    if not runs:
        return {}
    rows = [
        {
            "system": lv.system, "mode": lv.mode, "rate": lv.rate, "requests": lv.requests,
            "refused": lv.refused, "failed_not_refused": lv.failed - lv.refused,
            "admitted": lv.requests - lv.refused, "underrun_streams": lv.underrun_requests,
            "ttfa_p95_ms": lv.ttfa_ms.get("p95"),
        }
        for lv in runs
    ]  # fmt: skip
    return {"overload": {"factor": args.overload, "runs": rows}}


def run_order(levels: list[Level]) -> dict[str, Any]:
    """Open loop: the levels' (rate, seed, arm) in the order they ran (an A/B alternates the first arm)."""
    runs = [{"rate": lv.rate, "seed": lv.seed, "system": lv.system} for lv in levels if lv.rate is not None]
    return {"order": runs} if runs else {}


def host_hardware() -> str:
    name = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [
            ln.split(":", 1)[1].strip()
            for ln in cpuinfo.read_text().splitlines()
            if ln.startswith("model name")
        ]
        name = names[0] if names else name
    return f"{name}, {os.cpu_count()} CPU threads"


def git_commit() -> str:
    """The checkout's commit; where it has no .git (a device call's copy), the COMMIT the caller names."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("COMMIT", "unknown")
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def main(argv: Sequence[str] | None = None) -> dict[str, Path]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    def save(levels: list[Level], info: dict[str, Any], complete: bool = False) -> dict[str, Path]:
        result = {
            "meta": meta(args, argv, info)
            | {"complete": complete}
            | capacity_meta(args, levels)
            | run_order(levels),
            "levels": [untraced(asdict(lv)) for lv in levels],
        }
        return write_report(result, args.out, with_plot=complete)

    levels, info = asyncio.run(run_http(args, save) if args.url else run_engine(args, save))
    paths = save(levels, info, complete=True)
    for kind, path in paths.items():
        log.info("%s: %s", kind, path)
    return paths


if __name__ == "__main__":
    main()
