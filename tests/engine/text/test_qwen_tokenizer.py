"""The Qwen tokenizer built with ``tokenizers`` alone: the same ids, vocabulary and decoded text as
transformers' ``AutoTokenizer`` plus the reference's ``add_special_tokens``, without importing
transformers."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine.demo.tiny_tokenizer import write_tiny_tokenizer
from engine.errors import ModelError
from engine.text.frontend import FAMILIES, load_tokenizer, special_tokens
from engine.text.qwen_tokenizer import PRETOKENIZE_PATTERN, load_qwen_tokenizer

ROOT = Path(__file__).resolve().parents[3]

TEXTS = [
    "Hello world, I'm here. DON'T stop! They'LL see; we've 'd",
    "今天天气很好，我们一起去河边的公园散步吧。",
    "a  b   c\n\n d\t e  ",
    " [breath] hi<|endofprompt|>you [laughter]x</strong>",
    "e\u0301 caf\u00e9 ﬁ 😀 12345 3.14 ①②",
    "<|im_start|>x<|im_end|>y<|endoftext|>",
    "You are a helpful assistant.<|endofprompt|>请[j][ǐ]读",
    "",
    "   ",
    "\r\n\r\n",
    "<strong>强调</strong>[quick_breath] ok <|endof",
    "Émoji 🙂 and 한국어 too, ばかり",
]
# material for random strings: letters, CJK, digits, marks, whitespace, a combining accent, and specials
_PIECES = [*"abcXYZ éü中文字한ば0189.,!?'\"-:;()\n\r\t ", "\u0301", "'s", "'LL", "[breath]"]
_PIECES.append("<|endofprompt|>")


def _random_texts(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(_PIECES) for _ in range(rng.randint(1, 40))) for _ in range(count)]


def _reference(folder: Path, family: str):
    """What the reference builds: AutoTokenizer, then eos/pad and the family's specials."""
    from transformers import AutoTokenizer

    data = json.loads((ROOT / "engine/text/special_tokens.json").read_text(encoding="utf-8"))
    hf = AutoTokenizer.from_pretrained(str(folder))
    extra = {"eos_token": data["eos_token"], "pad_token": data["pad_token"]}
    hf.add_special_tokens({**extra, "additional_special_tokens": special_tokens(family)})
    return hf


def _assert_same(hf, ours, texts: list[str]) -> None:
    assert ours.vocab == dict(hf.get_vocab())
    for text in texts:
        ids = hf(text, add_special_tokens=False)["input_ids"]
        assert ours.encode(text) == ids, text
        for skip in (True, False):
            assert ours.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip), (text, skip)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("vocab_size", [None, 400])
def test_ids_vocabulary_and_text_match_autotokenizer_from_the_released_files(tmp_path, family, vocab_size):
    folder = write_tiny_tokenizer(tmp_path / "CosyVoice-BlankEN", family, vocab_size)
    assert not (folder / "tokenizer.json").exists()  # the release's layout: converted from vocab + merges
    _assert_same(_reference(folder, family), load_tokenizer(folder, family), TEXTS + _random_texts(300))


def _dense(folder: Path) -> Path:
    """The tiny folder with the Qwen specials moved right after its ordinary ids (512-514), as the release
    has them right after its 151643: a vocabulary without holes, which tokenizer.json keeps as it is."""
    vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    first = max(i for t, i in vocab.items() if not t.startswith("<|")) + 1
    declared = config["added_tokens_decoder"]
    moved = {str(first + n): declared[key] for n, key in enumerate(sorted(declared, key=int))}
    vocab = {t: i for t, i in vocab.items() if not t.startswith("<|")}
    vocab.update({entry["content"]: int(key) for key, entry in moved.items()})
    config["added_tokens_decoder"] = moved
    (folder / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


def test_a_folder_with_tokenizer_json_is_read_from_it(tmp_path):
    """A re-saved copy (``save_pretrained`` writes tokenizer.json, here with more added tokens than the
    config of the release) gives what AutoTokenizer gives from it."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(_dense(write_tiny_tokenizer(tmp_path / "release", "cosyvoice3"))))
    hf.add_special_tokens({"additional_special_tokens": special_tokens("cosyvoice3")})
    saved = tmp_path / "saved"
    hf.save_pretrained(str(saved))
    (saved / "vocab.json").unlink()  # only tokenizer.json can have been read
    hf = AutoTokenizer.from_pretrained(str(saved))
    ours = load_qwen_tokenizer(saved)
    assert ours.get_vocab(with_added_tokens=True) == dict(hf.get_vocab())
    for text in TEXTS + _random_texts(100, seed=1):
        ids = hf(text, add_special_tokens=False)["input_ids"]
        assert ours.encode(text, add_special_tokens=False).ids == ids, text
        assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True), text


def test_a_saved_copy_whose_added_ids_moved_fails_loudly(tmp_path):
    """The tiny release's vocabulary has holes below its specials: tokenizers renumbers the added tokens of
    its tokenizer.json on reading (transformers then silently gives <|endofprompt|> 515): ours refuses."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(write_tiny_tokenizer(tmp_path / "release", "cosyvoice3")))
    hf.add_special_tokens({"additional_special_tokens": special_tokens("cosyvoice3")})
    hf.save_pretrained(str(tmp_path / "saved"))
    with pytest.raises(ModelError, match=re.escape("'<|endofprompt|>' got id 515, its config says 151646")):
        load_qwen_tokenizer(tmp_path / "saved")


def test_the_split_pattern_is_qwen2s():
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    assert PRETOKENIZE_PATTERN == PRETOKENIZE_REGEX


def test_loading_the_tokenizer_imports_no_transformers(tmp_path):
    folder = write_tiny_tokenizer(tmp_path, "cosyvoice3")
    code = (
        "import sys; from engine.text.frontend import load_tokenizer; "
        f"t = load_tokenizer({str(folder)!r}, 'cosyvoice3'); assert t.encode('hello [breath]'); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _broken(tmp_path: Path, name: str, content: str) -> Path:
    folder = write_tiny_tokenizer(tmp_path, "cosyvoice3")
    (folder / name).write_text(content, encoding="utf-8")
    return folder


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("merges.txt", "#version: 0.2\nĠ t h\n", "merge 1 is not two symbols"),
        ("merges.txt", "#version: 0.2\nqq zz\n", "cannot build the Qwen tokenizer"),
        ("vocab.json", "[1, 2]", "expected a JSON object"),
        ("vocab.json", "{not json", "cannot read"),
        ("tokenizer.json", "{not json", "cannot load the Qwen tokenizer"),
    ],
)
def test_broken_files_fail_loudly(tmp_path, name, content, message):
    with pytest.raises(ModelError, match=message):
        load_qwen_tokenizer(_broken(tmp_path, name, content))


def test_an_added_token_off_its_declared_id_fails_loudly(tmp_path):
    """The specials' ids fix the LM's embedding rows: a config whose added token cannot take its id (here
    one declared past a gap) must not load with shifted ids."""
    folder = write_tiny_tokenizer(tmp_path, "cosyvoice3")
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["added_tokens_decoder"]["151700"] = {"content": "<|gap|>", "special": True}
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(ModelError, match=re.escape("'<|gap|>' got id 151646, its config says 151700")):
        load_qwen_tokenizer(folder)


def test_a_vocabulary_without_the_end_of_text_token_fails_loudly(tmp_path):
    folder = write_tiny_tokenizer(tmp_path, "cosyvoice3")
    vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    del vocab["<|endoftext|>"], config["added_tokens_decoder"]["151643"]
    (folder / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(ModelError, match=re.escape("has no '<|endoftext|>'")):
        load_tokenizer(folder, "cosyvoice3")
