"""Both UI languages carry the same keys with the same format fields."""

from __future__ import annotations

import string

import pytest

from webui.texts import EN, LANGUAGES, ZH, Texts


def fields(template: str) -> set[str]:
    return {name for _, name, _, _ in string.Formatter().parse(template) if name}


def test_zh_and_en_have_the_same_keys_and_fields() -> None:
    assert set(EN) == set(ZH)
    for key in EN:
        assert fields(EN[key]) == fields(ZH[key]), key
        assert ZH[key].strip(), key


def test_every_language_has_a_label() -> None:
    for lang in LANGUAGES:
        assert Texts("zh")(f"lang_{lang}") and Texts("en")(f"lang_{lang}")


def test_lookup_formats_and_fails_loudly() -> None:
    assert Texts("en")("err_text_long", chars=5, limit=3) == (
        "The text has 5 characters; the limit is 3. Shorten it or split it."
    )
    assert Texts("zh")("generate") == "生成"
    with pytest.raises(KeyError):
        Texts("en")("no_such_label")
    with pytest.raises(ValueError, match="ui language"):
        Texts("fr")
