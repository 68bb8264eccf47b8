"""What the browser keeps of a visit (``static/keep.js``): the listeners' js hooks that save and restore it.

The form's fields are saved on every change and put back on load; the saved voice and the lexicon picked
are sent back on load, and the server picks them again while this browser still lists them; the prompt
and the source speech are kept as files (IndexedDB) and uploaded again to the page's own server on load;
the history rides on its table (``views.history_html``) and comes back through
``Studio.restore_history``. Each hook runs in the browser (Gradio's ``js=``) and does nothing where the
script is missing.
"""

from __future__ import annotations

import json

# the form's fields kept, by the names keep.js stores them under (layout.py lists the components in order)
FORM_KEPT = ("mode", "prompt_text", "instruct", "language", "text", "stream", "speed", "seed", "live", "wps")
AUDIO_KEPT = ("prompt", "source")


def save_form_js(names: tuple[str, ...] = FORM_KEPT) -> str:
    """A change of any kept field: the whole form is saved (js only: no request to the server)."""
    call = f"window.cosyKeep.saveForm({json.dumps(names)}, v)"
    return f"(...v) => {{ if (window.cosyKeep) {call}; return []; }}"


def restore_form_js(names: tuple[str, ...] = FORM_KEPT) -> str:
    """On load: the kept values in place of the page's defaults (a field never kept keeps its default)."""
    return f"(...v) => window.cosyKeep ? window.cosyKeep.restoreForm({json.dumps(names)}, v) : v"


def keep_audio_js(kind: str) -> str:
    """The prompt or source audio changed: kept (or forgotten, when cleared); the transcript's typed flag
    learns whether a prompt is there (``player.js``)."""
    if kind not in AUDIO_KEPT:
        raise ValueError(f"kept audio is one of {AUDIO_KEPT}, got {kind!r}")
    seen = "window.cosyPrompt = !!v; " if kind == "prompt" else ""
    call = f"window.cosyKeep.keepAudio({json.dumps(kind)}, v)"
    return f"(v) => {{ {seen}if (window.cosyKeep) {call}; return []; }}"


def restore_audio_js(kinds: tuple[str, ...] = AUDIO_KEPT) -> str:
    """On load: each kept file uploaded again to this server, as the component's value."""
    return f"(...v) => window.cosyKeep ? window.cosyKeep.restoreAudio({json.dumps(kinds)}, v) : v"


# On load: the kept history (JSON) in place of the hidden input, for ``Studio.restore_history``.
RESTORE_HISTORY_JS = "(kept) => [window.cosyKeep ? window.cosyKeep.history() : '[]']"


def owner_and_voice_js(owner_js: str) -> str:
    """On load: the browser's id (``owner_js`` draws or reads it) and the saved voice it picked last, for
    ``Studio.browser_voices``, which picks it again only while the list still has it."""
    return _owner_and(owner_js, "keptVoice")


def owner_and_lexicon_js(owner_js: str) -> str:
    """On load: the browser's id and the pronunciation lexicon it picked last, for
    ``Studio.browser_lexicons``, which picks it again only while the list still has it."""
    return _owner_and(owner_js, "keptLexicon")


def _owner_and(owner_js: str, kept: str) -> str:
    call = f"window.cosyKeep ? window.cosyKeep.{kept}() : ''"
    return f"(current, kept) => [({owner_js})(current), {call}]"


# The saved-voice or lexicon pick changed (by hand, by a library card, from the lab, or restored): kept,
# once the load's own pick is in (``*_RESTORED_JS``), so the list's first value never overwrites the kept one.
KEEP_VOICE_JS = "(v) => { if (window.cosyKeep) window.cosyKeep.keepVoice(v); return []; }"
VOICE_RESTORED_JS = "() => { if (window.cosyKeep) window.cosyKeep.voiceRestored(); return []; }"
KEEP_LEXICON_JS = "(v) => { if (window.cosyKeep) window.cosyKeep.keepLexicon(v); return []; }"
LEXICON_RESTORED_JS = "() => { if (window.cosyKeep) window.cosyKeep.lexiconRestored(); return []; }"


def save_script_js(speakers: int) -> str:
    """A change on the script desk (its text, pause, speakers' names and voices): all of it saved."""
    return f"(...v) => {{ if (window.cosyKeep) window.cosyKeep.saveScript({speakers}, v); return []; }}"


def restore_script_js(speakers: int) -> str:
    """On load: the kept script text, pause and speakers' names in place of the desk's defaults (the
    voices are picked by the server, ``ScriptDesk.voices``, from ``SCRIPT_VOICES_JS``)."""
    return f"(...v) => window.cosyKeep ? window.cosyKeep.restoreScript({speakers}, v) : v"


# The speakers' kept voices (JSON list of ids) as the last input, for ``ScriptDesk.voices``.
SCRIPT_VOICES_JS = (
    "(...v) => [...v.slice(0, -1), window.cosyKeep ? JSON.stringify(window.cosyKeep.scriptVoices()) : '[]']"
)
