"""Model id or path -> a validated local model directory (local, ModelScope, then Hugging Face).

A CosyVoice2/3 directory is recognised the way the reference recognises it: by which yaml exists
(spec §1.1). Downloads skip what this server never opens (TensorRT/JIT exports, batch tokenizers, the
BlankEN safetensors that llm.pt overwrites), so a 0.5B model is ~3 GB instead of ~6.
"""

from __future__ import annotations

import inspect
import logging
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import ModelError

log = logging.getLogger(__name__)

FAMILY_YAML = {"cosyvoice2": "cosyvoice2.yaml", "cosyvoice3": "cosyvoice3.yaml"}
FAMILY_TOKENIZER = {"cosyvoice2": "speech_tokenizer_v2.onnx", "cosyvoice3": "speech_tokenizer_v3.onnx"}
CHECKPOINTS = ("llm.pt", "flow.pt", "hift.pt", "campplus.onnx")
QWEN_DIR = "CosyVoice-BlankEN"
QWEN_FILES = ("config.json", "vocab.json", "merges.txt")  # the backbone weights come from llm.pt
RL_LLM = "llm.rl.pt"

# ModelScope ids whose Hugging Face twin has another owner.
HF_ALIASES = {"iic/CosyVoice2-0.5B": "FunAudioLLM/CosyVoice2-0.5B"}
# Released files this server never opens (spec §1.2); llm.rl.pt is added unless asked for.
SKIP_PATTERNS = (
    "*.batch.onnx",
    "flow.decoder.estimator*",
    "*.plan",
    "*.zip",
    "asset/*",
    f"{QWEN_DIR}/model.safetensors",
)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_LFS_POINTER = b"version https://git-lfs"


@dataclass(frozen=True)
class ModelDir:
    """A validated CosyVoice2/3 model directory; ``llm`` is llm.rl.pt when the RL variant was picked."""

    root: Path
    family: str  # "cosyvoice2" | "cosyvoice3"
    yaml: Path
    llm: Path
    flow: Path
    hift: Path
    campplus: Path
    speech_tokenizer: Path
    qwen: Path  # CosyVoice-BlankEN/: Qwen2 config + tokenizer files
    spk2info: Path | None  # optional built-in speakers
    llm_variant: str  # the variant actually loaded: "base" | "rl"


def resolve_model(model: str, cache_dir: str | None = None, llm_variant: str = "base") -> ModelDir:
    """A local directory as is; otherwise a hub id downloaded via ModelScope (when installed) or Hugging Face.

    With ``cache_dir`` the snapshot lives at ``<cache_dir>/<owner>/<name>`` and is reused without network
    once complete. Every failure is one ``ModelError`` naming the id and the files the directory needs.
    """
    local = Path(model).expanduser()
    if local.is_dir():
        return validate_model_dir(local, llm_variant)
    if not _HUB_ID.match(model):
        raise ModelError(f"model {model!r} is neither an existing directory nor a hub id like owner/name")
    target = Path(cache_dir).expanduser() / model if cache_dir else None
    if target is not None and target.is_dir():
        try:
            return validate_model_dir(target, llm_variant)
        except ModelError as err:
            log.info("cached %s is incomplete (%s); downloading", target, err)
    return validate_model_dir(Path(_download(model, target, llm_variant)), llm_variant)


def validate_model_dir(root: str | os.PathLike[str], llm_variant: str = "base") -> ModelDir:
    """Check a directory has every file a CosyVoice2/3 checkpoint needs; family from which yaml exists."""
    root = Path(root).expanduser()
    if not root.is_dir():
        raise ModelError(f"model directory {root} does not exist")
    family = detect_family(root)
    missing = [name for name in required_files(family) if not _present(root / name)]
    if missing:
        raise ModelError(
            f"model directory {root} ({family}) is missing: {', '.join(missing)}. {needs_sentence(family)}"
        )
    for name in (*CHECKPOINTS, FAMILY_TOKENIZER[family]):
        _reject_lfs_pointer(root / name)
    spk2info = root / "spk2info.pt"
    return ModelDir(
        root=root,
        family=family,
        yaml=root / FAMILY_YAML[family],
        llm=_pick_llm(root, llm_variant),
        flow=root / "flow.pt",
        hift=root / "hift.pt",
        campplus=root / "campplus.onnx",
        speech_tokenizer=root / FAMILY_TOKENIZER[family],
        qwen=root / QWEN_DIR,
        spk2info=spk2info if spk2info.is_file() else None,
        llm_variant="rl" if (root / RL_LLM).is_file() and llm_variant == "rl" else "base",
    )


def detect_family(root: Path) -> str:
    """``cosyvoice2`` or ``cosyvoice3`` from the yaml present (the reference's AutoModel rule)."""
    found = [family for family, name in FAMILY_YAML.items() if (root / name).is_file()]
    if len(found) == 1:
        return found[0]
    if len(found) > 1:
        raise ModelError(f"{root} holds both cosyvoice2.yaml and cosyvoice3.yaml; keep the one that matches")
    if (root / "cosyvoice.yaml").is_file():
        raise ModelError(
            f"{root} is a CosyVoice v1 (300M) model; only CosyVoice2 and CosyVoice3 are supported"
        )
    raise ModelError(f"{root} is not a CosyVoice2/3 model directory (no cosyvoice2.yaml or cosyvoice3.yaml)")


def required_files(family: str) -> tuple[str, ...]:
    """Paths relative to the model directory that must exist for ``family``."""
    qwen = tuple(f"{QWEN_DIR}/{name}" for name in QWEN_FILES)
    return (FAMILY_YAML[family], *CHECKPOINTS, FAMILY_TOKENIZER[family], *qwen)


def needs_sentence(family: str | None) -> str:
    """What a directory must contain, in words, for error messages."""
    qwen = f"{QWEN_DIR}/ ({', '.join(QWEN_FILES)})"
    common = f"llm.pt (plus {RL_LLM} for the RL variant), flow.pt, hift.pt, campplus.onnx, {qwen}"
    if family is None:
        return (
            "The directory needs cosyvoice2.yaml + speech_tokenizer_v2.onnx (CosyVoice2) or "
            f"cosyvoice3.yaml + speech_tokenizer_v3.onnx (CosyVoice3), and {common}."
        )
    return f"The directory needs {FAMILY_YAML[family]}, {FAMILY_TOKENIZER[family]}, {common}."


def _present(path: Path) -> bool:
    return path.is_file() or (path.name == QWEN_DIR and path.is_dir())


def _reject_lfs_pointer(path: Path) -> None:
    """A git clone without git-lfs leaves ~130-byte pointer files where the weights should be."""
    if path.stat().st_size < 1024 and path.read_bytes().startswith(_LFS_POINTER):
        raise ModelError(f"{path} is a Git LFS pointer, not the file; run `git lfs pull` in {path.parent}")


def _pick_llm(root: Path, llm_variant: str) -> Path:
    if llm_variant == "rl":
        if (root / RL_LLM).is_file():
            return root / RL_LLM
        log.warning("llm_variant 'rl' asked for but %s has no %s; using llm.pt", root, RL_LLM)
    elif llm_variant != "base":
        raise ModelError(f"llm_variant must be 'base' or 'rl', got {llm_variant!r}")
    return root / "llm.pt"


# ---------------------------------------------------------------------------------------------- download


def _download(model_id: str, target: Path | None, llm_variant: str) -> str:
    """Try each available hub in turn; one ModelError listing every failure if none works."""
    skip = [*SKIP_PATTERNS, *([] if llm_variant == "rl" else [RL_LLM])]
    errors = []
    for hub, fetch in _hubs(model_id):
        log.info("downloading %s from %s%s", model_id, hub, f" into {target}" if target else "")
        try:
            return fetch(target, skip)
        except Exception as err:  # network, auth, missing repo, disk: all reported together below
            errors.append(f"{hub}: {type(err).__name__}: {err}")
    where = f"put the files in {target}" if target else "pass the directory with --model /path/to/dir"
    raise ModelError(
        f"could not download model {model_id!r} ({'; '.join(errors) or 'no hub client installed'}). "
        f"Download it where there is network access and {where}. {needs_sentence(_guess_family(model_id))}"
    )


def _hubs(model_id: str) -> list[tuple[str, Callable[[Path | None, list[str]], str]]]:
    hubs = []
    if _installed("modelscope"):
        hubs.append(("ModelScope", lambda target, skip: download_modelscope(model_id, target, skip)))
    if _installed("huggingface_hub"):
        hf_id = HF_ALIASES.get(model_id, model_id)
        hubs.append(("Hugging Face", lambda target, skip: download_huggingface(hf_id, target, skip)))
    return hubs


def download_modelscope(model_id: str, target: Path | None, skip: list[str]) -> str:
    from modelscope import snapshot_download

    kwargs = {"local_dir": str(target) if target else None, "ignore_patterns": skip}
    return str(snapshot_download(model_id, **_supported(snapshot_download, kwargs)))


def download_huggingface(repo_id: str, target: Path | None, skip: list[str]) -> str:
    from huggingface_hub import snapshot_download
    from tqdm.auto import tqdm

    kwargs = {"local_dir": str(target) if target else None, "ignore_patterns": skip, "tqdm_class": tqdm}
    return str(snapshot_download(repo_id, **_supported(snapshot_download, kwargs)))


def _supported(fn: Callable[..., object], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Keep only keyword arguments ``fn`` accepts (hub client versions differ)."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in kwargs.items() if k in params and v is not None}


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _guess_family(model_id: str) -> str | None:
    lowered = model_id.lower()
    return next((family for family in FAMILY_YAML if family in lowered), None)
