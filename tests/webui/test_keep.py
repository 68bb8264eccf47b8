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


def test_the_saved_voice_lexicon_and_script_desk_hooks() -> None:
    """The saved-voice and lexicon picks go to the server with the browser id (the owner js called on its
    own input), and the script desk's hooks name how many speakers their values hold."""
    both = keep.owner_and_voice_js("(current) => 'id'")
    assert both.startswith("(current, kept) =>") and "((current) => 'id')(current)" in both
    assert "keptVoice()" in both and "keepVoice(v)" in keep.KEEP_VOICE_JS
    assert "voiceRestored()" in keep.VOICE_RESTORED_JS
    lexicon = keep.owner_and_lexicon_js("(current) => 'id'")
    assert lexicon.startswith("(current, kept) =>") and "((current) => 'id')(current)" in lexicon
    assert "keptLexicon()" in lexicon and "keepLexicon(v)" in keep.KEEP_LEXICON_JS
    assert "lexiconRestored()" in keep.LEXICON_RESTORED_JS
    assert "saveScript(4, v)" in keep.save_script_js(4) and "return []" in keep.save_script_js(4)
    assert "restoreScript(3, v)" in keep.restore_script_js(3)
    assert "scriptVoices()" in keep.SCRIPT_VOICES_JS and "v.slice(0, -1)" in keep.SCRIPT_VOICES_JS
