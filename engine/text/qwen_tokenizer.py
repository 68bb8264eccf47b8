"""The Qwen2 byte-level BPE tokenizer (the release's ``CosyVoice-BlankEN`` folder) built with ``tokenizers``
alone, as transformers' ``Qwen2TokenizerFast`` builds it, without importing transformers.

Why: transformers' import is 2 s on a 2-core VM and 13-18 s on a GPU host with vLLM installed, and the
tokenizer was all the serving path wanted from it (it sat on the start's path beside the weights, and each
text worker process paid it again). The parity with ``AutoTokenizer.from_pretrained`` is a test
(``tests/engine/text/test_qwen_tokenizer.py``).

The release ships ``vocab.json`` + ``merges.txt`` + ``tokenizer_config.json`` (no ``tokenizer.json``): the
tokenizer is then the one transformers converts from those files (NFC, Qwen2's split pattern, byte-level BPE
without an unknown token, byte-level decoding). A folder with ``tokenizer.json`` (a re-saved copy) is read
from it. Either way the config's ``added_tokens_decoder`` entries are added in id order, each checked to
land on its declared id.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from engine.errors import ModelError

# Qwen2's pre-tokenisation: contractions, letter runs with one leading non-letter, single digits,
# punctuation runs, line breaks, and whitespace (a run before a word keeps its last space for the word).
PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


def qwen_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """Qwen2's split pattern, then bytes mapped to the byte-level alphabet (no prefix space)."""
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def load_qwen_tokenizer(folder: str | Path) -> Tokenizer:
    """The folder's tokenizer with its config's added tokens; ModelError for missing or broken files."""
    path = Path(folder)
    config = _read_json(path / "tokenizer_config.json", required=False)
    if (path / "tokenizer.json").is_file():
        tokenizer = _from_file(path / "tokenizer.json")
    else:
        tokenizer = _from_vocab_and_merges(path)
    _add_declared(tokenizer, config.get("added_tokens_decoder", {}), path)
    return tokenizer


def _from_file(path: Path) -> Tokenizer:
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a plain Exception for any file it cannot parse
        raise ModelError(f"cannot load the Qwen tokenizer from {path}: {e}") from e


def _from_vocab_and_merges(path: Path) -> Tokenizer:
    """What transformers' Qwen2 converter makes of vocab.json + merges.txt."""
    vocab, merges = _read_json(path / "vocab.json", required=True), _read_merges(path / "merges.txt")
    try:
        bpe = _bpe(vocab, merges)
    except Exception as e:  # tokenizers raises a plain Exception for a merge of unknown symbols
        raise ModelError(f"cannot build the Qwen tokenizer from {path}: {e}") from e
    tokenizer = Tokenizer(bpe)
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = qwen_pre_tokenizer()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def _bpe(vocab: dict[str, Any], merges: list[tuple[str, str]]) -> models.BPE:
    """Byte-level BPE without an unknown token, prefix or suffix (every byte is a symbol)."""
    return models.BPE(
        vocab={str(k): int(v) for k, v in vocab.items()},
        merges=merges,
        dropout=None,
        unk_token=None,
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
        byte_fallback=False,
    )


def _read_merges(path: Path) -> list[tuple[str, str]]:
    """merges.txt: an optional "#version" first line, then one "left right" pair a line (rank order)."""
    try:
        lines = path.read_text(encoding="utf-8").split("\n")
    except OSError as e:
        raise ModelError(f"cannot read {path}: {e}") from e
    if lines and lines[0].startswith("#version"):
        lines = lines[1:]
    merges = []
    for number, line in enumerate(lines, start=1):
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ModelError(f"{path}: merge {number} is not two symbols: {line!r}")
        merges.append((parts[0], parts[1]))
    return merges


def _add_declared(tokenizer: Tokenizer, declared: dict[str, Any], path: Path) -> None:
    """The config's added tokens (the Qwen specials, 151643-151645) in id order, flags as declared; each
    must take its declared id, which fixes the ids of every token added after them."""
    for key in sorted(declared, key=int):
        entry = declared[key]
        token = AddedToken(
            entry["content"],
            single_word=bool(entry.get("single_word", False)),
            lstrip=bool(entry.get("lstrip", False)),
            rstrip=bool(entry.get("rstrip", False)),
            normalized=bool(entry.get("normalized", not entry.get("special", False))),
            special=bool(entry.get("special", False)),
        )
        if entry.get("special", False):
            tokenizer.add_special_tokens([token])
        else:
            tokenizer.add_tokens([token])
        got = tokenizer.token_to_id(entry["content"])
        if got != int(key):
            raise ModelError(f"{path}: added token {entry['content']!r} got id {got}, its config says {key}")


def _read_json(path: Path, *, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise ModelError(f"{path}: missing (a Qwen tokenizer: vocab.json + merges.txt or tokenizer.json)")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ModelError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ModelError(f"{path}: expected a JSON object")
    return data
