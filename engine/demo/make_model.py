"""Write a model directory in the released layout with seeded random weights (tiny or full size).

    python -m engine.demo.make_model --family cosyvoice3 --size tiny --out DIR

Files: {family}.yaml (released structure), llm.pt / flow.pt / hift.pt (plain state dicts with the released
keys: tied lm_head present, weight-norm parametrizations), CosyVoice-BlankEN/ (config.json + a small
tokenizer whose CosyVoice special tokens have the real ids), campplus.onnx and speech_tokenizer_v{2,3}.onnx
(the fixture stand-ins when a fixture root is found, else our own with the same signatures).
Weights follow the fixtures' scheme: >=2-D N(0,1)/sqrt(fan_in), 1-D "*weight" and weight-norm g
1 + 0.1 N(0,1), other 1-D 0.1 N(0,1); the HiFT f0 head is offset so voiced frames occur and conv_post is
damped so the waveform stays under the clamp. Audio from random weights is noise: only the compute is real.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.cache_root import cache_root
from engine.checkpoint import build_modules
from engine.config import EngineConfig
from engine.demo.tiny_tokenizer import write_tiny_tokenizer
from engine.demo.yaml_templates import FULL, SMALL, TINY, model_yaml, qwen_config
from engine.yaml_data import read_yaml

log = logging.getLogger(__name__)
SIZES = {"tiny": TINY, "small": SMALL, "full": FULL}


def randomize(module: nn.Module, seed: int) -> None:
    """Redraw every parameter in place from a private generator (the global RNG is untouched)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("original0") or (p.dim() == 1 and name.endswith("weight")):
                p.copy_(1.0 + 0.1 * noise)
            elif p.dim() == 1:
                p.copy_(0.1 * noise)
            else:
                p.copy_(noise / math.sqrt(p[0].numel()))


def tame_hift(hift: Any) -> None:
    """f0 around 150 +- 60 Hz (so the sine source is exercised) and a quiet conv_post (no clipping)."""
    with torch.no_grad():
        head = hift.f0_predictor.classifier
        head.weight.mul_(60.0)
        head.bias.fill_(150.0)
        post = hift.conv_post
        post.parametrizations.weight.original0.mul_(0.1)
        post.bias[:9] -= 3.0


def fixture_onnx() -> Path | None:
    env = os.environ.get("COSYSTREAM_FIXTURES")
    root = Path(env) if env else Path(__file__).resolve().parents[3] / "shared" / "fixtures"
    onnx_dir = root / "onnx"
    return onnx_dir if (onnx_dir / "campplus_standin.onnx").is_file() else None


def write_onnx(out: Path, family: str) -> None:
    version = "v3" if family == "cosyvoice3" else "v2"
    src = fixture_onnx()
    if src is None:
        from engine.demo.onnx_standins import write_standins  # onnx: seconds to import, only when building

        write_standins(out, family)
        return
    shutil.copyfile(src / "campplus_standin.onnx", out / "campplus.onnx")
    shutil.copyfile(
        src / f"speech_tokenizer_{version}_standin.onnx", out / f"speech_tokenizer_{version}.onnx"
    )


def build_model_dir(out: str | Path, family: str = "cosyvoice3", size: str = "tiny", seed: int = 0) -> Path:
    """Write the whole directory; returns its path. Existing files are overwritten."""
    if family not in ("cosyvoice2", "cosyvoice3") or size not in SIZES:
        raise ValueError(
            f"family must be cosyvoice2|cosyvoice3 and size one of {sorted(SIZES)}, got {family}/{size}"
        )
    out = Path(out)
    blank = out / "CosyVoice-BlankEN"
    blank.mkdir(parents=True, exist_ok=True)
    (out / f"{family}.yaml").write_text(model_yaml(family, SIZES[size]))
    qwen = qwen_config(SIZES[size])
    write_tiny_tokenizer(blank, family)
    (blank / "config.json").write_text(json.dumps(qwen, indent=2))
    cfg = read_yaml(out / f"{family}.yaml", {"qwen_pretrain_path": str(blank)})
    lm, flow, hift = build_modules(family, cfg, qwen)
    for i, (name, module) in enumerate((("llm", lm), ("flow", flow), ("hift", hift))):
        randomize(module, seed + i)
        if name == "hift":
            tame_hift(module)
        torch.save(module.state_dict(), out / f"{name}.pt")
        del module
    write_onnx(out, family)
    log.info("wrote a %s %s model directory with random weights to %s", size, family, out)
    return out


def demo_tiny(cfg: EngineConfig) -> tuple[EngineConfig, Path]:
    """``--model demo-tiny`` for the server and ``python -m engine`` alike: the config with its tiny Whisper
    (for ``--asr-model auto``) and the tiny model's directory, both built once under the cache root."""
    cfg = replace(cfg, asr_model=demo_tiny_whisper(cfg.cache_dir, cfg.asr_model))
    return cfg, build_demo_tiny(cfg.cache_dir)


def demo_tiny_whisper(cache_dir: str | None, asr_model: str) -> str:
    """``--asr-model auto`` with demo-tiny: a tiny random-weight Whisper beside the tiny model (offline; its
    transcripts are noise); any other choice is kept as it is."""
    if asr_model != "auto":
        return asr_model
    import engine.demo.tiny_whisper as whisper

    root = cache_root(cache_dir) / "demo-tiny-whisper"
    return str(built_once(root, whisper.build_whisper_dir, [Path(whisper.__file__)]))


def build_demo_tiny(cache_dir: str | None = None) -> Path:
    """``--model demo-tiny`` (app.py and ``python -m engine``): a tiny random-weight v3 directory in the
    released layout under the cache, written on the first start and whenever its generators change."""
    root = cache_root(cache_dir) / "demo-tiny"
    generators = [
        Path(__file__).parent / f"{m}.py" for m in ("make_model", "yaml_templates", "tiny_tokenizer")
    ]
    engine = Path(__file__).parents[1]  # the modules whose state dict layout the files follow
    stages = [p for stage in ("lm", "flow", "vocoder") for p in sorted((engine / stage).rglob("*.py"))]
    models = [*stages, engine / "checkpoint.py", engine / "yaml_data.py"]
    sources = [p for p in generators + models if p.is_file()]
    return built_once(root, lambda out: build_model_dir(out, "cosyvoice3", "tiny"), sources)


def built_once(root: Path, build: Callable[[Path], Path], sources: list[Path]) -> Path:
    """``build(root)`` unless ``root`` holds what these generator sources (and this torch and fixture set)
    built before: a demo's restart reuses its files (seconds) instead of writing them again."""
    digest = hashlib.sha256(f"{torch.__version__} {fixture_onnx()}".encode())
    for path in sources:
        digest.update(path.read_bytes())
    stamp, want = root / ".built", digest.hexdigest()
    if stamp.is_file() and stamp.read_text() == want:
        log.info("reusing %s (built by these sources)", root)
        return root
    log.info("building %s (random weights)", root)
    stamp.unlink(missing_ok=True)
    build(root)
    root.mkdir(parents=True, exist_ok=True)
    stamp.write_text(want)  # last: a build cut short is built again
    return root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=["cosyvoice2", "cosyvoice3"], default="cosyvoice3")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    build_model_dir(args.out, args.family, args.size, args.seed)


if __name__ == "__main__":
    main()
