"""Read a model directory in the released layout and load it strictly into our modules.

Family from which yaml exists (cosyvoice2.yaml / cosyvoice3.yaml); the yaml is read as DATA
(engine.yaml_data) and the Qwen geometry from CosyVoice-BlankEN/config.json, so sizes come from the files,
not from constants. State dicts load with strict key AND shape matching; ``generator.`` is stripped from
hift keys (GAN checkpoints), legacy ``weight_g``/``weight_v`` become ``parametrizations.weight.original0/1``
and are then folded for inference. Master weights stay float32.

With a cache root, each released .pt is converted once (the first start) into a safetensors file under
``weights/`` holding exactly what the strict load takes (keys renamed, float32), keyed by the .pt's path,
size and mtime; later starts read that file instead of unpickling the .pt: memory-mapped for the CPU, read
through a page-locked buffer straight onto an accelerator (``engine.weights_file``). The strict key and
shape check runs on every load, converted or not.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine import device as devices
from engine.errors import ModelError
from engine.flow.cfm import Flow, build_flow
from engine.hub import ModelDir, detect_family
from engine.lm.lm_config import SpeechLMConfig
from engine.lm.speech_lm import SpeechLM
from engine.vocoder.hift import CausalHiFTGenerator, HiftConfig, HiFTGenerator, build_hift
from engine.weights_file import read_onto
from engine.yaml_data import read_yaml, tag_of

log = logging.getLogger(__name__)
CONVERT_VERSION = 1  # bump when what a converted file holds changes (its keys, dtype)
# in each conversion's folder: the .pt it was made from (the folder's name is a hash of that path)
SOURCE_NOTE = "source"
LM_CLASSES = {"cosyvoice2": "Qwen2LM", "cosyvoice3": "CosyVoice3LM"}


def read_model_config(model_dir: Path) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(family, yaml as data, Qwen config dict); checks the yaml's classes fit the family."""
    family = detect_family(model_dir)
    yaml_path = model_dir / f"{family}.yaml"
    cfg = read_yaml(yaml_path, {"qwen_pretrain_path": str(model_dir / "CosyVoice-BlankEN")})
    if tag_of(cfg.get("llm")) != LM_CLASSES[family]:
        raise ModelError(f"{yaml_path}: llm is {tag_of(cfg.get('llm'))!r}, expected {LM_CLASSES[family]}")
    qwen_path = model_dir / "CosyVoice-BlankEN" / "config.json"
    try:
        qwen = json.loads(qwen_path.read_text())
    except (OSError, ValueError) as err:
        raise ModelError(f"cannot read the Qwen config {qwen_path}: {err}") from err
    return family, cfg, qwen


def build_modules(
    family: str, cfg: dict[str, Any], qwen: dict[str, Any]
) -> tuple[SpeechLM, Flow, HiFTGenerator | CausalHiFTGenerator]:
    """Uninitialised modules at the sizes the files describe (use the meta device for structure only):
    their parameters are left as allocated (``no_init``), since the strict load overwrites every one."""
    lm_cfg = SpeechLMConfig.from_qwen_config(family, qwen)
    llm_size = cfg.get("llm_input_size")
    if llm_size is not None and llm_size != lm_cfg.hidden_size:
        raise ModelError(f"yaml llm_input_size {llm_size} != Qwen hidden_size {lm_cfg.hidden_size}")
    with no_init():
        return SpeechLM(lm_cfg), build_flow(cfg["flow"]), build_hift(HiftConfig.from_yaml(cfg["hift"]))


# torch.nn.init's in-place initialisers, which layers' reset_parameters call while they are built
INITIALISERS = (
    "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_", "orthogonal_",
    "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "sparse_",
)  # fmt: skip


_BUILDING = threading.local()  # .on: this thread is inside no_init


@contextlib.contextmanager
def no_init() -> Iterator[None]:
    """Layers built on this thread inside skip torch.nn.init's random initialisation (their tensors stay as
    allocated). Drawing ~0.8 G random numbers for v3's LM and flow took 11 s of a 2-core CPU and most of
    the weights' phase at start-up, all of it overwritten by the strict load, which checks that every
    parameter and persistent buffer is in the file. Buffers computed in a constructor (rotary tables,
    windows) do not use these functions and are built as usual. The functions are swapped process-wide
    while it lasts, but other threads (the HiFT noise, which replays the reference's draws) still
    initialise: only this thread's calls are skipped."""
    saved = {name: getattr(nn.init, name) for name in INITIALISERS}
    _BUILDING.on = True
    try:
        for name, fn in saved.items():
            setattr(nn.init, name, _skipped_here(fn))
        yield
    finally:
        _BUILDING.on = False
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def _skipped_here(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def init(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if getattr(_BUILDING, "on", False):
            return tensor
        return fn(tensor, *args, **kwargs)

    return init


def read_state(path: Path) -> dict[str, torch.Tensor]:
    """A flat state dict from a released .pt file (weights only, memory-mapped)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (OSError, RuntimeError, EOFError) as err:
        raise ModelError(f"cannot read {path}: {err}") from err
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ModelError(f"{path} is not a flat state dict of tensors")
    return state


def converted_path(source: Path, cache: Path) -> Path:
    """Where ``source``'s safetensors conversion lives: a folder per source path, the file named by the
    source's size and mtime (a replaced checkpoint gets a new file; the old one is removed on conversion)."""
    resolved = source.resolve()
    folder = hashlib.sha256(str(resolved).encode()).hexdigest()[:16]
    stat = resolved.stat()
    name = f"{source.stem}-{stat.st_size}-{stat.st_mtime_ns}-v{CONVERT_VERSION}.safetensors"
    return cache / "weights" / folder / name


def read_converted(
    source: Path,
    cache: Path | None,
    prepare: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
    device: torch.device | None = None,
) -> dict[str, torch.Tensor]:
    """``prepare(read_state(source))``, float32: from its safetensors conversion under ``cache`` when one
    exists (on ``device`` already where it is an accelerator, else memory-mapped), else read from the .pt
    and converted there for the next start (a cache that cannot be written costs only the next start's
    speed: logged)."""
    if cache is None:
        return _float32(prepare(read_state(source)))
    try:
        target = converted_path(source, cache)
    except OSError as err:
        raise ModelError(f"cannot read {source}: {err}") from err
    if target.exists():
        if device is not None and devices.is_accelerator(device):
            return _onto(target, device)
        return _mapped(target)
    state = _float32(prepare(read_state(source)))
    try:
        _write_converted(state, target, source)
    except OSError as err:
        log.warning("could not keep %s as safetensors under %s: %s", source, target.parent, err)
    return state


def _onto(path: Path, device: torch.device) -> dict[str, torch.Tensor]:
    """``path`` read onto ``device`` (engine.weights_file); where the device's runtime refuses (page-locked
    memory, an allocation), memory-mapped as before, logged: the reader only makes the start faster."""
    try:
        return read_onto(path, device)
    except RuntimeError as err:
        log.warning("could not read %s onto %s (%s): memory-mapping it instead", path, device, err)
        return _mapped(path)


def _mapped(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))  # memory-mapped: pages load as the weights are copied to the device
    except (OSError, SafetensorError) as err:
        raise ModelError(
            f"cannot read the converted weights {path}: {err} (delete it to convert again)"
        ) from err


def _float32(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.float() for k, v in state.items()}


def _write_converted(state: dict[str, torch.Tensor], target: Path, source: Path) -> None:
    """Written to a temporary name and renamed (a crash mid-write leaves no half file under the real
    name); the older conversions of the same source go, and so do those of sources that are gone. Tensors
    sharing storage (tied weights) are copied apart: safetensors keeps one tensor per entry."""
    from safetensors.torch import save_file

    target.parent.mkdir(parents=True, exist_ok=True)
    seen: set[tuple[int, int]] = set()
    tensors = {}
    for key, value in state.items():
        spot = (value.untyped_storage().data_ptr(), int(value.storage_offset()))
        tensors[key] = value.contiguous() if spot not in seen else value.clone().contiguous()
        seen.add(spot)
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    save_file(tensors, str(partial))
    os.replace(partial, target)
    (target.parent / SOURCE_NOTE).write_text(str(source.resolve()))
    for older in target.parent.glob("*.safetensors"):  # the folder is this source's alone
        if older != target:
            older.unlink(missing_ok=True)
    log.info("converted the weights to %s (later starts map them)", target)
    prune_orphans(target.parent.parent)


def prune_orphans(weights: Path) -> None:
    """Removes the conversion folders under ``weights`` whose source .pt no longer exists (a deleted or
    moved model directory): each is as large as its checkpoint (2-4 GB for a released model) and nothing
    would read it again. A folder without its note (mid-write, or from before the notes) is kept."""
    removed = 0
    for note in weights.glob(f"*/{SOURCE_NOTE}"):
        try:
            gone = not Path(note.read_text()).exists()
        except OSError:  # removed by another process's prune between the glob and the read
            continue
        if gone:
            shutil.rmtree(note.parent, ignore_errors=True)
            removed += 1
    if removed:
        log.info("removed %d weight conversions whose checkpoints are gone", removed)


def hift_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip ``generator.`` (as the reference does) and rename legacy weight-norm keys."""
    out = {}
    for key, value in state.items():
        key = key.replace("generator.", "")
        if key.endswith(".weight_g"):
            key = key.removesuffix(".weight_g") + ".parametrizations.weight.original0"
        elif key.endswith(".weight_v"):
            key = key.removesuffix(".weight_v") + ".parametrizations.weight.original1"
        out[key] = value
    return out


def load_strict(module: nn.Module, state: dict[str, torch.Tensor], path: Path) -> None:
    """``load_state_dict(strict=True)`` with an error that names the file and every offending key. The
    module takes the state's tensors themselves (``assign``: memory-mapped from the file, where read so):
    copying every weight into the module's own host memory first cost the full-size v3 2.5-6.3 s of its
    load on an idle 2-core VM (0.3-0.7 s without), before the copy to the device."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = [
        f"{k}: file {tuple(state[k].shape)} vs model {tuple(v.shape)}"
        for k, v in expected.items()
        if k in state and state[k].shape != v.shape
    ]
    if missing or unexpected or wrong:
        raise ModelError(
            f"{path} does not match the {type(module).__name__} its config describes:\n"
            + _listing("missing keys", missing)
            + _listing("unexpected keys", unexpected)
            + _listing("shape mismatches", wrong)
        )
    module.load_state_dict(_float32(state), strict=True, assign=True)


def _listing(title: str, items: list[str], most: int = 12) -> str:
    if not items:
        return ""
    more = f" ... and {len(items) - most} more" if len(items) > most else ""
    return f"  {title} ({len(items)}): {', '.join(items[:most])}{more}\n"


@dataclass(frozen=True)
class LoadedModel:
    family: str
    model_dir: Path
    device: torch.device
    lm: SpeechLM
    flow: Flow
    hift: HiFTGenerator | CausalHiFTGenerator
    qwen_config: dict[str, Any]


def load_model(
    files: ModelDir, device: torch.device, cache: Path | None = None, onto: bool = True
) -> LoadedModel:
    """Build from the files' configs, load llm/flow/hift strictly, move to ``device``, eval mode. With
    ``cache`` (the cache root) the weights come from their safetensors conversions there (made now on the
    first load; on an accelerator and with ``onto`` they are read onto it, and "to DEVICE" then moves only
    the buffers the modules computed themselves; else memory-mapped)."""
    root = Path(files.root)
    started = time.perf_counter()
    family, cfg, qwen = read_model_config(root)
    lm, flow, hift = build_modules(family, cfg, qwen)
    built = time.perf_counter()
    same: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] = lambda state: state  # noqa: E731
    # the vocoder (~80 MB) stays on the host until its weight norm is folded: folded on the device, its
    # weights would differ from a cold start's in the last bits, and so would the audio
    direct = device if onto else None
    for module, path, prepare, to in (
        (lm, files.llm, same, direct),
        (flow, files.flow, same, direct),
        (hift, files.hift, hift_keys, None),
    ):
        load_strict(module, read_converted(Path(path), cache, prepare, to), Path(path))
    hift.fold_weight_norm()
    read = time.perf_counter()
    for module in (lm, flow, hift):
        module.to(device).eval()
    if direct is not None and devices.is_accelerator(device):  # the tied lm_head read onto the device and
        devices.empty_cache(device)  # dropped (~0.5 GB): vLLM sizes its KV cache from the memory free there
    # where a start's "weights" phase goes (13.6-18.5 s of a warm v3 start on an H100 with the files
    # memory-mapped: built 2.5-2.8, read 4.7-7.2, to cuda 6.0-8.5 s); the first allocation on a GPU also
    # starts its CUDA context
    log.info(
        "loaded %s: llm %s, flow %s, hift %s (built %.1f s, read %.1f s, to %s %.1f s)", family, files.llm,
        files.flow, files.hift, built - started, read - built, device, time.perf_counter() - read,
    )  # fmt: skip
    return LoadedModel(family, root, device, lm, flow, hift, qwen)
