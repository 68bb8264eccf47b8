"""Text frontend of CosyVoice2/3: offline normalisation, sentence splitting, the Qwen tokenizer with the
CosyVoice special tokens, and the prompt formats the models were trained with (applied for the user).

Reference: cosyvoice/cli/frontend.py ``text_normalize``, cosyvoice/utils/frontend_utils.py,
cosyvoice/tokenizer/tokenizer.py (spec 3.5, 3.6, 4; pitfalls 9-10).

Languages (the request's hint): "auto" picks "zh" when the text has a CJK ideograph (U+4E00-U+9FFF), else
"en", as the reference does. "zh" and "en" are normalised with wetext 0.1.8, whose zh/en FST files ship in
its wheel (``wetext/fsts``, read through importlib.resources: no download, unlike 0.0.4 which fetched them
from ModelScope). "ja", "ko" and "yue" are not normalised (wetext has no grammar for them and the zh one
would read numbers in Mandarin); they are only split, at the CJK marks, by character count.

Text containing both "<|" and "|>" skips normalisation and splitting, as in the reference. CosyVoice's
inline tags ([breath], <strong>...</strong>, pinyin [j][ǐ], phones [AA1]) are protected: normalisation runs
on the text between them only.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, cached_property
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

from engine.errors import InvalidInput, ModelError
from engine.text.number_words import spell_out_numbers
from engine.text.qwen_tokenizer import load_qwen_tokenizer
from engine.text.split import split_sentences

log = logging.getLogger(__name__)

FAMILIES = ("cosyvoice2", "cosyvoice3")
LANGUAGES = ("auto", "zh", "en", "ja", "ko", "yue")
SYSTEM_PROMPT = "You are a helpful assistant."
END_OF_PROMPT = "<|endofprompt|>"
# Hard-coded by the reference CosyVoice3LM (cosyvoice/llm/llm.py); the released embedding rows follow it.
END_OF_PROMPT_ID = 151646
_DATA_DIR = Path(__file__).resolve().parent
_CJK = re.compile(r"[\u4e00-\u9fff]")
_WHITESPACE = re.compile(r"\s+")
# Cut points for wetext: after a strong sentence end, or after "." / ":" and a space when no digit follows
# ("Dr. Smith" may be cut, "Jan. 5, 2024" and "No. 5" may not: wetext reads them as one expression).
_SENTENCE_ENDS = re.compile(r"(?<=[。！？；!?;\n])|(?<=[.:])(?=\s+[^\s\d])")
_ZH_TRAILING_COMMAS = re.compile(r"[，,、]+$")
_ZH_DROPPED = str.maketrans("", "", "（）【】`")
# The wetext FST token parser asserts on some inputs ("#1", Hangul, double spaces): fall back word by word.
_WETEXT_ERRORS = (AssertionError, RuntimeError, ValueError, IndexError, KeyError)


def check_family(family: str) -> str:
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; expected one of {FAMILIES}")
    return family


@cache
def _read_data(name: str) -> dict[str, Any]:
    path = _DATA_DIR / name
    try:
        return dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, json.JSONDecodeError) as e:
        raise ModelError(f"cannot read the packaged data file {path}: {e}") from e


def special_tokens(family: str) -> list[str]:
    """CosyVoice's additional special tokens in the official order (v2: 19, v3: 280); the order fixes ids."""
    return list(_read_data("special_tokens.json")["additional_special_tokens"][check_family(family)])


def resolve_language(text: str, lang: str = "auto") -> str:
    """The branch for ``text``: the hint itself, or for "auto" "zh" if any CJK ideograph else "en"."""
    if lang not in LANGUAGES:
        expected = ", ".join(LANGUAGES)
        raise InvalidInput(f"unknown language {lang!r}; expected one of {expected}", field="language")
    if lang != "auto":
        return lang
    return "zh" if _CJK.search(text) else "en"


def has_markup(text: str) -> bool:
    """The reference's switch: text with both "<|" and "|>" is neither normalised nor split."""
    return "<|" in text and "|>" in text


# ---------------------------------------------------------------------------------------- normalisation


@cache
def _wetext(lang: str) -> Any:
    """The wetext normaliser for "zh" (erhua kept, as the reference) or "en"; built on first use."""
    from wetext import Normalizer  # imports kaldifst; kept off the engine's import path

    if lang == "zh":
        return Normalizer(lang="zh", operator="tn", remove_erhua=False)
    return Normalizer(lang="en", operator="tn")


def load_normalizers() -> None:
    """Build both wetext normalisers now: each first use loads its FSTs (a few hundred ms), which a
    request would otherwise wait for (seen as 1-stream TTFA outliers from fresh text workers)."""
    _wetext("zh")
    _wetext("en")


def _wetext_normalize(text: str, lang: str) -> str:
    # wetext's time grows faster than linearly with the input (0.5 ms/char at 700 chars, 2 s for 4300
    # chars of English; 0.07 ms/char per sentence), and sentence ends never sit inside a number, date or
    # unit, so normalise sentence by sentence
    return "".join(_apply_inside(s, lambda c: _wetext_sentence(c, lang)) for s in _SENTENCE_ENDS.split(text))


def _wetext_sentence(text: str, lang: str) -> str:
    normalizer = _wetext(lang)
    try:
        return str(normalizer.normalize(text))
    except _WETEXT_ERRORS:
        log.debug("wetext %s failed on %r; normalising word by word", lang, text)
        return " ".join(_wetext_word(word, normalizer) for word in text.split(" "))


def _wetext_word(word: str, normalizer: Any) -> str:
    try:
        return str(normalizer.normalize(word)) if word else word
    except _WETEXT_ERRORS:
        return word


@cache
def _protected(family: str) -> re.Pattern[str]:
    """Spans normalisation must not touch: the special tokens (longest first, so "<laughter>" wins over a
    prefix) and the two characters wetext escapes in its output, '"' and backslash."""
    tokens = sorted(special_tokens(family), key=len, reverse=True)
    return re.compile("|".join([*map(re.escape, tokens), '"', r"\\"]))


def _map_unprotected(text: str, fn: Callable[[str], str], family: str) -> str:
    """Apply ``fn`` to each stretch of text between protected spans, keeping the whitespace around it."""
    out: list[str] = []
    pos = 0
    for match in _protected(family).finditer(text):
        out += [_apply_inside(text[pos : match.start()], fn), match.group()]
        pos = match.end()
    out.append(_apply_inside(text[pos:], fn))
    return "".join(out)


def _apply_inside(piece: str, fn: Callable[[str], str]) -> str:
    core = piece.strip()
    if not core:
        return piece
    lead = len(piece) - len(piece.lstrip())
    return piece[:lead] + fn(core) + piece[lead + len(core) :]


def _replace_blank(text: str) -> str:
    """Keep a space only between two non-space ASCII characters ("a b" stays, "你 好" -> "你好")."""

    def keep(i: int) -> bool:
        return 0 < i < len(text) - 1 and all(c.isascii() and c != " " for c in (text[i - 1], text[i + 1]))

    return "".join(c for i, c in enumerate(text) if c != " " or keep(i))


def _normalize_zh(text: str, family: str) -> str:
    text = _map_unprotected(text, lambda s: _wetext_normalize(s, "zh"), family)
    text = _replace_blank(text.replace("\r", "").replace("\n", ""))
    text = text.replace("²", "平方").replace("³", "立方").replace(".", "。").replace(" - ", "，")
    text = text.translate(_ZH_DROPPED).replace("——", " ")
    return _ZH_TRAILING_COMMAS.sub("。", text)


def _normalize_en(text: str, family: str) -> str:
    def piece(s: str) -> str:
        # wetext asserts on runs of spaces; digit runs it leaves are spelled out (reference spell_out_number)
        return spell_out_numbers(_wetext_normalize(_WHITESPACE.sub(" ", s), "en"))

    return _map_unprotected(text, piece, family)


def normalize_text(text: str, lang: str = "auto", family: str = "cosyvoice3") -> str:
    """Normalised ``text`` without splitting (the reference's split=False, used for prompt transcripts).

    zh: wetext zh, newlines removed, spaces kept only between ASCII, ²/³ read, "." -> "。",
    " - " -> "，", （）【】 and backticks removed, "——" -> space, trailing commas -> "。".
    en: wetext en, then remaining digit runs spelled out. ja/ko/yue: stripped only.
    ``family`` selects the tags to protect.
    """
    if has_markup(text):
        return text
    text = text.strip()
    lang = resolve_language(text, lang)
    if not text or lang not in ("zh", "en"):
        return text
    return _normalize_zh(text, family) if lang == "zh" else _normalize_en(text, family)


# Stacked combining marks kept per base character: Vietnamese stacks two, a few scripts three; longer runs
# are decoration ("Zalgo" text) that the tokenizer turns into many ids each, and the LM into minutes of noise.
MAX_STACKED_MARKS = 3


def trim_marks(text: str) -> str:
    """``text`` with each run of combining marks (Unicode M*) cut to ``MAX_STACKED_MARKS``."""
    kept, run = [], 0
    for c in text:
        run = run + 1 if unicodedata.category(c)[0] == "M" else 0
        if run <= MAX_STACKED_MARKS:
            kept.append(c)
    return "".join(kept)


def has_speech(text: str) -> bool:
    """False for text with nothing to say: only separators, control and format characters (zero-width
    spaces and joiners, the BOM, bidi marks) and combining marks with no letter to sit on."""
    return any(unicodedata.category(c)[0] not in "ZCM" for c in text)


def prepare_text(
    text: str, lang: str, token_len_fn: Callable[[str], int], family: str = "cosyvoice3"
) -> list[str]:
    """Normalised segments of ``text`` ready to tokenize (the reference's split=True); [] for blank text.

    English segments are measured in text tokens (``token_len_fn``), the others in characters.
    """
    if has_markup(text):
        return [text] if text.strip() else []
    lang = resolve_language(text.strip(), lang)
    return split_sentences(normalize_text(text, lang, family), lang, token_len_fn)


# ------------------------------------------------------------------------------------------- tokenizer


@dataclass(frozen=True)
class CosyTokenizer:
    """The released Qwen tokenizer (CosyVoice-BlankEN) with CosyVoice's special tokens added in order."""

    family: str
    qwen: Tokenizer

    def encode(self, text: str) -> list[int]:
        """Text ids, no BOS/EOS; special tokens written in ``text`` ([breath], <|endofprompt|>) are one id."""
        return list(self.qwen.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.qwen.decode(ids, skip_special_tokens=skip_special_tokens))

    def token_id(self, token: str) -> int:
        """Id of one vocabulary or special token; ModelError when the tokenizer does not know it."""
        vocab = self.vocab
        if token not in vocab:
            raise ModelError(f"token {token!r} is not in the {self.family} tokenizer")
        return vocab[token]

    @cached_property
    def vocab(self) -> dict[str, int]:
        return dict(self.qwen.get_vocab(with_added_tokens=True))

    @property
    def special_tokens(self) -> list[str]:
        return special_tokens(self.family)

    @property
    def id_limit(self) -> int:
        """Largest id + 1: the text embedding needs at least this many rows."""
        return max(self.vocab.values()) + 1


def load_tokenizer(blank_en_dir: str | Path, family: str) -> CosyTokenizer:
    """The folder's Qwen tokenizer (as ``AutoTokenizer.from_pretrained`` builds it, without transformers)
    plus the family's specials as the reference's ``add_special_tokens`` adds them, ids checked."""
    path = Path(blank_en_dir)
    check_family(family)
    qwen = load_qwen_tokenizer(path)  # ModelError naming vocab.json where the folder has no tokenizer
    data = _read_data("special_tokens.json")
    for role in ("eos_token", "pad_token"):  # the reference names tokens the Qwen vocabulary already holds
        if qwen.token_to_id(data[role]) is None:
            raise ModelError(f"{path}: the Qwen tokenizer has no {data[role]!r} (the {role})")
    qwen.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special_tokens(family)])
    tokenizer = CosyTokenizer(family, qwen)
    _check_special_ids(tokenizer, path)
    return tokenizer


def _check_special_ids(tokenizer: CosyTokenizer, path: Path) -> None:
    """The specials after <|im_start|>/<|im_end|> must take consecutive ids from 151646 in list order: the
    released embedding rows were trained at those ids (spec pitfall 9)."""
    new = tokenizer.special_tokens[2:]
    got = [tokenizer.token_id(t) for t in new]
    expected = list(range(END_OF_PROMPT_ID, END_OF_PROMPT_ID + len(new)))
    if got != expected:
        first_bad = next(i for i, (g, e) in enumerate(zip(got, expected)) if g != e)
        raise ModelError(
            f"{path}: special token {new[first_bad]!r} got id {got[first_bad]}, CosyVoice needs "
            f"{expected[first_bad]} (the base Qwen vocabulary must hold 151643 tokens + 3 specials)"
        )


# ------------------------------------------------------------------------------------- prompt formats


def _after_system_prompt(text: str) -> str:
    """``text`` without a system prompt the user typed at its start (so it is never doubled)."""
    return text[len(SYSTEM_PROMPT) :].lstrip() if text.startswith(SYSTEM_PROMPT) else text


def _with_system_prompt(family: str, text: str) -> str:
    check_family(family)
    text = text.strip()
    if family == "cosyvoice2" or END_OF_PROMPT in text:
        return text
    return f"{SYSTEM_PROMPT}{END_OF_PROMPT}{_after_system_prompt(text)}"


def format_prompt_text(family: str, transcript: str) -> str:
    """Zero-shot prompt text: v3 "You are a helpful assistant.<|endofprompt|>" + transcript; v2 transcript."""
    return _with_system_prompt(family, transcript)


def format_cross_lingual(family: str, text: str) -> str:
    """Cross-lingual tts text (no prompt text, so v3 needs the system prompt in the text); v2 unchanged."""
    return _with_system_prompt(family, text)


def format_instruct(family: str, instruct: str) -> str:
    """Instruct text: v3 "You are a helpful assistant. {instruct}<|endofprompt|>",
    v2 "{instruct}<|endofprompt|>". Text that already holds <|endofprompt|> is returned as typed.
    """
    check_family(family)
    instruct = instruct.strip()
    if END_OF_PROMPT in instruct:
        return instruct
    if family == "cosyvoice2":
        return f"{instruct}{END_OF_PROMPT}"
    body = _after_system_prompt(instruct)
    return f"{SYSTEM_PROMPT} {body}{END_OF_PROMPT}" if body else f"{SYSTEM_PROMPT}{END_OF_PROMPT}"


@dataclass(frozen=True)
class InstructPreset:
    """A reference instruction: ``instruct`` is what the user sees, ``text`` what the model gets."""

    key: str
    label: str
    instruct: str
    text: str


def instruct_presets(family: str) -> list[InstructPreset]:
    """The 26 instructions of the reference's ``instruct_list`` (17 dialects, loud, soft, slow, fast, happy,
    sad, angry, Peppa Pig, robot), formatted for ``family``. Fun-CosyVoice3 was trained on exactly these;
    CosyVoice2 takes free-form instructions, so for it they are examples."""
    presets = _read_data("instruct_presets.json")["presets"]
    return [
        InstructPreset(p["key"], p["label"], p["instruct"], format_instruct(family, p["instruct"]))
        for p in presets
    ]


@functools.lru_cache(maxsize=1024)
def _normalized_transcript(transcript: str, lang: str, family: str) -> str:
    """Prompt transcripts repeat (saved voices, a demo's example voices): normalise each once. wetext holds
    the GIL for ~1-2 ms a sentence, which concurrent requests would otherwise queue behind."""
    return normalize_text(transcript, lang, family)


# -------------------------------------------------------------------------------------------- frontend


class TextFrontend:
    """What the engine calls: user text -> segments -> ids, with the family's formats applied."""

    def __init__(self, tokenizer: CosyTokenizer):
        self.tokenizer = tokenizer

    @property
    def family(self) -> str:
        return self.tokenizer.family

    def token_len(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    def prepare(
        self, text: str, lang: str = "auto", text_frontend: bool = True, cross_lingual: bool = False
    ) -> list[str]:
        """Segments to synthesise one after another. ``text_frontend`` False: the text as one segment.
        ``cross_lingual``: each segment carries the v3 system prompt (the model asserts <|endofprompt|>).
        [] for text with nothing to speak (``has_speech``); long runs of combining marks are cut first."""
        text = trim_marks(text)
        if not has_speech(text):
            return []
        if text_frontend:
            segments = prepare_text(text, lang, self.token_len, self.family)
        else:
            segments = [text] if text.strip() else []
        return [format_cross_lingual(self.family, s) for s in segments] if cross_lingual else segments

    def prompt_text(self, transcript: str, lang: str = "auto", text_frontend: bool = True) -> str:
        """Zero-shot prompt transcript: normalised (not split), then formatted for the family."""
        text = _normalized_transcript(transcript, lang, self.family) if text_frontend else transcript
        return format_prompt_text(self.family, text)

    def instruct_text(self, instruct: str) -> str:
        """Instruct text, formatted; not normalised (the reference's instruct2 does not normalise it)."""
        return format_instruct(self.family, instruct)

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)
