"""``python -m bench.weights_load``: the seconds of a start's "weights" phase alone
(``engine.checkpoint.load_model``) on one model directory, in fresh processes, and with one read of every
weight after it (what a copy to a GPU does: a load that leaves the weights mapped pays their pages then).

    python -m bench.weights_load --family v3 --size full --device cpu --runs 3 --out /tmp/wl   # the VM
    python -m bench.weights_load --model MODEL_DIR --device cuda --out /tmp/wl                 # a GPU
    python -m bench.weights_load --device cuda --arms onto,mapped --runs 3 --out /tmp/wl       # an A/B

The first process converts the checkpoints to safetensors under OUT/cache (a warm start's cache root is
then what every later run reads); it is not counted. ``--arms``: how a converted file is read on an
accelerator: ``onto`` (the default, ``engine.weights_file``: through a page-locked buffer onto the device),
``mapped`` (memory-mapped, then copied tensor by tensor); with both, every run measures each arm in a fresh
process, which goes first alternating by run. Writes OUT/weights_load.json: per measured process its arm, the
load's seconds and the load plus one read of every weight.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.__main__ import FAMILIES, random_model
from engine.checkpoint import load_model
from engine.hub import validate_model_dir

log = logging.getLogger("bench.weights_load")


ARMS = ("onto", "mapped")


def measure(model_dir: Path, device: str, cache: Path, arm: str = "onto") -> dict[str, float]:
    """One load (this process) -> its seconds, and with one read of every weight after it."""
    start = time.perf_counter()
    model = load_model(validate_model_dir(model_dir), torch.device(device), cache, onto=arm == "onto")
    loaded = time.perf_counter() - start
    with torch.inference_mode():  # one read of every weight: what the copy to a device does
        for module in (model.lm, model.flow, model.hift):
            for param in module.parameters():
                param.float().sum().item()
    return {"load_s": round(loaded, 3), "load_and_read_s": round(time.perf_counter() - start, 3)}


def run(args: argparse.Namespace) -> dict[str, object]:
    model_dir = Path(args.model) if args.model else random_model(FAMILIES[args.family], args.size, args.out)
    cache = Path(args.out) / "cache"
    _fresh_process(model_dir, args.device, cache, args.arms[0])  # converts: not counted
    runs = []
    for i in range(args.runs):
        order = args.arms[i % len(args.arms) :] + args.arms[: i % len(args.arms)]  # who goes first alternates
        runs += [{"arm": arm} | _fresh_process(model_dir, args.device, cache, arm) for arm in order]
    family = validate_model_dir(model_dir).family  # a --model directory's own, not --family's default
    size = None if args.model else args.size  # --size builds the random model only
    return {"family": family, "size": size, "device": args.device, "runs": runs}


def _fresh_process(model_dir: Path, device: str, cache: Path, arm: str) -> dict[str, float]:
    code = "import json, sys; from bench.weights_load import measure; from pathlib import Path; "
    code += f"print(json.dumps(measure(Path({str(model_dir)!r}), {device!r}, Path({str(cache)!r}), {arm!r})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _arms(text: str) -> list[str]:
    arms = [a.strip() for a in text.split(",") if a.strip()]
    if not arms or len(set(arms)) != len(arms) or not set(arms) <= set(ARMS):
        raise argparse.ArgumentTypeError(f"--arms: one or both of {', '.join(ARMS)}, got {text!r}")
    return arms


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="python -m bench.weights_load", description=__doc__.split("\n")[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), default="v3")
    parser.add_argument("--size", choices=("tiny", "full"), default="full")
    parser.add_argument("--model", help="a model directory (default: the random-weight one, built in --out)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--runs", type=int, default=3, help="measured rounds, after a process that converts")
    parser.add_argument(
        "--arms", type=_arms, default=["onto"], help="how the converted files are read: onto, mapped or both"
    )
    parser.add_argument("--out", required=True, help="the model, its cache root and weights_load.json")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    result = run(args)
    Path(args.out, "weights_load.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    log.info("weights load: %s", result["runs"])


if __name__ == "__main__":
    main()
