"""The LM's export for vLLM, written from llm.pt's state dict (what the engine does while the model loads)
is the export of the loaded SpeechLM, and a second start finds it in the cache without reading llm.pt."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from engine.checkpoint import load_model, read_model_config, read_state
from engine.demo.make_model import build_model_dir
from engine.hub import validate_model_dir
from engine.lm.hf_export import BIAS_FILE, WEIGHTS_FILE, export_dir, export_hf


@pytest.mark.parametrize("family", ["cosyvoice2", "cosyvoice3"])
def test_the_export_from_llm_pt_is_the_export_of_the_loaded_lm(tmp_path, family):
    files = validate_model_dir(build_model_dir(tmp_path / "model", family, "tiny"))
    model = load_model(files, torch.device("cpu"))
    qwen = read_model_config(files.root)[2]
    loaded = export_hf(model.lm, model.qwen_config, files.llm, tmp_path / "a")
    from_file = export_hf(read_state(files.llm), qwen, files.llm, tmp_path / "b")
    assert from_file == export_dir(files.llm, tmp_path / "b") and (from_file / WEIGHTS_FILE).is_file()
    want, got = load_file(str(loaded / WEIGHTS_FILE)), load_file(str(from_file / WEIGHTS_FILE))
    assert sorted(got) == sorted(want) and "lm_head.weight" in got and "model.embed_tokens.weight" in got
    for key, value in want.items():
        assert got[key].dtype == torch.bfloat16
        torch.testing.assert_close(got[key], value, atol=0, rtol=0)
    config = json.loads((from_file / "config.json").read_text())
    assert config == json.loads((loaded / "config.json").read_text())
    assert config["vocab_size"] == model.lm.speech_embedding.weight.shape[0]
    has_bias = model.lm.llm_decoder.bias is not None
    assert (from_file / BIAS_FILE).is_file() is has_bias
    if has_bias:
        bias = torch.load(from_file / BIAS_FILE, weights_only=True)
        torch.testing.assert_close(bias, model.lm.llm_decoder.bias.float(), atol=0, rtol=0)
    # warm: the finished export is found by llm.pt's fingerprint, nothing is read from the weights given
    assert export_hf({}, qwen, files.llm, tmp_path / "b") == from_file
