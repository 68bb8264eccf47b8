"""Checkpoint loading: builder-made directories load strictly; bad files give errors naming keys and files."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch

from engine.checkpoint import (
    build_modules,
    hift_keys,
    load_model,
    load_strict,
    no_init,
    read_model_config,
    read_state,
)
from engine.demo.make_model import build_model_dir
from engine.demo.yaml_templates import FULL, model_yaml, qwen_config
from engine.errors import ModelError
from engine.hub import validate_model_dir
from engine.yaml_data import read_yaml
from tests.conftest import fixture_file

FAMILIES = ["cosyvoice2", "cosyvoice3"]


@pytest.fixture(scope="module", params=FAMILIES)
def tiny_dir(request, tmp_path_factory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp(request.param), request.param, "tiny")


def test_builder_directory_loads_strictly(tiny_dir):
    model = load_model(validate_model_dir(tiny_dir), torch.device("cpu"))
    assert model.family == read_model_config(tiny_dir)[0]
    # weights came from the files, not from a fresh init
    saved = read_state(tiny_dir / "llm.pt")
    assert torch.equal(model.lm.speech_embedding.weight, saved["speech_embedding.weight"])
    assert model.lm.llm.model.lm_head.weight.data_ptr() == model.lm.embed_tokens.weight.data_ptr()


def test_missing_and_unexpected_keys_name_the_file_and_keys(tiny_dir, tmp_path):
    family, cfg, qwen = read_model_config(tiny_dir)
    _, flow, _ = build_modules(family, cfg, qwen)
    state = read_state(tiny_dir / "flow.pt")
    key = next(iter(state))
    broken = {k: v for k, v in state.items() if k != key} | {"bogus.weight": torch.zeros(1)}
    with pytest.raises(ModelError) as err:
        load_strict(flow, broken, tmp_path / "flow.pt")
    text = str(err.value)
    assert "flow.pt" in text and key in text and "bogus.weight" in text


def test_shape_mismatch_is_reported(tiny_dir, tmp_path):
    family, cfg, qwen = read_model_config(tiny_dir)
    lm, _, _ = build_modules(family, cfg, qwen)
    state = dict(read_state(tiny_dir / "llm.pt"))
    state["speech_embedding.weight"] = torch.zeros(3, 3)
    with pytest.raises(ModelError, match=r"speech_embedding.weight: file \(3, 3\)"):
        load_strict(lm, state, tmp_path / "llm.pt")


def test_hift_accepts_generator_prefix_and_legacy_weight_norm_names(tiny_dir):
    family, cfg, qwen = read_model_config(tiny_dir)
    _, _, hift = build_modules(family, cfg, qwen)
    state = read_state(tiny_dir / "hift.pt")
    legacy = {}
    for k, v in state.items():
        k = k.replace("parametrizations.weight.original0", "weight_g").replace(
            "parametrizations.weight.original1", "weight_v"
        )
        legacy["generator." + k] = v
    load_strict(hift, hift_keys(legacy), tiny_dir / "hift.pt")
    assert torch.equal(hift.state_dict()["conv_post.bias"], state["conv_post.bias"])


def test_unreadable_checkpoint_is_a_model_error(tmp_path):
    bad = tmp_path / "llm.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(ModelError, match=r"llm\.pt"):
        read_state(bad)


@pytest.mark.parametrize("family", FAMILIES)
def test_full_size_yaml_builds_the_manifest_structure(family, tmp_path):
    manifests = [fixture_file(family, f"manifest_{name}.json") for name in ("llm", "flow", "hift")]
    (tmp_path / f"{family}.yaml").write_text(model_yaml(family, FULL))
    cfg = read_yaml(tmp_path / f"{family}.yaml")
    with torch.device("meta"):
        modules = build_modules(family, cfg, qwen_config(FULL))
    for path, module in zip(manifests, modules):
        manifest = json.loads(path.read_text())
        want = {e["key"]: tuple(e["shape"]) for e in manifest["keys"]}
        got = {k: tuple(v.shape) for k, v in module.state_dict().items()}
        assert got == want, f"{family} {path.name}"


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_full_size_builder_directory_loads_strictly(family, tmp_path):
    build_model_dir(tmp_path, family, "full")
    model = load_model(validate_model_dir(tmp_path), torch.device("cpu"))
    assert model.lm.config.hidden_size == 896 and model.lm.config.num_layers == 24


def weights_of(model) -> dict[str, torch.Tensor]:
    return {
        f"{name}.{key}": value
        for name in ("lm", "flow", "hift")
        for key, value in getattr(model, name).state_dict().items()
    }


def test_the_first_load_converts_to_safetensors_and_the_next_maps_them(tiny_dir, tmp_path, monkeypatch):
    """The first start with a cache root writes each .pt once as safetensors; the next reads those (the
    .pt files are not unpickled again) and ends with the very same weights, loaded strictly."""
    import engine.checkpoint as checkpoint

    files, cache = validate_model_dir(tiny_dir), tmp_path / "cache"
    plain = weights_of(load_model(files, torch.device("cpu")))
    first = weights_of(load_model(files, torch.device("cpu"), cache))
    converted = sorted(p.name.split("-")[0] for p in (cache / "weights").rglob("*.safetensors"))
    assert converted == ["flow", "hift", "llm"]
    assert not list((cache / "weights").rglob("*.partial"))

    def unpickled(path):
        raise AssertionError(f"{path} was read again")

    monkeypatch.setattr(checkpoint, "read_state", unpickled)
    second = load_model(files, torch.device("cpu"), cache)
    assert second.lm.llm.model.lm_head.weight.data_ptr() == second.lm.embed_tokens.weight.data_ptr()
    for weights in (first, weights_of(second)):
        assert weights.keys() == plain.keys()
        assert all(torch.equal(weights[k], plain[k]) for k in plain)


def test_the_load_takes_the_files_tensors_without_copying_them(tiny_dir, tmp_path, monkeypatch):
    """The modules hold the (memory-mapped) tensors read from the files: no second copy of every weight on
    the host before the one to the device (the full-size v3: 2.5-6.3 s of load on the idle VM, 0.3-0.7 s
    without)."""
    import engine.checkpoint as checkpoint

    files, cache = validate_model_dir(tiny_dir), tmp_path / "cache"
    load_model(files, torch.device("cpu"), cache)  # converts
    read: list[dict[str, torch.Tensor]] = []
    mapped = checkpoint._mapped
    monkeypatch.setattr(checkpoint, "_mapped", lambda path: read.append(mapped(path)) or read[-1])
    model = load_model(files, torch.device("cpu"), cache)
    assert len(read) == 3  # llm, flow, hift in that order
    for module, state in zip((model.lm, model.flow), read):
        params = dict(module.named_parameters())  # a tied weight once: the LM ties lm_head to its table
        assert params and all(params[k].data_ptr() == state[k].data_ptr() for k in params)


def test_on_an_accelerator_the_converted_files_are_read_onto_it_not_mapped(tiny_dir, tmp_path, monkeypatch):
    """Where the device is an accelerator the LM's and the flow's conversions go through
    ``engine.weights_file`` (one page-locked buffer, each tensor straight onto the device), not memory-mapped
    then copied: the same weights, the tie kept. The CPU stands in for the accelerator (its torch cannot
    page-lock: plain host memory)."""
    import engine.checkpoint as checkpoint
    import engine.device as devices

    files, cache = validate_model_dir(tiny_dir), tmp_path / "cache"
    plain = weights_of(load_model(files, torch.device("cpu"), cache))  # converts
    read: list[Path] = []
    reader = checkpoint.read_onto
    monkeypatch.setattr(devices, "is_accelerator", lambda device: True)
    monkeypatch.setattr(devices, "staging_bytes", lambda n, device: torch.empty(n, dtype=torch.uint8))
    mapped: list[str] = []
    real_mapped = checkpoint._mapped
    monkeypatch.setattr(checkpoint, "_mapped", lambda path: mapped.append(path.name) or real_mapped(path))
    monkeypatch.setattr(checkpoint, "read_onto", lambda path, dev: read.append(path) or reader(path, dev))
    model = load_model(files, torch.device("cpu"), cache)
    # the vocoder's weight norm is folded on the host, as on a cold start: the same bits
    assert [name.split("-")[0] for name in mapped] == ["hift"]
    assert [p.name.split("-")[0] for p in read] == ["llm", "flow"]
    assert model.lm.llm.model.lm_head.weight.data_ptr() == model.lm.embed_tokens.weight.data_ptr()
    weights = weights_of(model)
    assert weights.keys() == plain.keys() and all(torch.equal(weights[k], plain[k]) for k in plain)


def test_where_the_device_refuses_the_reader_the_files_are_mapped_as_before(
    tiny_dir, tmp_path, monkeypatch, caplog
):
    """The reader only makes a start faster: a runtime that cannot page-lock or allocate costs that, not
    the start (logged)."""
    import engine.device as devices

    files, cache = validate_model_dir(tiny_dir), tmp_path / "cache"
    plain = weights_of(load_model(files, torch.device("cpu"), cache))  # converts

    def refused(n, device):
        raise RuntimeError("cudaHostAlloc failed")

    monkeypatch.setattr(devices, "is_accelerator", lambda device: True)
    monkeypatch.setattr(devices, "staging_bytes", refused)
    with caplog.at_level("WARNING", "engine.checkpoint"):
        weights = weights_of(load_model(files, torch.device("cpu"), cache))
    assert all(torch.equal(weights[k], plain[k]) for k in plain)
    assert sum("memory-mapping it instead" in r.getMessage() for r in caplog.records) == 2  # LM, flow


def test_a_converted_file_is_still_loaded_strictly(tiny_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    from engine.checkpoint import converted_path

    files, cache = validate_model_dir(tiny_dir), tmp_path / "cache"
    load_model(files, torch.device("cpu"), cache)
    target = converted_path(tiny_dir / "flow.pt", cache)
    state = load_file(str(target))
    key = sorted(state)[0]
    save_file({k: v for k, v in state.items() if k != key}, str(target))  # a file that lost a key
    with pytest.raises(ModelError, match="missing keys") as err:
        load_model(files, torch.device("cpu"), cache)
    assert key in str(err.value) and "flow.pt" in str(err.value)
    target.write_bytes(b"not safetensors")
    with pytest.raises(ModelError, match="delete it to convert again"):
        load_model(files, torch.device("cpu"), cache)


def test_a_replaced_checkpoint_is_converted_again_and_its_old_conversion_goes(tmp_path):
    from engine.checkpoint import converted_path

    model_dir = build_model_dir(tmp_path / "m", "cosyvoice2", "tiny")
    files, cache = validate_model_dir(model_dir), tmp_path / "cache"
    load_model(files, torch.device("cpu"), cache)
    old = converted_path(model_dir / "hift.pt", cache)
    state = read_state(model_dir / "hift.pt")
    changed = {k: v.clone() + (1.0 if k == "conv_post.bias" else 0.0) for k, v in state.items()}
    torch.save(changed, model_dir / "hift.pt")
    later = (model_dir / "hift.pt").stat().st_mtime_ns + 10**9  # a replaced file is newer, on any clock
    os.utime(model_dir / "hift.pt", ns=(later, later))
    new = converted_path(model_dir / "hift.pt", cache)
    assert new != old
    model = load_model(files, torch.device("cpu"), cache)
    assert new.exists() and not old.exists()
    assert torch.equal(model.hift.state_dict()["conv_post.bias"], changed["conv_post.bias"])


def test_a_conversion_removes_those_whose_checkpoints_are_gone_and_keeps_the_rest(tmp_path):
    """Deleting a model directory frees its conversions at the next conversion (3 folders a model, each as
    large as its .pt); another model's, and a folder without its source note, stay."""
    from engine.checkpoint import converted_path

    cache, folders = tmp_path / "cache", {}
    for name in ("gone", "kept"):
        model_dir = build_model_dir(tmp_path / name, "cosyvoice2", "tiny")
        load_model(validate_model_dir(model_dir), torch.device("cpu"), cache)
        folders[name] = [converted_path(model_dir / f"{m}.pt", cache).parent for m in ("llm", "flow", "hift")]
    unnoted = cache / "weights" / "0123456789abcdef"
    unnoted.mkdir()
    shutil.rmtree(tmp_path / "gone")
    assert all(folder.is_dir() for folder in folders["gone"])
    load_model(
        validate_model_dir(build_model_dir(tmp_path / "new", "cosyvoice2", "tiny")),
        torch.device("cpu"),
        cache,
    )
    assert not any(folder.exists() for folder in folders["gone"])
    assert all(folder.is_dir() for folder in folders["kept"]) and unnoted.is_dir()
    assert len(list((cache / "weights").iterdir())) == 7


def test_modules_built_without_random_init_keep_their_computed_buffers(tiny_dir):
    """The build skips nn.init (the load overwrites every parameter) but not what constructors compute."""
    family, cfg, qwen = read_model_config(tiny_dir)
    torch.manual_seed(0)
    usual = build_modules(family, cfg, qwen)  # the same build, initialised as torch does it
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("engine.checkpoint.no_init", contextlib.nullcontext)
        initialised = build_modules(family, cfg, qwen)
    for plain, init in zip(usual, initialised, strict=True):
        buffers = dict(init.named_buffers(remove_duplicate=False))
        for name, buf in plain.named_buffers(remove_duplicate=False):
            assert torch.equal(buf, buffers[name]), name
    assert any(n.endswith("stft_window") for n, _ in usual[2].named_buffers())


def test_random_init_is_skipped_on_the_building_thread_only():
    seen: list[torch.Tensor] = []
    inside, done = threading.Event(), threading.Event()

    def build() -> None:
        with no_init():
            seen.append(torch.nn.init.ones_(torch.zeros(3)))  # skipped: stays zeros
            inside.set()
            done.wait(10)

    builder = threading.Thread(target=build)
    builder.start()
    assert inside.wait(10)
    elsewhere = torch.nn.init.ones_(torch.zeros(3))  # another thread meanwhile: initialised
    done.set()
    builder.join(10)
    assert torch.equal(seen[0], torch.zeros(3)) and torch.equal(elsewhere, torch.ones(3))
    assert torch.equal(torch.nn.init.ones_(torch.zeros(3)), torch.ones(3))  # restored after
