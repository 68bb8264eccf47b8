"""Speech LM: parity with the official Qwen2LM / CosyVoice3LM (golden fixtures), batched KV-cache decode."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.errors import InvalidInput, ModelError
from engine.lm.lm_config import SpeechLMConfig
from engine.lm.speech_lm import SpeechLM
from tests.conftest import FAMILIES, NO_CASES, fixture_file, tiny_cases

CASES = tiny_cases()
needs_fixtures = pytest.mark.skipif(not CASES, reason=NO_CASES)
case_param = pytest.mark.parametrize("case", CASES, ids=[p.parent.name for p in CASES])


def family_of(case: Path) -> str:
    yamls = sorted(case.glob("*_tiny.yaml"))
    assert len(yamls) == 1, f"{case}: expected one *_tiny.yaml, found {yamls}"
    return yamls[0].name.removesuffix("_tiny.yaml")


@functools.cache  # read-only use: tests never change the weights
def load_tiny(case: Path) -> SpeechLM:
    qwen = json.loads(fixture_file(case / "CosyVoice-BlankEN_config.json").read_text())
    model = SpeechLM(SpeechLMConfig.from_qwen_config(family_of(case), qwen))
    model.load_state_dict(torch.load(fixture_file(case / "llm.pt"), weights_only=True), strict=True)
    return model.eval()


def ref(case: Path) -> dict[str, np.ndarray]:
    with np.load(fixture_file(case / "ref_llm.npz")) as z:
        return {k: z[k] for k in z.files}


def ids(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a.reshape(-1)).long()


def reference_prefix(model: SpeechLM, r: dict[str, np.ndarray]) -> torch.Tensor:
    return model.prefix_embeds(ids(r["text"]), ids(r["prompt_text"]), ids(r["prompt_speech_token"]))


@needs_fixtures
@case_param
@torch.no_grad()
def test_prefix_matches_reference(case: Path) -> None:
    model, r = load_tiny(case), ref(case)
    torch.testing.assert_close(
        reference_prefix(model, r), torch.from_numpy(r["decode_lm_input_prefix"][0]), atol=1e-5, rtol=0
    )


@needs_fixtures
@case_param
@torch.no_grad()
def test_teacher_forced_pass(case: Path) -> None:
    model, r = load_tiny(case), ref(case)
    hidden = model(torch.from_numpy(r["tf_lm_input"][0]))
    torch.testing.assert_close(hidden, torch.from_numpy(r["tf_hidden_last"][0]), atol=1e-4, rtol=0)
    start = int(r["tf_speech_positions_start"])
    torch.testing.assert_close(
        model.logprobs(hidden[start:]), torch.from_numpy(r["tf_logp_speech_positions"][0]), atol=1e-4, rtol=0
    )


@needs_fixtures
@case_param
@torch.no_grad()
def test_greedy_kv_cache_decode(case: Path) -> None:
    model, r = load_tiny(case), ref(case)
    prefix = reference_prefix(model, r)
    cache = model.new_cache(capacity=max(1, len(prefix) // 2))  # smaller than the prefix: the cache must grow
    hidden = model.prefill(prefix, cache)
    tokens = []
    for step, expected in enumerate(torch.from_numpy(r["decode_step_scores"])):
        logp = model.logprobs(hidden)
        if step < int(r["min_len"]):
            logp[model.config.min_len_mask_index] = -float("inf")
        finite = torch.isfinite(expected)
        assert torch.equal(torch.isfinite(logp), finite), f"step {step}: -inf positions differ"
        torch.testing.assert_close(logp[finite], expected[finite], atol=1e-4, rtol=0)
        tokens.append(int(logp.argmax()))
        hidden = model.decode(model.speech_embeds(torch.tensor(tokens[-1:])), [cache])[0]
    assert tokens == r["decode_tokens"].tolist()
    assert cache.length == r["decode_lm_input_prefix"].shape[1] + len(tokens)


def run_alone(model: SpeechLM, prefix: torch.Tensor, steps: int) -> tuple[list[torch.Tensor], list[int]]:
    cache = model.new_cache()
    hidden, hiddens, tokens = model.prefill(prefix, cache), [], []
    for _ in range(steps):
        tokens.append(int(model.logprobs(hidden).argmax()))
        hidden = model.decode(model.speech_embeds(torch.tensor(tokens[-1:])), [cache])[0]
        hiddens.append(hidden)
    return hiddens, tokens


@needs_fixtures
@case_param
@torch.no_grad()
def test_batched_decode_equals_each_alone(case: Path) -> None:
    model, r = load_tiny(case), ref(case)
    full = reference_prefix(model, r)
    n = len(full)
    prefixes = [full, full[: max(1, 2 * n // 3)], full[: max(1, n // 3)]]  # other lengths: padding, masks
    alone = [run_alone(model, p, steps=6) for p in prefixes]
    caches = [model.new_cache(capacity=2) for _ in prefixes]
    for p, c in zip(prefixes, caches):
        model.prefill(p, c)
    for step in range(6):
        step_tokens = torch.tensor([tokens[step] for _, tokens in alone])
        hidden = model.decode(model.speech_embeds(step_tokens), caches)
        torch.testing.assert_close(hidden, torch.stack([h[step] for h, _ in alone]), atol=1e-5, rtol=0)
    assert [c.length for c in caches] == [len(p) + 6 for p in prefixes]


@needs_fixtures
@case_param
@torch.no_grad()
def test_chunked_prefill_equals_one_prefill(case: Path) -> None:
    model, r = load_tiny(case), ref(case)
    prefix = reference_prefix(model, r)
    whole = model.prefill(prefix, model.new_cache())
    cache, split = model.new_cache(capacity=1), max(1, len(prefix) // 2)
    model.prefill(prefix[:split], cache)
    torch.testing.assert_close(model.prefill(prefix[split:], cache), whole, atol=1e-5, rtol=0)


@needs_fixtures
@case_param
@torch.no_grad()
def test_assign_load_keeps_tied_table_and_bf16_runs(case: Path) -> None:
    model, r = load_tiny(case), ref(case)
    with torch.device("meta"):
        lazy = SpeechLM(model.config)
    state = torch.load(fixture_file(case / "llm.pt"), weights_only=True)
    lazy.load_state_dict(state, strict=True, assign=True)
    lazy.eval()
    assert lazy.llm.model.lm_head.weight is lazy.embed_tokens.weight
    embeds = torch.from_numpy(r["tf_lm_input"][0])
    torch.testing.assert_close(lazy(embeds), model(embeds), atol=0, rtol=0)
    half = lazy.to(torch.bfloat16)
    hidden = half.prefill(embeds.bfloat16(), half.new_cache())
    assert hidden.dtype == torch.bfloat16 and half.logprobs(hidden).dtype == torch.float32
    torch.testing.assert_close(hidden.float(), model(embeds)[-1], atol=0.15, rtol=0.05)


@needs_fixtures
@case_param
def test_prefix_rejects_out_of_range_ids(case: Path) -> None:
    model = load_tiny(case)
    with pytest.raises(InvalidInput, match="prompt speech"):
        model.prefix_embeds(torch.tensor([1, 2]), None, torch.tensor([model.config.speech_token_size]))
    with pytest.raises(InvalidInput, match="text"):
        model.prefix_embeds(torch.tensor([model.config.text_vocab_size]))


@pytest.mark.parametrize("family", FAMILIES)
def test_full_size_structure_matches_manifest(family: str) -> None:
    manifest = json.loads(fixture_file(family, "manifest_llm.json").read_text())
    config = SpeechLMConfig.from_qwen_config(family, manifest["qwen2_config_assumed"])
    assert config == SpeechLMConfig.full_size(family)
    with torch.device("meta"):
        model = SpeechLM(config)
    shapes = {k: list(v.shape) for k, v in model.state_dict().items()}
    assert shapes == {e["key"]: e["shape"] for e in manifest["keys"]}
    assert sum(p.numel() for p in model.parameters()) == manifest["num_parameters_unique"]
    for a, b in manifest["shared_storage_keys"]:
        assert model.get_parameter(a) is model.get_parameter(b)


def test_special_ids_per_family() -> None:
    v2, v3 = SpeechLMConfig.full_size("cosyvoice2"), SpeechLMConfig.full_size("cosyvoice3")
    assert (v2.speech_vocab_size, v2.decoder_bias, v2.has_llm_embedding) == (6564, True, True)
    assert (v3.speech_vocab_size, v3.decoder_bias, v3.has_llm_embedding) == (6761, False, False)
    assert (v2.special_table, v2.sos_id, v2.task_id, v2.eos_id, v2.fill_id) == (
        "llm_embedding",
        0,
        1,
        6561,
        6563,
    )
    assert (v3.special_table, v3.sos_id, v3.task_id, v3.eos_id, v3.fill_id) == (
        "speech_embedding",
        6561,
        6563,
        6562,
        6564,
    )
    assert v2.stop_ids == {6561, 6562, 6563} and v3.stop_ids == set(range(6561, 6761))
    assert v2.min_len_mask_index == v3.min_len_mask_index == 6561


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="family"):
        SpeechLMConfig(family="cosyvoice1")
    with pytest.raises(ValueError, match="num_kv_heads"):
        SpeechLMConfig(num_heads=14, num_kv_heads=4)
    with pytest.raises(ModelError, match="num_hidden_layers"):
        SpeechLMConfig.from_qwen_config("cosyvoice2", {"hidden_size": 64, "num_attention_heads": 4})
    with pytest.raises(ModelError, match="rope_scaling"):
        SpeechLMConfig.from_qwen_config("cosyvoice2", {"rope_scaling": {"type": "yarn"}})
