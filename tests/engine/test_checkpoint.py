"""Checkpoint loading: builder-made directories load strictly; bad files give errors naming keys and files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.checkpoint import build_modules, hift_keys, load_model, load_strict, read_model_config, read_state
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
