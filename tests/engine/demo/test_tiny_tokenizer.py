"""The tiny Qwen2-compatible tokenizer: loads like the release, small ordinary ids, real special ids."""

from __future__ import annotations

import json

import pytest

from engine.demo.tiny_tokenizer import DEFAULT_VOCAB_SIZE, QWEN_SPECIALS, write_tiny_tokenizer
from engine.text.frontend import END_OF_PROMPT, END_OF_PROMPT_ID, FAMILIES, load_tokenizer
from tests.conftest import fixture_file

TEXTS = [
    "Hello world, how are you?",
    "今天天气很好，我们去散步吧。",
    "Émoji 🙂 and 한국어 too",
    "x\ty\n\nz  ",
]


def test_folder_has_the_release_layout(tmp_path):
    folder = write_tiny_tokenizer(tmp_path / "CosyVoice-BlankEN", "cosyvoice3")
    assert sorted(p.name for p in folder.iterdir()) == ["merges.txt", "tokenizer_config.json", "vocab.json"]


@pytest.mark.parametrize("family", FAMILIES)
def test_autotokenizer_loads_it_with_qwen_specials_at_real_ids(tmp_path, family):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(write_tiny_tokenizer(tmp_path, family)))
    for token_id, token in QWEN_SPECIALS.items():
        assert hf.convert_tokens_to_ids(token) == token_id
    assert hf("hello")["input_ids"] == hf("hello", add_special_tokens=False)["input_ids"]  # no BOS/EOS


@pytest.mark.parametrize(
    ("family", "vocab_size"), [("cosyvoice2", None), ("cosyvoice3", None), ("cosyvoice2", 400)]
)
def test_ordinary_ids_stay_below_the_vocab_size(tmp_path, family, vocab_size):
    tokenizer = load_tokenizer(write_tiny_tokenizer(tmp_path, family, vocab_size), family)
    bound = vocab_size or DEFAULT_VOCAB_SIZE[family]
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids and max(ids) < bound, text
        assert tokenizer.decode(ids) == text
    merges = (tmp_path / "merges.txt").read_text(encoding="utf-8").splitlines()[1:]
    assert len(merges) > 20  # real BPE merges, not bytes only


@pytest.mark.parametrize("family", FAMILIES)
def test_load_tokenizer_gives_the_specials_their_reference_ids(tmp_path, family):
    fixture = json.loads(fixture_file("tokenizer_special_tokens.json").read_text(encoding="utf-8"))[family]
    tokenizer = load_tokenizer(write_tiny_tokenizer(tmp_path, family), family)
    expected = {
        **fixture["derived_ids_ASSUMPTION"]["pre_existing"],
        **fixture["derived_ids_ASSUMPTION"]["added"],
    }
    assert {t: tokenizer.token_id(t) for t in expected} == expected
    ids = [tokenizer.token_id(t) for t in fixture["additional_special_tokens_in_order"]]
    assert ids[2] == tokenizer.token_id(END_OF_PROMPT) == END_OF_PROMPT_ID
    assert ids[2:] == list(range(END_OF_PROMPT_ID, fixture["derived_ids_ASSUMPTION"]["last_id"] + 1))
    assert ids[-1] == fixture["derived_ids_ASSUMPTION"]["last_id"]


def test_builder_is_deterministic(tmp_path):
    a = write_tiny_tokenizer(tmp_path / "a", "cosyvoice3")
    b = write_tiny_tokenizer(tmp_path / "b", "cosyvoice3")
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()


@pytest.mark.parametrize("vocab_size", [256, 151644])
def test_vocab_size_out_of_range_is_refused(tmp_path, vocab_size):
    with pytest.raises(ValueError, match="vocab_size"):
        write_tiny_tokenizer(tmp_path, "cosyvoice2", vocab_size)
