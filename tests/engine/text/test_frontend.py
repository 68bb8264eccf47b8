"""Text frontend: offline wetext normalisation, protected tags, language branches, the tokenizer's special
ids, the v2/v3 prompt formats and the instruct presets."""

from __future__ import annotations

import json
import re
import socket
import unicodedata
from importlib.resources import files
from pathlib import Path

import pytest

from engine.demo.tiny_tokenizer import write_tiny_tokenizer
from engine.errors import InvalidInput, ModelError
from engine.text import frontend as text
from engine.text.frontend import (
    END_OF_PROMPT,
    END_OF_PROMPT_ID,
    FAMILIES,
    SYSTEM_PROMPT,
    TextFrontend,
    format_cross_lingual,
    format_instruct,
    format_prompt_text,
    instruct_presets,
    load_tokenizer,
    normalize_text,
    prepare_text,
    resolve_language,
    special_tokens,
)
from tests.conftest import fixture_root

ASCII_DIGIT = re.compile(r"[0-9]")


def special_fixture() -> dict:
    root = fixture_root()
    if root is None or not (root / "tokenizer_special_tokens.json").is_file():
        pytest.skip("fixture root with tokenizer_special_tokens.json is absent")
    return json.loads((root / "tokenizer_special_tokens.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module", params=FAMILIES)
def tokenizer(request, tmp_path_factory):
    folder = write_tiny_tokenizer(tmp_path_factory.mktemp(request.param), request.param)
    return load_tokenizer(folder, request.param)


@pytest.fixture(scope="module")
def frontend_v3(tmp_path_factory):
    folder = write_tiny_tokenizer(tmp_path_factory.mktemp("v3"), "cosyvoice3")
    return TextFrontend(load_tokenizer(folder, "cosyvoice3"))


# ------------------------------------------------------------------------------------- normalisation


def test_wetext_fsts_ship_in_the_wheel_and_load_without_network(monkeypatch):
    for lang in ("zh", "en"):
        assert files("wetext.fsts").joinpath(f"{lang}/tn/tagger.fst").is_file()

    def no_network(*args, **kwargs):
        raise OSError("wetext tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    text._wetext.cache_clear()
    assert "三" in normalize_text("3个", "zh")
    assert "two" in normalize_text("2 cats", "en")


@pytest.mark.parametrize(
    ("raw", "readings"),
    [
        ("2024年3月5日", ["二零二四年三月五日"]),
        ("今天是2024-03-05", ["二零二四年三月五日"]),
        ("一共花了12.50元", ["十二点五零元"]),
        ("气温从-5℃升到25°C", ["负五摄氏度", "二十五摄氏度"]),
        ("我们下午3:30开会", ["三点三十分"]),
        ("重5kg，长10km", ["五千克", "十公里"]),
        ("完成了50%", ["百分之五十"]),
    ],
)
def test_zh_numbers_dates_money_temperature_time_units_are_read_in_chinese(raw, readings):
    out = normalize_text(raw, "auto")
    assert not ASCII_DIGIT.search(out), out
    for reading in readings:
        assert reading in out, out


@pytest.mark.parametrize(
    ("raw", "readings"),
    [
        ("It costs $5.20 at 3:30pm", ["five", "dollars", "three thirty"]),
        ("On March 5, 2024 it was 25°C.", ["fifth", "twenty twenty four", "twenty five degrees"]),
        ("I have 123 apples and 1,234,567 dollars.", ["one hundred", "twenty three", "million"]),
        ("It weighs 5 kg and runs 100 km/h.", ["five kilograms", "kilometers per hour"]),
        ("Call #1 now", ["one"]),  # wetext fails on "#1": the word-by-word fallback and spell-out read it
    ],
)
def test_en_numbers_are_spelled_out(raw, readings):
    out = normalize_text(raw, "en")
    assert not ASCII_DIGIT.search(out), out
    for reading in readings:
        assert reading in out, out


@pytest.mark.parametrize("lang", ["zh", "en"])
def test_inline_tags_are_protected(lang):
    tags = ["[breath]", "<strong>", "</strong>", "[laughter]", "[AA1]", "[j]", "[ǐ]", "[vocalized-noise]"]
    body = "我有3个苹果" if lang == "zh" else "I have 3 apples"
    raw = f"{tags[0]}{body}{tags[1]}5{tags[2]} {tags[3]} {tags[4]}{tags[5]}{tags[6]} 7 {tags[7]}"
    out = normalize_text(raw, lang, "cosyvoice3")
    for tag in tags:
        assert out.count(tag) == raw.count(tag), (tag, out)
    assert not ASCII_DIGIT.search(out.replace("[AA1]", "")), out


def test_v2_does_not_protect_v3_only_tags():
    # [AA1] is not a v2 special token: for v2 it is ordinary text and its digit is read
    assert "[AA1]" not in normalize_text("[AA1] 5", "en", "cosyvoice2")
    assert "[AA1]" in normalize_text("[AA1] 5", "en", "cosyvoice3")


def test_wetext_escapes_do_not_leak():
    out = normalize_text('He said "hi 5" and left \\ there', "en")
    assert '"hi five"' in out and "\\\\" not in out and '\\"' not in out
    assert normalize_text('他说"我有3个"', "zh").count('"') == 2


def test_markup_skips_normalisation_and_splitting(frontend_v3):
    raw = f"{SYSTEM_PROMPT}{END_OF_PROMPT}我有3个苹果。今天是2024年3月5日。" * 10
    assert normalize_text(raw) == raw
    assert frontend_v3.prepare(raw) == [raw]


def test_zh_reference_rules():
    assert normalize_text("你 好 world hello 再见") == "你好world hello再见"
    assert normalize_text("你好.再见") == "你好。再见"
    assert normalize_text("A - B的关系") == "A，B的关系"
    assert normalize_text("（注）【标题】`代码`好——的") == "注标题代码好 的"
    assert normalize_text("面积是x²和y³") == "面积是x平方和y立方"
    assert normalize_text("第一行\n第二行，、") == "第一行第二行。"


def test_language_hint_chooses_the_branch():
    assert resolve_language("hello", "auto") == "en"
    assert resolve_language("hello 你好", "auto") == "zh"
    assert "二" in normalize_text("2024", "zh")
    assert "twenty" in normalize_text("2024", "en")
    with pytest.raises(InvalidInput):
        resolve_language("hello", "xx")


@pytest.mark.parametrize(
    ("lang", "raw"), [("ja", "3時に会いましょう。"), ("ko", "사과 3개 주세요."), ("yue", "我有3個蘋果。")]
)
def test_ja_ko_yue_are_not_normalised_but_split(lang, raw, frontend_v3):
    assert normalize_text(raw, lang) == raw
    long = raw * 20
    segments = frontend_v3.prepare(long, lang)
    assert len(segments) > 1 and "".join(segments) == long
    assert all(len(s) <= 80 + len(raw) for s in segments)


# --------------------------------------------------------------------------------------- splitting


def test_long_zh_paragraph_is_split_by_characters(frontend_v3):
    sentence = "今天天气很好，我们一起去公园散步吧。"  # 18 characters
    segments = frontend_v3.prepare(sentence * 12)
    assert len(segments) > 1
    assert "".join(segments) == sentence * 12
    assert all(len(s) <= 80 for s in segments)
    assert all(len(s) > 60 for s in segments[:-1])


def test_long_en_paragraph_is_split_by_tokens(frontend_v3):
    sentence = "The weather is lovely today, so we go for a walk. "
    segments = frontend_v3.prepare(sentence * 20)
    assert len(segments) > 1
    assert " ".join(segments) == (sentence * 20).strip()
    lengths = [frontend_v3.token_len(s) for s in segments]
    per_sentence = frontend_v3.token_len(sentence.strip())
    assert all(n <= 80 + per_sentence for n in lengths), lengths
    assert all(n > 60 for n in lengths[:-1]), lengths


def test_punctuation_only_and_blank_text_give_no_segments(frontend_v3):
    assert frontend_v3.prepare("。！？") == []
    assert frontend_v3.prepare("   ") == []
    assert frontend_v3.prepare("...", "en") == []


@pytest.mark.parametrize("text_frontend", [True, False])
@pytest.mark.parametrize(
    "raw",
    ["\u200b\u200c\u200d", "\ufeff\u2060 \u200e\u202e", "\u0301\u0302\u0303", " \u0301 \u200b\u0308 "],
    ids=["zero-width", "bom-bidi", "marks", "marks-and-zero-width"],
)
def test_invisible_only_text_gives_no_segments(frontend_v3, raw, text_frontend):
    assert not text.has_speech(raw)
    assert frontend_v3.prepare(raw, text_frontend=text_frontend) == []


def test_text_with_one_letter_has_speech():
    assert text.has_speech("\u200ba\u0301") and text.has_speech("7") and text.has_speech("。")


def test_long_runs_of_combining_marks_are_cut():
    assert text.trim_marks("a" + "\u0301" * 500 + "b") == "a" + "\u0301" * text.MAX_STACKED_MARKS + "b"
    viet = "Tiếng Việt có dấu: ệ ộ ữ"  # two stacked marks once decomposed: kept whole
    assert text.trim_marks(viet) == viet
    assert text.trim_marks(unicodedata.normalize("NFD", viet)) == unicodedata.normalize("NFD", viet)


@pytest.mark.parametrize("text_frontend", [True, False])
def test_a_letter_under_500_marks_costs_what_a_letter_under_3_costs(frontend_v3, text_frontend):
    """The LM's output is bounded by its input ids: Zalgo text must not turn into thousands of ids."""

    def ids(raw: str) -> list[list[int]]:
        return [frontend_v3.tokenize(s) for s in frontend_v3.prepare(raw, "en", text_frontend)]

    assert ids("Hi a" + "\u0301" * 500 + ".") == ids("Hi a" + "\u0301" * 3 + ".")


def test_prepare_with_the_frontend_off_keeps_one_segment(frontend_v3):
    raw = "我有3个苹果。" * 30
    assert frontend_v3.prepare(raw, text_frontend=False) == [raw]


def test_prepare_text_function_matches_the_frontend(frontend_v3):
    raw = "我有3个苹果。" * 30
    assert prepare_text(raw, "auto", frontend_v3.token_len) == frontend_v3.prepare(raw)


# --------------------------------------------------------------------------------------- tokenizer


def test_special_token_lists_match_the_reference_order():
    fixture = special_fixture()
    for family in FAMILIES:
        assert special_tokens(family) == fixture[family]["additional_special_tokens_in_order"]
        assert len(special_tokens(family)) == fixture[family]["num_additional_special_tokens"]


def test_special_ids_follow_the_official_order(tokenizer):
    fixture = special_fixture()[tokenizer.family]["derived_ids_ASSUMPTION"]
    for token, token_id in {**fixture["pre_existing"], **fixture["added"]}.items():
        assert tokenizer.token_id(token) == token_id, token
    assert tokenizer.token_id(END_OF_PROMPT) == END_OF_PROMPT_ID
    assert tokenizer.token_id(tokenizer.special_tokens[-1]) == fixture["last_id"]
    assert tokenizer.id_limit == fixture["last_id"] + 1 <= fixture["qwen2_embedding_rows"]


def test_v3_special_ids_end_at_151923(tokenizer):
    ids = [tokenizer.token_id(t) for t in tokenizer.special_tokens]
    assert ids[:2] == [151644, 151645]
    assert ids[2:] == list(range(END_OF_PROMPT_ID, END_OF_PROMPT_ID + len(ids) - 2))
    if tokenizer.family == "cosyvoice3":
        assert ids[-1] == 151923 and len(ids) == 280


def test_encode_adds_no_bos_eos_and_keeps_tags_whole(tokenizer):
    assert tokenizer.encode("") == []
    ids = tokenizer.encode(f"Hi[breath]{END_OF_PROMPT}你好")
    assert tokenizer.token_id("[breath]") in ids and END_OF_PROMPT_ID in ids
    assert tokenizer.token_id("<|endoftext|>") not in ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == f"Hi[breath]{END_OF_PROMPT}你好"
    assert tokenizer.decode(ids) == "Hi你好"


def test_tokenizer_with_a_wrong_base_size_is_refused(tmp_path):
    folder = write_tiny_tokenizer(tmp_path, "cosyvoice2")
    vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
    vocab = {k: v for k, v in vocab.items() if v < 151643}  # base without the 3 Qwen specials at 151643..
    (folder / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    # refused at the first added token off its declared id, before the CosyVoice specials shift with it
    with pytest.raises(ModelError, match=r"'<\|endoftext\|>' got id 300, its config says 151643"):
        load_tokenizer(folder, "cosyvoice2")


def test_missing_tokenizer_folder_is_a_model_error(tmp_path):
    with pytest.raises(ModelError, match=r"vocab\.json"):
        load_tokenizer(tmp_path / "nope", "cosyvoice3")
    with pytest.raises(ValueError, match="family"):
        load_tokenizer(tmp_path, "cosyvoice9")


# ----------------------------------------------------------------------------------------- formats


def test_v3_formats():
    prefix = f"{SYSTEM_PROMPT}{END_OF_PROMPT}"
    assert (
        format_prompt_text("cosyvoice3", "希望你以后能够做的比我还好呦。")
        == prefix + "希望你以后能够做的比我还好呦。"
    )
    assert format_cross_lingual("cosyvoice3", "[breath]因为他们") == prefix + "[breath]因为他们"
    assert (
        format_instruct("cosyvoice3", "请用广东话表达。")
        == f"{SYSTEM_PROMPT} 请用广东话表达。{END_OF_PROMPT}"
    )


def test_v2_formats():
    assert format_prompt_text("cosyvoice2", " 你好。 ") == "你好。"
    assert format_cross_lingual("cosyvoice2", "Hello.") == "Hello."
    assert format_instruct("cosyvoice2", "用四川话说这句话") == f"用四川话说这句话{END_OF_PROMPT}"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fmt", [format_prompt_text, format_cross_lingual, format_instruct])
def test_formats_are_not_doubled(family, fmt):
    once = fmt(family, "请用广东话表达。")
    assert fmt(family, once) == once
    marked = family == "cosyvoice3" or fmt is format_instruct  # v2 zero-shot / cross-lingual: plain text
    assert once.count(END_OF_PROMPT) == int(marked) and once.count(SYSTEM_PROMPT) <= 1


def test_typed_system_prompt_without_marker_is_completed():
    assert format_prompt_text("cosyvoice3", f"{SYSTEM_PROMPT} 你好") == f"{SYSTEM_PROMPT}{END_OF_PROMPT}你好"
    assert (
        format_instruct("cosyvoice3", f"{SYSTEM_PROMPT} 请大声说")
        == f"{SYSTEM_PROMPT} 请大声说{END_OF_PROMPT}"
    )


def test_frontend_applies_formats(frontend_v3):
    assert frontend_v3.prompt_text("我有3个苹果").startswith(SYSTEM_PROMPT + END_OF_PROMPT + "我有三个")
    assert END_OF_PROMPT_ID in frontend_v3.tokenize(frontend_v3.prompt_text("你好"))
    assert frontend_v3.instruct_text("请用3种语气说") == format_instruct("cosyvoice3", "请用3种语气说")
    segments = frontend_v3.prepare("Hello there. " * 30, cross_lingual=True)
    assert len(segments) > 1 and all(s.startswith(SYSTEM_PROMPT + END_OF_PROMPT) for s in segments)


def test_presets_are_the_reference_instruct_list():
    reference = special_fixture()["prompt_formats"]["v3_instruct_list_(cosyvoice/utils/common.py)"]
    presets = instruct_presets("cosyvoice3")
    assert [p.text for p in presets] == reference
    assert len({p.key for p in presets}) == len(presets) == 26
    assert {"cantonese", "sichuan", "loud", "soft", "slow", "fast", "happy", "sad", "angry", "robot"} <= {
        p.key for p in presets
    }
    v2 = instruct_presets("cosyvoice2")
    assert all(p.text == p.instruct + END_OF_PROMPT for p in v2)


def test_data_files_sit_next_to_the_module():
    here = Path(text.__file__).parent
    assert (here / "special_tokens.json").is_file() and (here / "instruct_presets.json").is_file()


def test_prompt_transcripts_are_normalised_once_then_reused(frontend_v3, monkeypatch):
    frontend = frontend_v3
    calls: list[str] = []
    real = text.normalize_text

    def counting(transcript: str, lang: str = "auto", family: str = "cosyvoice3") -> str:
        calls.append(transcript)
        return real(transcript, lang, family)

    monkeypatch.setattr(text, "normalize_text", counting)
    text._normalized_transcript.cache_clear()
    transcript = "It costs 25 dollars, said the voice on 3 May."
    first = frontend.prompt_text(transcript)
    assert frontend.prompt_text(transcript) == first and "twenty five" in first
    assert calls == [transcript]  # the second request reused the first one's normalisation
    frontend.prompt_text("Another voice, 7 words.")
    assert len(calls) == 2
    assert frontend.prompt_text(transcript, text_frontend=False).endswith(transcript)  # raw: no normalising
