"""The keep hooks (``webui/keep.py``): which fields the browser keeps, and the js each listener runs."""

from __future__ import annotations

import json

import pytest

from webui import keep
from webui.handlers import FORM_FIELDS


def test_the_kept_form_names_generates_inputs() -> None:
    """Every kept field is one of Generate's inputs (by its form name, or the layout's for instruct /
    live / wps), and none is the visitor's file or the request's own id."""
    layout_names = {"instruct": "instruct_text", "live": "live", "wps": "wps"}
    assert {layout_names.get(n, n) for n in keep.FORM_KEPT} <= set(FORM_FIELDS)
    assert not {"rid", "history", "browser_id", "prompt_wav", "source_wav"} & set(keep.FORM_KEPT)


def test_each_hook_names_what_it_keeps() -> None:
    names = json.dumps(keep.FORM_KEPT)
    assert f"saveForm({names}, v)" in keep.save_form_js() and "return []" in keep.save_form_js()
    assert f"restoreForm({names}, v)" in keep.restore_form_js()
    assert 'keepAudio("prompt", v)' in keep.keep_audio_js("prompt") and "cosyPrompt" in keep.keep_audio_js(
        "prompt"
    )
    assert "cosyPrompt" not in keep.keep_audio_js("source")  # the typed flag follows the prompt only
    assert json.dumps(keep.AUDIO_KEPT) in keep.restore_audio_js()
    with pytest.raises(ValueError, match="kept audio"):
        keep.keep_audio_js("text")
