"""The WebAudio live player: its script (``static/player.js``), its card, and the listeners' js hooks.

The player reads ``webui/pcm/{rid}`` (``stream_route.py``). The hooks run in the browser before the Python
listener: Generate's draws the request id, starts the player inside the click (so audio may play), and
hands the id to the handler in place of the hidden ``rid`` input; Stop's silences the player at once and
sends the current id to ``Studio.stop``.
"""

from __future__ import annotations

import html
from pathlib import Path

from webui.texts import Texts

STATIC = Path(__file__).parent / "static"
LIVE_STATES = ("idle", "waiting", "streaming", "playing", "done", "stopped", "error")


def head_html() -> str:
    """``<script>`` with the browser's id (``browser_id.js``, first: the load's hooks read it), the player,
    the toast titles, the visit kept in the browser (``keep.js``), the page's line to its server
    (``link.js``), the keyboard / screen-reader mending (``keys.js``) and the voice library's cards
    (``library.js``), for ``gr.mount_gradio_app(head=...)``."""
    names = ("browser_id.js", "player.js", "toast.js", "keep.js", "link.js", "keys.js", "library.js")
    scripts = ((STATIC / name).read_text(encoding="utf-8") for name in names)
    return "".join(f"<script>\n{js}\n</script>" for js in scripts)


def css() -> str:
    return (STATIC / "studio.css").read_text(encoding="utf-8")


def card_html(t: Texts) -> str:
    """Static markup the script fills in (``data-live`` fields); state labels ride on data attributes."""
    labels = " ".join(f'data-label-{s}="{html.escape(t(f"live_{s}"))}"' for s in LIVE_STATES)
    # the words keep.js and link.js write (the banner, a kept take, a prompt to upload again)
    texts = {"conn-down": "conn_down", "kept": "kept_take", "download": "kept_download"}
    texts |= {"reupload": "prompt_reupload", "lost": "status_lost"}
    texts |= {"waiting": "status_waiting", "no-answer": "status_no_answer"}
    labels += "".join(f' data-text-{k}="{html.escape(t(key))}"' for k, key in texts.items())
    fields = "".join(
        f'<div><span class="cosy-k">{html.escape(t(f"live_{key}"))}</span>'
        f'<span class="cosy-live-v" data-live="{key}">—</span></div>'
        for key in ("first", "received", "underruns")
    )
    return (
        f'<div id="cosy-live" class="cosy-live" data-state="idle" {labels}>'
        f'<div class="cosy-live-head"><span class="cosy-dot"></span><b>{html.escape(t("live"))}</b>'
        f'<span class="cosy-live-state" data-live="state">{html.escape(t("live_idle"))}</span></div>'
        f'<canvas class="cosy-wave"></canvas><div class="cosy-live-fields">{fields}</div></div>'
    )


def generate_js(n_inputs: int, stream_index: int, rid_index: int) -> str:
    """Generate's hook. Gradio passes inputs then outputs and sends back what we return as the inputs."""
    n = n_inputs
    return (
        f"(...args) => {{ const p = window.cosyPlayer; if (!p) return args.slice(0, {n});"
        f" const rid = p.newRid(); args[{rid_index}] = rid;"
        f" if (args[{stream_index}]) p.start(rid); else p.idle(rid); return args.slice(0, {n}); }}"
    )


STOP_JS = (
    "(rid) => { const p = window.cosyPlayer; if (!p) return [rid]; const r = p.rid; p.stop(); return [r]; }"
)


# Transcription and clearing the prompt read whether the transcript holds the visitor's own words from the
# page (player.js keeps the flag on every edit, in the browser at once: a flag kept on the server would
# arrive after an upload made right after typing), in place of their hidden input.
TRANSCRIBE_JS = "(path, language, text, typed) => [path, language, text, !!window.cosyTyped]"
CLEARED_JS = "(typed) => [!!window.cosyTyped]"

# After Generate's event ends: with streaming off the player plays the finished file.
# Every take's wav is kept in the browser too (keep.js), for the history after a restart.
FINISHED_JS = (
    "() => { const p = window.cosyPlayer; if (p) p.finished();"
    " if (window.cosyKeep) window.cosyKeep.keepTake(); return []; }"
)

# The text box's input event in live-text mode: the handler gets the box and the live player's request id.
TYPED_JS = "(text, rid) => { const p = window.cosyPlayer; return [text, p && p.rid ? p.rid : rid]; }"
