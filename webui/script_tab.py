"""The studio's script desk: a dialogue or long text with a voice per speaker, pauses and the model's tags,
played live as one stream, with progress, a whole-file download, SRT / WebVTT subtitles and the word being
spoken highlighted during playback.

``build(studios, lbl, fields)`` places its accordion; ``ScriptDesk.perform`` is its Generate listener
(script -> ``engine.text.script`` parts -> ``engine.serving.performance.perform``), publishing PCM to the
studio's live player under the request id the browser drew, like the main Generate. Labels are the page's
``Labels``; notes, progress and errors speak the language of the studio ``Studios`` picks per request.
"""

from __future__ import annotations

import html
import inspect
import json
import logging
import shutil
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from pathlib import Path
from typing import Any

import gradio as gr
import numpy as np

from engine.errors import EngineError
from engine.lexicons import apply_to_parts
from engine.request import Mode, SynthesisRequest, new_request_id
from engine.serving.performance import PartDone, perform
from engine.serving.subtitles import Turn, to_srt, to_vtt
from engine.text.script import Part, Speech, compile_script, parse_script
from webui import keep, player, views
from webui.handlers import RID, Studio, Studios, call_engine, lexicon_note, owner_of, user_error
from webui.texts import Labels, Texts

log = logging.getLogger(__name__)

SPEAKERS = 4  # rows of the cast table
PROMPT = "__prompt__"  # the voice in the studio's prompt box (an upload or a recording)
EXAMPLE_SCRIPT = (
    'Alice: Welcome back to the show! <break time="400ms"/> Today we talk about streaming speech.\n'
    "Bob (speaking slowly and calmly): Thanks, Alice. [breath] It is <strong>really</strong> fast now.\n"
    "Alice: Let us hear it."
)
BREAK_TAG = '<break time="500ms"/>'
# each tag of ``engine.text.script.TAG_HELP`` (and the pause) -> the text key of what it does
TAG_KEYS = {
    BREAK_TAG: "script_tag_break", "[breath]": "script_tag_breath",
    "[quick_breath]": "script_tag_quick_breath", "[laughter]": "script_tag_laughter",
    "<laughter>...</laughter>": "script_tag_laughing", "<strong>...</strong>": "script_tag_strong",
    "[sigh]": "script_tag_sigh", "[cough]": "script_tag_cough", "[lipsmack]": "script_tag_lipsmack",
    "[mn]": "script_tag_mn", "[noise]": "script_tag_noise",
}  # fmt: skip
PLAYER_JS = """
const mark = () => {
  const audio = element.querySelector('audio');
  if (!audio) return;
  const t = audio.currentTime;
  element.querySelectorAll('.cosy-w').forEach((w) => {
    const on = t >= parseFloat(w.dataset.s) && t < parseFloat(w.dataset.e);
    w.classList.toggle('cosy-w-now', on);
  });
};
const loop = () => {
  mark();
  const a = element.querySelector('audio');
  if (a && !a.paused) requestAnimationFrame(loop);
};
element.addEventListener('play', loop, true);
element.addEventListener('timeupdate', mark, true);
element.addEventListener('seeked', mark, true);
"""
# in the page's css (``layout.page_options``): a <style> in an HTML value would be page text in the config
CSS = """
#cosy-script-result .cosy-w { border-radius: 4px; padding: 0 1px; transition: background .08s; }
#cosy-script-result .cosy-w-now { background: #7c3aed; color: #fff; }
#cosy-script-result .cosy-part { margin: 4px 0; line-height: 1.7; }
#cosy-script-result audio { width: 100%; margin-bottom: 6px; }
.cosy-bar { height: 8px; background: #e2e8f0; border-radius: 4px; overflow: hidden; margin: 4px 0; }
.cosy-bar > div { height: 100%; background: #7c3aed; }
"""


def tag_insert_js(tag: str) -> str:
    """Insert ``tag`` at the script box's cursor (browser only: no round trip), then put the cursor right
    after it in the focused box, so the visitor types on from there. Gradio writes the returned value into
    the box after this function returns (and the browser then moves the cursor to the text's end, or
    wherever), so the cursor is placed once the box holds the new text (a few frames at most)."""
    snippet = tag.replace("...", " ")
    return (
        "(s) => { const ta = document.querySelector('#cosy-script-text textarea'); const v = s || '';"
        " const i = ta && ta.selectionStart != null ? ta.selectionStart : v.length;"
        f" const tag = {snippet!r}; const next = v.slice(0, i) + tag + v.slice(i); const at = i + tag.length;"
        " let frames = 0; const place = () => { if (ta.value === next) { ta.focus();"
        " ta.setSelectionRange(at, at); } else if (frames++ < 60) { requestAnimationFrame(place); } };"
        " if (ta) { requestAnimationFrame(place); } return next; }"
    )


def start_js(rid_index: int) -> str:
    """Perform's hook: draw the request id and start the studio's live player on it, inside the click."""
    return (
        "(...args) => { const p = window.cosyPlayer; if (p) { const rid = p.newRid();"
        f" args[{rid_index}] = rid; p.start(rid); }} return args; }}"
    )


def progress_html(
    done: int, total: int, audio_s: float, elapsed_s: float, t: Texts, state: str = "running"
) -> str:
    """Sentences done / total, audio so far, and the time left at the pace so far; ``state`` "stopped":
    what Stop kept, with no time left."""
    share = done / total if total else 0.0
    if state == "stopped":
        line = t("script_stopped", done=done, total=total, audio=audio_s)
    else:
        left = elapsed_s / done * (total - done) if done else None
        eta = t("script_eta", left=left) if left is not None and done < total else ""
        line = t("script_progress", done=done, total=total, audio=audio_s) + eta
    return (
        f'<div class="cosy-progress" data-state="{state}" data-done="{done}" data-total="{total}">'
        f"{html.escape(line)}"
        f'<div class="cosy-bar"><div style="width:{100 * share:.1f}%"></div></div></div>'
    )


def tags_html(t: Texts) -> str:
    """What each tag does, in ``t``'s language; the tags themselves are typed as they are."""
    return views.note_html(" · ".join(f"{tag}: {t(key)}" for tag, key in TAG_KEYS.items()))


def result_html(audio_url: str, parts: Sequence[PartDone], t: Texts, noise: bool) -> str:
    """The finished audio and its text, each word a span with its times (the player script highlights)."""
    rows = []
    for part in parts:
        words = " ".join(
            f'<span class="cosy-w" data-s="{w.start_s:.3f}" data-e="{w.end_s:.3f}">'
            f"{html.escape(w.text)}</span>"
            for w in part.words
        )
        rows.append(f'<div class="cosy-part"><b>{html.escape(part.speaker)}:</b> {words}</div>')
    note = views.note_html(t("script_noise"), "bad") if noise else ""
    return f'<audio controls src="{audio_url}"></audio>{note}{"".join(rows)}'


class ScriptDesk:
    def __init__(self, studio: Studio):
        self.studio, self.t = studio, studio.t

    async def voices(self, browser_id: str, kept: str = "[]") -> list[Any]:
        """The cast dropdowns' choices: the prompt box's voice, then examples, public and own voices.

        ``kept``: the voices this browser picked last (``keep.js``, a JSON list of ids); each is picked
        again while the list still has it, else the speaker gets the default pick."""
        own = await self.studio.voice_choices(browser_id)
        choices = [(self.t("script_prompt_voice"), PROMPT), *own]
        listed = {value for _, value in choices}
        defaults = [own[i][1] if i < min(2, len(own)) else None for i in range(SPEAKERS)]
        picks = [kept_voice if kept_voice in listed else None for kept_voice in _kept_ids(kept)]
        picks = [*picks[:SPEAKERS], *[None] * (SPEAKERS - len(picks))]
        return [gr.Dropdown(choices=choices, value=p or d) for p, d in zip(picks, defaults, strict=True)]

    async def page(self, browser_id: str, kept: str = "[]") -> list[Any]:
        """On load: the cast's voices, the tags' help and the progress line in the session's language."""
        return [
            *await self.voices(browser_id, kept),
            tags_html(self.t),
            progress_html(0, 0, 0.0, 0.0, self.t),
        ]

    def cast(
        self, names: Sequence[str], voices: Sequence[str | None], browser_id: str, prompt: str | None,
        prompt_text: str,
    ) -> dict[str, SynthesisRequest]:  # fmt: skip
        cast: dict[str, SynthesisRequest] = {}
        for name, voice in zip(names, voices, strict=True):
            if not (name or "").strip():
                continue
            if not voice:
                raise user_error(self.t("script_err_no_voice", name=name.strip()))
            cast[name.strip()] = self._voice(voice, browser_id, prompt, prompt_text)
        if not cast:
            raise user_error(self.t("script_err_no_cast"))
        return cast

    def _voice(self, voice: str, browser_id: str, prompt: str | None, prompt_text: str) -> SynthesisRequest:
        if voice != PROMPT:
            return SynthesisRequest(voice_id=voice, voice_owner=owner_of(browser_id))
        if not prompt:
            raise user_error(self.t("script_err_no_prompt"))
        mode = Mode.ZERO_SHOT if (prompt_text or "").strip() else Mode.CROSS_LINGUAL
        return SynthesisRequest(prompt_wav=prompt, prompt_text=prompt_text or "", mode=mode)

    async def perform(self, script: str, gap: float, *rest: Any) -> AsyncGenerator[tuple[Any, ...], None]:
        """Yields (progress html, result html, files) as each sentence is done, then the finished take."""
        names, voices = rest[:SPEAKERS], rest[SPEAKERS : 2 * SPEAKERS]
        rid, browser_id, prompt, prompt_text, lexicon_id = rest[2 * SPEAKERS :]
        hub, engine = self.studio.hub, self.studio.engine
        rid = rid if RID.match(rid or "") else ""
        try:
            cast = self.cast(names, voices, browser_id, prompt, prompt_text)
            parts = compile_script(
                parse_script(script or "", list(cast)),
                str(getattr(engine, "family", "cosyvoice3")),
                float(gap),
            )
            lexicon = await self.studio.lexicon(lexicon_id or "", browser_id)
        except EngineError as err:
            if rid:
                hub.close(rid)
            raise user_error(self.studio.engine_message(err)) from err
        except gr.Error:
            if rid:
                hub.close(rid)
            raise
        said = " ".join(p.text for p in parts if isinstance(p, Speech))
        stem = views.download_stem(time.time(), " ".join(cast), said)  # the take's files' names (as typed)
        note = ""
        if lexicon is not None:
            parts, applied = apply_to_parts(lexicon, parts)
            note = lexicon_note(self.t, applied.hits)
        async for update in self._run(parts, cast, rid, stem, note):
            yield update

    async def lexicons(self, browser_id: str) -> Any:
        """The Pronunciation picker's choices: the public lexicons and this browser's own."""
        return gr.Dropdown(choices=await self.studio.lexicon_choices(browser_id))

    async def _run(
        self, parts: list[Part], cast: dict[str, SynthesisRequest], rid: str, stem: str, note: str = ""
    ) -> AsyncGenerator[tuple[Any, ...], None]:
        """Progress as each sentence is done, then the take: the whole script's, or (Stop pressed: the
        studio's ``stop`` remembers the id) what was made until then, with its own stopped line; ``note``:
        where the lexicon applied, under the take's progress line."""
        engine, hub = self.studio.engine, self.studio.hub
        if rid:
            hub.open(rid, engine.sample_rate)
        pcm: list[np.ndarray] = []
        done: list[PartDone] = []
        t0 = time.monotonic()
        timer = getattr(engine, "word_timer", None)
        total = sum(1 for p in parts if isinstance(p, Speech))
        yield progress_html(0, total, 0.0, 0.0, self.t), gr.skip(), gr.skip()
        gen = perform(engine, parts, cast, timer, timings=True)
        stopped = self.studio.was_stopped(rid)
        try:
            async for item in gen:
                if stopped := self.studio.was_stopped(rid):
                    break  # the finally below closes the performance: it aborts the parts under way
                if isinstance(item, PartDone):
                    done.append(item)
                    elapsed = time.monotonic() - t0
                    yield progress_html(len(done), total, item.end_s, elapsed, self.t), gr.skip(), gr.skip()
                    continue
                pcm.append(item)
                if rid:
                    hub.publish(rid, views.pcm16_bytes(item))
        except EngineError as err:
            raise user_error(self.studio.engine_message(err)) from err
        except Exception as err:  # a bug: its text and traceback go to the log, not to the visitor
            log.exception("the script failed")
            raise user_error(self.t("err_internal")) from err
        finally:
            await gen.aclose()
            if rid:
                hub.close(rid)
        progress, page, files = await self._finish(pcm, done, rid, total, stem, stopped)
        if note:
            progress += f'<div class="cosy-lexicon-note">{html.escape(note.strip())}</div>'
        yield progress, page, files

    async def _finish(
        self, pcm: list[np.ndarray], done: list[PartDone], rid: str, total: int, stem: str, stopped: bool
    ) -> tuple[Any, ...]:
        """(progress, the take's player and words, its files). The files are named for people (date,
        speakers, first words: ``views.download_stem``) in a folder of the take's id; the player reads the
        store's own ``<id>.wav``. A stop before any audio keeps nothing."""
        rid = rid or new_request_id()
        rate = self.studio.engine.sample_rate
        audio = np.concatenate(pcm) if pcm else np.zeros(0, np.float32)
        state = "stopped" if stopped else "done"
        progress = progress_html(len(done), total, audio.size / rate, 0.0, self.t, state)
        if not audio.size:
            return progress, "", None
        wav = await call_engine(self.studio.store.save, rid, audio, rate)
        turns = [Turn(p.speaker, p.words) for p in done]
        named = Path(wav).parent / rid
        named.mkdir(exist_ok=True)
        files = [named / f"{stem}.{ext}" for ext in ("wav", "srt", "vtt")]
        shutil.copyfile(wav, files[0])
        files[1].write_text(to_srt(turns), encoding="utf-8")
        files[2].write_text(to_vtt(turns), encoding="utf-8")
        page = result_html(f"webui/audio/{rid}.wav", done, self.t, self.studio.random_weights)
        return progress, page, [str(f) for f in files]


def _kept_ids(kept: Any) -> list[str | None]:
    """The browser's kept cast voices: a JSON list of ids; whatever else it holds counts as none kept (the
    browser's storage is the visitor's to edit)."""
    try:
        ids = json.loads(kept) if isinstance(kept, str) else []
    except json.JSONDecodeError:
        return []
    return [v if isinstance(v, str) else None for v in ids] if isinstance(ids, list) else []


def routed(studios: Studios, name: str, owner_at: int) -> Callable[..., Any]:
    """``ScriptDesk.<name>`` as a Gradio event function: the request's language picks the studio (notes,
    progress, errors and the toast's heading in the page's language) and, with a login, the session's
    namespace replaces the browser id at ``owner_at``, as ``Studios.listener`` does for the studio."""
    fn: Callable[..., Any]
    if inspect.isasyncgenfunction(getattr(ScriptDesk, name)):

        async def stream(request: gr.Request, *args: Any) -> AsyncGenerator[Any, None]:
            desk = ScriptDesk(studios.pick(request))
            try:
                async for out in getattr(desk, name)(*studios.signed(request, owner_at, args)):
                    yield out
            except gr.Error as err:
                err.title = desk.t("err_title")
                raise

        fn = stream
    else:

        async def coro(request: gr.Request, *args: Any) -> Any:
            desk = ScriptDesk(studios.pick(request))
            try:
                return await getattr(desk, name)(*studios.signed(request, owner_at, args))
            except gr.Error as err:
                err.title = desk.t("err_title")
                raise

        fn = coro
    fn.__name__ = fn.__qualname__ = name  # Gradio names the event's API endpoint after it
    return fn


def build(
    studios: Studios,
    lbl: Labels,
    owner: gr.Textbox,
    prompt: gr.Audio,
    prompt_text: gr.Textbox,
    demo: gr.Blocks,
) -> None:
    """The script accordion (below the studio's history) and its listeners."""
    t = lbl.texts  # the first render's language; ``ScriptDesk.page`` re-renders it in the session's on load
    with gr.Accordion(lbl("script_title"), open=False, elem_id="cosy-script", elem_classes=["cosy-card"]):
        with gr.Row(equal_height=False):
            with gr.Column(scale=3):
                text, tags = _editor(lbl)
            with gr.Column(scale=2):
                names, voices = _cast_rows(lbl)
                gap = gr.Slider(0.0, 2.0, value=0.3, step=0.05, label=lbl("script_gap"))
                lexicon = gr.Dropdown(
                    [(t("lexicon_none"), "")], value="", label=lbl("lexicon"), info=lbl("lexicon_info"),
                    elem_id="cosy-script-lexicon",
                )  # fmt: skip
                with gr.Row():
                    go = gr.Button(lbl("script_go"), variant="primary", elem_id="cosy-script-go", scale=3)
                    stop = gr.Button(lbl("stop"), variant="stop", elem_id="cosy-script-stop", scale=1)
                progress = gr.HTML(
                    progress_html(0, 0, 0.0, 0.0, t), js_on_load=None, elem_id="cosy-script-progress"
                )
        result = gr.HTML("", js_on_load=PLAYER_JS, elem_id="cosy-script-result")
        files = gr.File(label=lbl("script_files"), file_count="multiple", elem_id="cosy-script-files")
        rid = gr.Textbox(visible=False)
    inputs = [text, gap, *names, *voices, rid, owner, prompt, prompt_text, lexicon]
    js = start_js(inputs.index(rid))
    perform = routed(studios, "perform", inputs.index(owner))
    go.click(perform, inputs, [progress, result, files], js=js, show_progress="hidden")
    light: dict[str, Any] = {"queue": False, "show_progress": "hidden"}
    # the studio's Stop: the player falls silent at the click and hands over its request id, which the
    # performance reads as "stop here and keep what was made" (``ScriptDesk._run``)
    stop.click(studios.listener("stop"), rid, None, js=player.STOP_JS, **light)
    kept = gr.Textbox("[]", visible=False)  # the speakers' kept voices, filled in the browser (keep.js)
    cast = keep.SCRIPT_VOICES_JS
    demo.load(routed(studios, "page", 0), [owner, kept], [*voices, tags, progress], js=cast, **light)
    # the id arrives after the load
    owner.change(routed(studios, "voices", 0), [owner, kept], voices, js=cast, **light)
    owner.change(routed(studios, "lexicons", 0), owner, lexicon, **light)
    _keep(demo, text, gap, names, voices, light)


def _keep(
    demo: gr.Blocks, text: gr.Textbox, gap: gr.Slider, names: list[gr.Textbox], voices: list[gr.Dropdown],
    light: dict[str, Any],
) -> None:  # fmt: skip
    """The desk kept in the browser (``keep.py``) like the studio's form: saved on every change, put back
    on load (the voices through ``ScriptDesk.voices``, which picks only what is still listed)."""
    desk: list[Any] = [text, gap, *names, *voices]
    gr.on([c.change for c in desk], None, desk, None, js=keep.save_script_js(len(names)), **light)
    shown = [text, gap, *names]
    demo.load(None, shown, shown, js=keep.restore_script_js(len(names)), **light)


def _editor(lbl: Labels) -> tuple[gr.Textbox, gr.HTML]:
    """The script box, a one-click insert per tag (at the cursor) and what each tag does."""
    text = gr.Textbox(
        EXAMPLE_SCRIPT, label=lbl("script_text"), lines=9, max_lines=30, elem_id="cosy-script-text",
        info=lbl("script_text_info"),
    )  # fmt: skip
    with gr.Row(elem_id="cosy-script-tags"):
        for tag in TAG_KEYS:
            button = gr.Button(tag, size="sm", min_width=170 if tag.startswith("<break") else 60)
            button.click(None, text, text, js=tag_insert_js(tag), queue=False)
    return text, gr.HTML(tags_html(lbl.texts), js_on_load=None, elem_id="cosy-script-tag-help")


def _cast_rows(lbl: Labels) -> tuple[list[gr.Textbox], list[gr.Dropdown]]:
    names, voices = [], []
    for i in range(SPEAKERS):
        with gr.Row(equal_height=True):
            default = ("Alice", "Bob", "", "")[i]
            names.append(
                gr.Textbox(default, label=lbl("script_speaker"), scale=2, elem_id=f"cosy-sp-name-{i}")
            )
            voices.append(gr.Dropdown([], label=lbl("script_voice"), scale=3, elem_id=f"cosy-sp-voice-{i}"))
    return names, voices
