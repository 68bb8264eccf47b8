"""``python -m bench.precompile_check``: what a warm start saves when the flow estimator's compiled program is
loaded whole (``--flow-precompiled``, ``engine.flow.precompiled``) instead of traced again by
``torch.compile`` (Dynamo and AOTAutograd run in every process; Inductor's cache only spares the kernels'
builds: 59-95 s of "flow compile" in a warm H200 start, BENCHMARKS.md "Start-up").

Four fresh processes on one cache folder, one after another: ``precompiled`` (cold: compiles whole and
saves), ``compile`` (today's program, Inductor's cache now warm), ``precompiled`` (loads the saved program),
``compile`` (warm again). Each builds the estimator (random weights at the released or a tiny size), times
its first call (the compile or the load, then the call) and a second call at other sizes (the same
program, no new one), and checks both against the eager estimator. The third against the fourth is the
warm start's saving; both ran on a warm Inductor cache.

    python -m bench.precompile_check --family v3 --size tiny --device cpu --out /tmp/pc      # CPU (g++)
    python -m bench.precompile_check --family v3 --size full --device cuda --out $OUT/pc_v3  # the H200

Writes OUT/precompile_check.json: per process its arm, wall seconds (launch to exit, imports included),
the calls (batch, frames, seconds, max |compiled - eager|) and the program files on disk after it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from bench.aot_check import inputs
from bench.flow_kernels import build_cfm
from engine import device as devices
from engine.flow.compiled_estimator import CompiledEstimator, use_compile_cache

log = logging.getLogger("bench.precompile_check")
SHAPES = ((2, 300), (3, 150))  # (batch, frames): the first call compiles or loads, the second reuses it
ORDER = ("precompiled", "compile", "precompiled", "compile")
STREAMING = True  # the serving path's key (a chunk's solve)


@dataclass(frozen=True)
class Call:
    batch: int
    frames: int
    seconds: float  # the call, synchronised (the first: compile or load included)
    max_abs_diff: float  # against the eager estimator, float32 outputs


def one_process(args: argparse.Namespace) -> dict[str, Any]:
    """This process's arm: the estimator compiled (or its program loaded), each shape timed and checked."""
    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    use_compile_cache(args.out / "cache")
    programs = args.out / "cache" / "precompiled"
    cfm = build_cfm(args.family, args.size, dev)
    root = programs if args.arm == "precompiled" else None
    compiled = CompiledEstimator(cfm.estimator, dtype, compiled=True, precompiled=root)
    eager = compiled.twin(compiled=False)
    calls = []
    with torch.inference_mode():
        for batch, frames in SHAPES:
            x = inputs(batch, frames, dev, torch.float32)
            devices.synchronize(dev)
            t0 = time.perf_counter()
            out = compiled(*x, STREAMING)
            devices.synchronize(dev)
            seconds = time.perf_counter() - t0
            diff = (out - eager(*x, STREAMING)).abs().max().item()
            calls.append(Call(batch, frames, round(seconds, 3), diff))
            log.info(
                "%s: batch %d x %d frames: %.1f s, max diff %.2e", args.arm, batch, frames, seconds, diff
            )
    files = sorted(p.name for p in programs.glob("*.bin")) if programs.exists() else []
    return {"arm": args.arm, "calls": [asdict(c) for c in calls], "program_files": files}


def driver(args: argparse.Namespace) -> dict[str, Any]:
    """The four processes in ``ORDER``, each launched fresh and timed from launch to exit."""
    runs = []
    for arm in ORDER:
        cmd = [sys.executable, "-m", "bench.precompile_check", "--arm", arm, *passed_on(args)]
        t0 = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=cache_env())
        wall = round(time.perf_counter() - t0, 1)
        sys.stderr.write(done.stderr[-4000:])
        if done.returncode != 0:
            runs.append({"arm": arm, "wall_s": wall, "error": done.stderr.strip().splitlines()[-1:]})
            break
        runs.append({**json.loads(done.stdout.strip().splitlines()[-1]), "wall_s": wall})
        log.info("%s: %.1f s from launch to exit", arm, wall)
    return {
        "family": args.family,
        "size": args.size,
        "dtype": args.dtype,
        "shapes": [list(s) for s in SHAPES],
        "runs": runs,
    }


def cache_env() -> dict[str, str]:
    """This environment without Inductor's and Triton's cache folders: each process's ``use_compile_cache``
    then points them at the run's own ``out/cache``, never at an operator's (a warm cache there would flatter
    arm 1), and that function stays the one place that knows the layout."""
    return {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}


def passed_on(args: argparse.Namespace) -> list[str]:
    return ["--family", args.family, "--size", args.size, "--device", args.device, "--dtype", args.dtype,
            "--out", str(args.out)]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    main_result(argv)


def main_result(argv: list[str] | None = None) -> dict[str, Any]:
    """``main``, returning what it printed (the driver's result, or one arm's)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=("v2", "v3"), default="v3")
    p.add_argument("--size", choices=("tiny", "full"), default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--arm", choices=("precompiled", "compile"), help="one process's arm (the driver's)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.arm is not None:
        result = one_process(args)
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        result = driver(args)
        (args.out / "precompile_check.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
