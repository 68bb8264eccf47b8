"""The random-weight model builder: every size loads strictly, and "small" is servable by vLLM."""

from __future__ import annotations

import json

import pytest
import torch

from engine.checkpoint import load_model
from engine.demo.make_model import SIZES, build_model_dir
from engine.hub import validate_model_dir


@pytest.mark.parametrize("family", ["cosyvoice2", "cosyvoice3"])
def test_small_model_loads_strictly_with_head_dims_vllm_can_compile(family, tmp_path):
    out = build_model_dir(tmp_path / family, family, "small")
    qwen = json.loads((out / "CosyVoice-BlankEN" / "config.json").read_text())
    assert qwen["hidden_size"] // qwen["num_attention_heads"] >= 16
    model = load_model(validate_model_dir(out), torch.device("cpu"))
    assert model.family == family
    assert (model.lm.llm_decoder.bias is not None) == (family == "cosyvoice2")  # v2's head has a bias


def test_unknown_size_is_refused(tmp_path):
    with pytest.raises(ValueError, match="size one of"):
        build_model_dir(tmp_path, "cosyvoice3", "huge")
    assert set(SIZES) == {"tiny", "small", "full"}


def test_a_demo_folder_is_built_once_and_again_when_its_generators_change(tmp_path):
    from engine.demo.make_model import built_once

    source, built = tmp_path / "gen.py", []
    source.write_text("v1")

    def build(out):
        built.append(out)
        out.mkdir(parents=True, exist_ok=True)
        return out

    root = tmp_path / "demo"
    assert built_once(root, build, [source]) == built_once(root, build, [source]) == root
    assert built == [root]  # the second start reused it
    source.write_text("v2")
    built_once(root, build, [source])
    assert built == [root, root]
    (root / ".built").unlink()  # a build cut short left no stamp: built again
    built_once(root, build, [source])
    assert len(built) == 3
