"""A small Qwen2-compatible tokenizer folder (the CosyVoice-BlankEN layout) for tests and benchmarks.

The folder holds vocab.json, merges.txt and tokenizer_config.json, like the release (no tokenizer.json), so
``AutoTokenizer.from_pretrained`` and ``engine.text.frontend.load_tokenizer`` treat it exactly as the real
one. The vocabulary is byte-level BPE: the 256 byte symbols plus merges learned from a short built-in English
and Chinese text, so every ordinary text id is below ``vocab_size``.

Special-token ids are the real ones: <|endoftext|> 151643, <|im_start|> 151644, <|im_end|> 151645, and the
CosyVoice specials that ``load_tokenizer`` adds then follow from 151646 (<|endofprompt|>) in the official
order, up to 151662 (v2) or 151923 (v3). How: a fast tokenizer gives a newly added token the id "largest
added id + 1" once an added id is at or above the model vocabulary size, otherwise the model vocabulary
size. So the three Qwen specials are written into vocab.json at their real ids (a sparse vocabulary) and
declared again in ``added_tokens_decoder``; everything added later then continues at 151646. (The slow
Python tokenizer would number added tokens by ``len(tokenizer)`` instead; AutoTokenizer loads the fast one.)

Consequence for tiny models: the text embedding needs ``id_limit`` rows (151663 for v2, 151924 for v3),
whatever ``vocab_size`` is. Tiny model directories should therefore use the released 151936 text rows at a
tiny hidden size, as the v3 golden fixture does. The v2 golden fixture's 300-row table only covers ordinary
text ids; it cannot embed <|endofprompt|> (v2 instruct) or inline tags such as [breath].
"""

from __future__ import annotations

import json
from pathlib import Path

from engine.text.frontend import check_family
from engine.text.qwen_tokenizer import qwen_pre_tokenizer

QWEN_SPECIALS = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"}
# Ordinary ids stay below this; v2's 300 matches the v2 golden fixture's text vocabulary.
DEFAULT_VOCAB_SIZE = {"cosyvoice2": 300, "cosyvoice3": 512}
NUM_BYTE_SYMBOLS = 256

_CORPUS = """\
The weather is lovely today, so we are going for a walk in the park by the river.
She said that the quick brown fox jumps over the lazy dog, and then she laughed.
Streaming speech synthesis starts speaking before the whole sentence has been generated.
Please read this sentence slowly and clearly, with a warm and friendly voice.
How long does it take to get from the station to the museum? About twenty minutes on foot.
I think that this is one of the best things that has ever happened to me.
今天天气很好，我们一起去河边的公园散步吧。
她说这只敏捷的棕色狐狸跳过了那只懒狗，然后笑了起来。
流式语音合成在整句话生成之前就开始说话了。
请用温暖友好的声音，慢慢地、清楚地读这句话。
从车站到博物馆要多长时间？走路大约二十分钟。
我觉得这是我这辈子遇到的最好的事情之一。
"""


def train_byte_bpe(vocab_size: int, corpus: str = _CORPUS) -> tuple[dict[str, int], list[str]]:
    """Byte-level BPE vocabulary (ids 0..<vocab_size) and merges learned on ``corpus`` with Qwen2's
    pre-tokenisation; deterministic for a given corpus and ``tokenizers`` version."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = qwen_pre_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(corpus.splitlines(), trainer=trainer)
    model = json.loads(tokenizer.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return dict(model["vocab"]), merges


def tokenizer_config() -> dict[str, object]:
    """tokenizer_config.json in the Qwen2 layout; the specials are declared at their real ids."""
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "single_word": False,
            "special": True,
        }
        for i, t in QWEN_SPECIALS.items()
    }
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "model_max_length": 32768,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
    }


def write_tiny_tokenizer(
    out_dir: str | Path, family: str = "cosyvoice3", vocab_size: int | None = None
) -> Path:
    """Write the tiny tokenizer folder into ``out_dir`` (created) and return it.

    ``vocab_size`` bounds the ordinary ids (default 300 for v2, 512 for v3); it must exceed the 256 byte
    symbols. ``family`` only picks that default: the folder is the shared Qwen base, and ``load_tokenizer``
    adds the family's specials.
    """
    size = DEFAULT_VOCAB_SIZE[check_family(family)] if vocab_size is None else vocab_size
    if not NUM_BYTE_SYMBOLS < size <= min(QWEN_SPECIALS):
        raise ValueError(f"vocab_size must be in ({NUM_BYTE_SYMBOLS}, {min(QWEN_SPECIALS)}], got {size}")
    vocab, merges = train_byte_bpe(size)
    vocab.update({token: i for i, token in QWEN_SPECIALS.items()})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ordered = dict(sorted(vocab.items(), key=lambda kv: kv[1]))
    (out / "vocab.json").write_text(json.dumps(ordered, ensure_ascii=False), encoding="utf-8")
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2), encoding="utf-8")
    return out
