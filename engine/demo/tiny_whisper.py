"""A tiny random-weight multilingual Whisper folder, built offline (no download), for demo-tiny and tests.

The folder is what ``WhisperForConditionalGeneration.from_pretrained`` and ``WhisperProcessor`` read from a
released checkpoint: config.json + model.safetensors, generation_config.json (language and task token ids,
so ``generate`` detects the language as the real model does), preprocessor_config.json (80 mel bins, 16 kHz,
30 s windows) and a byte-level BPE tokenizer (vocab.json with the 256 byte symbols, no merges) plus Whisper's
special tokens in the released order: <|endoftext|>, <|startoftranscript|>, the 100 language tokens,
<|translate|>, <|transcribe|>, <|startoflm|>, <|startofprev|>, <|nocaptions|>, <|notimestamps|>. The weights
are random, so its transcripts are noise; every code path (detection, decoding, the API) still runs.
"""

from __future__ import annotations

import json
from pathlib import Path

NUM_BYTE_SYMBOLS = 256
TASKS = ("<|translate|>", "<|transcribe|>")
TAIL = ("<|startoflm|>", "<|startofprev|>", "<|nocaptions|>", "<|notimestamps|>")


def byte_symbols() -> list[str]:
    """GPT-2's byte -> printable character table (byte-level BPE writes every byte as one of these)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(NUM_BYTE_SYMBOLS)]


def special_tokens() -> list[str]:
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    languages = [f"<|{code}|>" for code in LANGUAGES]
    return ["<|endoftext|>", "<|startoftranscript|>", *languages, *TASKS, *TAIL]


def write_tokenizer(out: Path) -> dict[str, int]:
    """vocab.json (bytes then specials), empty merges, the tokenizer config; returns the special ids."""
    vocab = {sym: i for i, sym in enumerate(byte_symbols())}
    specials = {tok: NUM_BYTE_SYMBOLS + i for i, tok in enumerate(special_tokens())}
    (out / "vocab.json").write_text(json.dumps(vocab | specials, ensure_ascii=False))
    (out / "merges.txt").write_text("#version: 0.2\n")
    added = {str(i): {"content": t, "special": True, "normalized": False, "lstrip": False,
                      "rstrip": False, "single_word": False} for t, i in specials.items()}  # fmt: skip
    config = {
        "tokenizer_class": "WhisperTokenizer", "model_max_length": 448, "added_tokens_decoder": added,
        "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>", "errors": "replace",
    }  # fmt: skip
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1))
    (out / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return specials


def generation_config(ids: dict[str, int]) -> dict[str, object]:
    languages = {tok: i for tok, i in ids.items() if tok not in (*TASKS, *TAIL) and len(tok) <= 9}
    languages.pop("<|endoftext|>", None)
    return {
        "decoder_start_token_id": ids["<|startoftranscript|>"], "eos_token_id": ids["<|endoftext|>"],
        "pad_token_id": ids["<|endoftext|>"], "bos_token_id": ids["<|endoftext|>"],
        "no_timestamps_token_id": ids["<|notimestamps|>"], "is_multilingual": True,
        "lang_to_id": languages, "task_to_id": {"translate": ids[TASKS[0]], "transcribe": ids[TASKS[1]]},
        # random weights would mostly pick special tokens (an empty transcript): only bytes may be drawn,
        # so the noise shows as text and the decode path is exercised
        "max_length": 64, "begin_suppress_tokens": [ids["<|endoftext|>"]],
        "suppress_tokens": sorted(i for t, i in ids.items() if t != "<|endoftext|>"),
    }  # fmt: skip


def build_whisper_dir(out: str | Path, seed: int = 0) -> Path:
    """Write the folder (overwriting); returns its path. Seconds on a CPU, ~1 MB on disk."""
    import torch
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(out)
    gen = generation_config(ids)
    config = WhisperConfig(
        vocab_size=NUM_BYTE_SYMBOLS + len(ids), num_mel_bins=80, d_model=32, encoder_layers=1,
        decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_source_positions=1500, max_target_positions=64,
        decoder_start_token_id=gen["decoder_start_token_id"], eos_token_id=gen["eos_token_id"],
        pad_token_id=gen["pad_token_id"], bos_token_id=gen["bos_token_id"],
    )  # fmt: skip
    torch.manual_seed(seed)
    WhisperForConditionalGeneration(config).save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps(gen, indent=1))
    WhisperFeatureExtractor(feature_size=80).save_pretrained(out)
    return out
