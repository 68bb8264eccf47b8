"""``build_demo(engine, ui_lang, limits)`` -> ``gr.Blocks``: components, layout and listeners only.

Three columns fit one 1440x900 screen: the voice (mode, prompt or saved voice, transcript, the example
voices), the text (language, text, settings, Generate / Stop) and the answer (live player, result, this
request's metrics, the server panel); the history runs below. What the listeners do lives in
``handlers.Studio`` (reached through ``handlers.Studios``, which picks the session's language); how numbers
look lives in ``views``. The page's css, the player's script and the i18n tables are not Blocks arguments in
Gradio 6: pass ``page_options(ui_lang)`` to ``gr.mount_gradio_app``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import gradio as gr

from engine.config import Limits
from webui import keep, lab_views, player, script_tab, views, voice_library
from webui.handlers import FORM_FIELDS, OWNER_JS, UI_MODES, Engine, Form, Studio, Studios
from webui.stream_route import AudioStore, StreamHub
from webui.texts import EXAMPLES, LANGUAGES, NATIVE_NAMES, Labels, Texts, i18n

GPU = "gpu"  # one concurrency group for every listener that computes on the device
CARD = ["cosy-card"]
# Gradio's copies of what visitors upload and of every take it plays (s: checked every hour, removed after
# six): without it they stay until the server stops, and a public Space's disk fills take by take. The
# visitor loses nothing: the browser keeps its own copies of the prompt and each take (keep.js, fetched as
# the take ends), the history's downloads come from the AudioStore, and the examples stay (Gradio keeps them)
FILES_KEPT = (3600, 6 * 3600)
# The modes each group of inputs serves. The page shows a group while the mode radio has one of its modes
# checked, in css (``mode_css``): no listener toggles visibility, so no order of clicks can leave a group
# hidden (Gradio 6.17 kept a column's hidden class when visible:true came back for it).
SHOWN_IN = {
    "prompt_box": ("zero_shot", "cross_lingual", "instruct", "vc"),
    "transcript_box": ("zero_shot",),
    "voice_box": ("voice",),
    "source_box": ("vc",),
    "instruct_box": ("instruct",),
    "text_box": ("zero_shot", "cross_lingual", "instruct", "voice"),
}


def mode_css() -> str:
    """One rule per mode: its elements show while the radio's input of that value is checked."""
    rules = [".cosy-for { display: none !important; }"]
    for m in UI_MODES:
        checked = f'#cosy-mode input[value="{m}"][aria-checked="true"]'
        rules.append(f".gradio-container:has({checked}) .cosy-for-{m} {{ display: flex !important; }}")
    return "\n".join(rules)


def audio_buttons() -> list[Literal["download", "share"] | gr.Button]:
    """An audio input's buttons: Share only on a Hugging Face Space, the one place Gradio can share to (off a
    Space its button did nothing but log a ShareError)."""
    from gradio.utils import get_space

    return ["download", "share"] if get_space() else ["download"]


def page_options(ui_lang: str = "auto") -> dict[str, Any]:
    """Theme, css, head and (``auto``) the i18n tables for ``gr.mount_gradio_app``."""
    theme = gr.themes.Soft(
        primary_hue="violet", secondary_hue="indigo", neutral_hue="slate",
        font=["Inter", "ui-sans-serif", "system-ui", "-apple-system", "Segoe UI", "sans-serif"],
    )  # fmt: skip
    css = "\n".join((player.css(), mode_css(), script_tab.CSS))
    head = player.head_html() + lab_views.promote_script()  # a take promoted from the prompt lab
    options: dict[str, Any] = {"theme": theme, "css": css, "head": head}
    return options | ({"i18n": i18n()} if ui_lang == "auto" else {})


def build_demo(
    engine: Engine,
    ui_lang: str = "auto",
    limits: Limits | None = None,
    *,
    hub: StreamHub | None = None,
    store: AudioStore | None = None,
    random_weights: bool = False,
    account: Callable[[str | None], str | None] | None = None,
    files_kept: tuple[int, int] = FILES_KEPT,
) -> gr.Blocks:
    """The studio over one resident engine; ``hub``/``store`` must be the ones ``stream_route`` serves.
    ``ui_lang`` "auto" follows the browser; "zh" / "en" force one language. ``account`` (with a login):
    a session's user name -> its voice namespace (``login.KeyLogin.owner``). ``files_kept``: Gradio's
    ``delete_cache`` (every s, files older than s), ``FILES_KEPT``."""
    limits, lbl = limits or Limits(), Labels(ui_lang)
    t = lbl.texts  # the first render's language; ``Studio.page`` re-renders it in the session's on load
    hub = hub if hub is not None else StreamHub()  # an empty hub is falsy (it has __len__)
    studio = Studio(engine, limits, t, hub, store if store is not None else AudioStore(), random_weights)
    studio.chips = {"model": str(engine.model_name), "family": str(getattr(engine, "family", "?"))}
    studio.chips["rate"] = f"{engine.sample_rate // 1000} kHz"
    studios = Studios(studio, ui_lang, account)
    with gr.Blocks(title=t("title"), analytics_enabled=False, delete_cache=files_kept) as demo:
        header = gr.HTML(studio.page()[0], js_on_load=None)
        ask = _filled_by_examples(lbl, t)  # placed below; made first so the examples can sit above them
        ask |= _mode_bar(lbl, t)
        with gr.Row(equal_height=False, elem_classes="cosy-main"):
            with gr.Column(scale=10, min_width=360):
                ask |= _voice_column(lbl, t, engine, studio, ask)
            with gr.Column(scale=10, min_width=360):
                ask |= _source_card(lbl)
                ask |= _text_column(lbl, t, limits, ask)
            with gr.Column(scale=10, min_width=360, elem_classes="cosy-answer"):
                answer = _answer_column(lbl, t)
        _example_texts(lbl, t, ask)
        with gr.Accordion(lbl("history"), open=True, elem_classes=CARD):
            answer["history"] = gr.HTML(views.note_html(t("history_empty")), js_on_load=None)
        answer["header"] = header
        history = gr.State([])
        answer["kept_history"] = gr.Textbox(visible=False)  # the browser's kept history, on load (keep.js)
        rid = gr.Textbox(visible=False)
        ask["owner"] = gr.Textbox(visible=False, elem_id="cosy-owner")  # the browser's id (localStorage)
        script_tab.build(studios, lbl, ask["owner"], ask["prompt"], ask["prompt_text"], demo)
        _listen(demo, studios, limits, ask, answer, history, rid)
    demo.queue(max_size=limits.max_queue)
    return demo


def _filled_by_examples(lbl: Labels, t: Texts) -> dict[str, Any]:
    """Prompt, transcript, language and text, unrendered: ``render()`` places them in their columns."""
    wave = gr.WaveformOptions(waveform_color="#a78bfa", waveform_progress_color="#7c3aed")
    return {
        "prompt": gr.Audio(
            sources=["upload", "microphone"], type="filepath", label=lbl("prompt_audio"),
            waveform_options=wave, elem_id="cosy-prompt", render=False, buttons=audio_buttons(),
        ),
        "prompt_text": gr.Textbox(
            label=lbl("prompt_text"), placeholder=lbl("prompt_text_ph"), lines=2, elem_id="cosy-transcript",
            render=False,
        ),
        "language": gr.Dropdown(
            [(t(f"lang_{x}"), x) for x in LANGUAGES], value="auto", label=lbl("language"),
            elem_id="cosy-lang", render=False,
        ),
        "text": gr.Textbox(
            label=lbl("text"), placeholder=lbl("text_ph"), lines=5, max_lines=12, elem_id="cosy-text",
            render=False,
        ),
    }  # fmt: skip


def _voice_column(
    lbl: Labels, t: Texts, engine: Engine, studio: Studio, filled: dict[str, Any]
) -> dict[str, Any]:
    """The prompt (examples, audio, transcript, instruction, save) or the saved voice, as the mode needs."""
    c: dict[str, Any] = {}
    with gr.Column(elem_classes=CARD):
        # every mode's one voice picker (``voice_library``); the id the browser tests knew the chips by
        cards = voice_library.voice_cards(engine.example_voices(), [], t)
        c["library"] = gr.HTML(
            voice_library.library_html(cards, t), js_on_load=None, elem_id="cosy-examples", padding=False
        )
        c["library_action"] = gr.Textbox("", visible=False)  # a card's action, as JSON (library.js)
        c["library_go"] = gr.Button("", elem_id="cosy-lib-go", elem_classes="cosy-unseen")
        with gr.Column(elem_classes=views.for_modes(SHOWN_IN["prompt_box"])) as c["prompt_box"]:
            _example_voices(lbl, studio, filled)
            filled["prompt"].render()
            c["prompt_note"] = gr.HTML(views.note_html(t("prompt_none")), js_on_load=None)
            with gr.Column(elem_classes=views.for_modes(SHOWN_IN["transcript_box"])) as c["transcript_box"]:
                filled["prompt_text"].render()
                # the transcription's own note: the prompt note above has another writer (prompt_info, on
                # every change), and whichever answered last would win
                c["asr_note"] = gr.HTML("", js_on_load=None, elem_id="cosy-asr-note")
            with gr.Column(elem_classes=views.for_modes(SHOWN_IN["instruct_box"])) as c["instruct_box"]:
                presets = views.preset_choices(engine.instruct_presets(), t)
                c["preset"] = gr.Dropdown(
                    presets, value=None, label=lbl("instruct_preset"), elem_id="cosy-preset"
                )
                c["instruct"] = gr.Textbox(
                    label=lbl("instruct_text"),
                    placeholder=lbl("instruct_ph"),
                    lines=2,
                    elem_id="cosy-instruct",
                )
            # last: saving is optional, the inputs above are what Generate needs
            # the button as high as the box, not as the box and its label, and no wider than its words
            with gr.Row(equal_height=False, elem_classes=["cosy-save-row"]):
                c["save_name"] = gr.Textbox(
                    label=lbl("save_name"), placeholder=lbl("save_name_ph"), scale=3, max_lines=1
                )
                c["save"] = gr.Button(lbl("save_btn"), scale=0, min_width=124, size="md", elem_id="cosy-save")
            c["save_note"] = gr.HTML("", js_on_load=None, elem_id="cosy-save-note")
        with gr.Column(elem_classes=views.for_modes(SHOWN_IN["voice_box"])) as c["voice_box"]:
            # deleting is the library's (a card's Delete, with Undo): no one-click delete here
            c["voice"] = gr.Dropdown([], label=lbl("saved_voice"), elem_id="cosy-voice")
            c["voice_note"] = gr.HTML("", js_on_load=None, elem_id="cosy-voice-note")
            c["kept_voice"] = gr.Textbox("", visible=False)  # the pick this browser kept (keep.js), on load
    return c


def _mode_bar(lbl: Labels, t: Texts) -> dict[str, Any]:
    """The mode across the page, above the columns: in one line it costs the columns little height."""
    c: dict[str, Any] = {}
    with gr.Row(equal_height=True, elem_classes=[*CARD, "cosy-modebar"]):
        c["mode"] = gr.Radio(
            [(t(f"mode_{m}"), m) for m in UI_MODES], value="zero_shot", label=lbl("mode"), scale=3,
            show_label=False, elem_id="cosy-mode",
        )  # fmt: skip
        c["mode_help"] = gr.HTML(views.mode_help_html(UI_MODES, t), js_on_load=None, scale=2)
    return c


def _source_card(lbl: Labels) -> dict[str, Any]:
    """Voice conversion's source speech, in the place of the text it replaces."""
    c: dict[str, Any] = {}
    with gr.Column(elem_classes=[*CARD, *views.for_modes(SHOWN_IN["source_box"])]) as c["source_box"]:
        c["source"] = gr.Audio(
            sources=["upload", "microphone"],
            type="filepath",
            label=lbl("source_audio"),
            elem_id="cosy-source",
            buttons=audio_buttons(),
        )
    return c


def _text_column(lbl: Labels, t: Texts, limits: Limits, filled: dict[str, Any]) -> dict[str, Any]:
    c: dict[str, Any] = {}
    with gr.Column(elem_classes=[*CARD, *views.for_modes(SHOWN_IN["text_box"])]) as c["text_box"]:
        filled["language"].render()
        filled["text"].render()
        c["counter"] = gr.HTML(views.counter_text("", limits.max_text_chars, 0, t), js_on_load=None)
        # side by side and closed: the live-text controls cost no height, so Generate stays on the screen
        with gr.Row(equal_height=True, elem_classes="cosy-accordions"):
            with gr.Accordion(lbl("split_preview"), open=False):
                c["split"] = gr.HTML(views.split_preview_html([]), js_on_load=None)
            with gr.Accordion(lbl("live_text"), open=False, elem_id="cosy-live-text"):
                c["live_text"] = gr.Checkbox(False, label=lbl("live_text"), info=lbl("live_text_info"))
                c["live_wps"] = gr.Slider(1, 20, value=4, step=1, label=lbl("live_wps"))
    # Generate / Stop right under the text, above the settings: sticky at the window's bottom, the bar
    # covers nothing while its own place is on the screen (a bar below the settings covered the Seed
    # field at 1440x900); on a phone it is fixed at the bottom (studio.css)
    with gr.Column(elem_classes=[*CARD, "cosy-actions"]), gr.Row():
        go = "cosy-go"
        c["generate"] = gr.Button(
            lbl("generate"), variant="primary", scale=3, elem_id="cosy-generate", elem_classes=go
        )
        c["stop"] = gr.Button(lbl("stop"), variant="stop", scale=1, elem_id="cosy-stop", elem_classes=go)
    with gr.Column(elem_classes=CARD):
        with gr.Row(equal_height=True, elem_classes="cosy-settings"):
            c["stream"] = gr.Checkbox(
                True, label=lbl("streaming"), info=lbl("streaming_info"), scale=1, elem_id="cosy-stream"
            )
            c["speed"] = gr.Slider(
                0.5, 2.0, value=1.0, step=0.05, label=lbl("speed"), scale=2, elem_id="cosy-speed"
            )
        # the browser's own lexicons and the public ones, filled on load (``Studio.browser_lexicons``)
        c["lexicon"] = gr.Dropdown(
            [(t("lexicon_none"), "")], value="", label=lbl("lexicon"), info=lbl("lexicon_info"),
            elem_id="cosy-lexicon",
        )  # fmt: skip
        c["lexicon_note"] = gr.HTML("", js_on_load=None, elem_id="cosy-lexicon-note")
        c["kept_lexicon"] = gr.Textbox("", visible=False)  # the pick this browser kept (keep.js), on load
        # the lab's "Use in studio" picks a lexicon through it (``lab_promote.js``: window.cosyLexPick)
        c["lexicon_go"] = gr.Button("", elem_id="cosy-lex-go", elem_classes="cosy-unseen")
        with gr.Row(equal_height=True, elem_classes="cosy-settings"):
            c["seed"] = gr.Number(
                -1,
                label=lbl("seed"),
                info=lbl("seed_info"),
                precision=0,
                minimum=-1,
                scale=3,
                elem_id="cosy-seed",
            )
            # an SVG die, not an emoji: it draws without an emoji font (the label is for screen readers)
            die = str(player.STATIC / "dice.svg")
            c["dice"] = gr.Button(lbl("dice"), icon=die, elem_classes="cosy-dice", scale=0, min_width=52)
    return c


def _answer_column(lbl: Labels, t: Texts) -> dict[str, Any]:
    c: dict[str, Any] = {}
    c["live"] = gr.HTML(player.card_html(t), js_on_load=None)
    wave = gr.WaveformOptions(waveform_color="#a78bfa", waveform_progress_color="#7c3aed")
    c["audio"] = gr.Audio(
        label=lbl("final_audio"), type="filepath", interactive=False, buttons=["download"],
        waveform_options=wave, elem_id="cosy-result",
    )  # fmt: skip
    c["status"] = gr.HTML(
        f'<div class="cosy-status" data-state="idle">{t("status_idle")}</div>', js_on_load=None
    )
    # shown by css only while the status says "failed"; it runs Generate's listener again
    c["retry"] = gr.Button(lbl("retry"), size="sm", elem_id="cosy-retry")
    with gr.Column(elem_classes=CARD):
        c["metrics"] = gr.HTML(views.metrics_html(None, t), js_on_load=None)
    with gr.Accordion(lbl("server"), open=False, elem_classes=CARD):
        c["server"] = gr.HTML("", js_on_load=None)
    return c


def _example_voices(lbl: Labels, studio: Studio, filled: dict[str, Any]) -> None:
    """The example voices as chips: a click fills prompt, transcript, language and a text to speak. Unseen:
    the library's cards show the voices, and a card's use in a prompt mode clicks its chip (library.js)."""
    rows, labels = studio.example_rows()
    if rows:
        fields = [filled[k] for k in ("prompt", "prompt_text", "language", "text")]
        gr.Examples(
            rows, fields, label=lbl("example_voices"), example_labels=labels, elem_id="cosy-example-fill"
        )


def _example_texts(lbl: Labels, t: Texts, filled: dict[str, Any]) -> None:
    """The example texts as labelled chips: a click fills the text and its language.

    Labelled, not a table (issue 15): Gradio 6.17's examples table mounts each cell's component once its
    code has loaded; when that runs in a later Svelte batch while the one that first set the table's props
    is still pending, the props read as unset and ``component_props[i]`` throws "Cannot read properties
    of undefined (reading '0')", on most uncached loads of this page. Its headers also showed the fields'
    i18n keys raw. Labelled examples are plain buttons: no cell components, no headers. A label is built
    once for both UI languages, so it names the language in itself ("日本語", never "日本語 (Japanese)")."""
    rows = [[text, lang] for lang, text in EXAMPLES]
    labels = [f"{NATIVE_NAMES[lang]} · {text}" for lang, text in EXAMPLES]
    fields = [filled["text"], filled["language"]]
    gr.Examples(rows, fields, label=lbl("examples"), example_labels=labels, elem_id="cosy-example-texts")


def _listen(
    demo: gr.Blocks, studios: Studios, limits: Limits, a: dict[str, Any], b: dict[str, Any],
    history: gr.State, rid: gr.Textbox,
) -> None:  # fmt: skip
    on = studios.listener  # the event function for a Studio method, in the session's language
    light: dict[str, Any] = {"queue": False, "show_progress": "hidden"}  # UI-only work skips the GPU queue
    gpu: dict[str, Any] = {"concurrency_id": GPU, "concurrency_limit": limits.max_concurrency}
    a["prompt"].change(on("prompt_info"), a["prompt"], a["prompt_note"], **light)
    typed = gr.Checkbox(False, visible=False)  # the browser fills it in (``player.TRANSCRIBE_JS``)
    cleared = [a["prompt_text"], a["asr_note"]]
    a["prompt"].clear(on("transcript_cleared"), typed, cleared, js=player.CLEARED_JS, **light)
    asr_in = [a["prompt"], a["language"], a["prompt_text"], typed]
    gr.on(
        [a["prompt"].upload, a["prompt"].stop_recording], on("transcribe"), asr_in,
        [a["prompt_text"], a["language"], a["asr_note"]], js=player.TRANSCRIBE_JS, show_progress="minimal",
        show_progress_on=a["prompt_text"],
    )  # fmt: skip
    gr.on(
        [a["text"].change, a["language"].change], on("text_info"), [a["text"], a["language"]],
        [a["counter"], a["split"]], **light,
    )  # fmt: skip
    a["preset"].change(on("pick_preset"), a["preset"], a["instruct"], **light)
    a["dice"].click(on("dice"), None, a["seed"], **light)
    owner = a["owner"]
    save_inputs = [a["save_name"], a["prompt"], a["prompt_text"], owner]
    shelf = [a["library"]]
    saved = a["save"].click(on("save_voice"), save_inputs, [a["voice"], a["save_note"]], **gpu)
    saved.then(voice_library.routed(studios, "saved", 0), [owner, a["voice"]], shelf, **light)
    trash = gr.State([])  # the voices this page deleted, for Undo
    act_in = [a["library_action"], a["mode"], owner, trash]
    act_out = [a["prompt"], a["prompt_text"], a["language"], a["voice"], a["library"], trash]
    act = voice_library.routed(studios, "act", 2)
    # library.js puts a card's action in window.cosyLibAction and clicks the unseen button (a value typed
    # into an unseen text box by a script fired no event in Gradio 6.17); Undo saves again: the GPU group
    go = "(action, mode, owner, trash) => [window.cosyLibAction || '', mode, owner, trash]"
    a["library_go"].click(act, act_in, act_out, js=go, show_progress="hidden", **gpu)
    form = {
        "mode": a["mode"], "prompt_wav": a["prompt"], "prompt_text": a["prompt_text"],
        "instruct_text": a["instruct"], "source_wav": a["source"], "voice_id": a["voice"],
        "language": a["language"], "text": a["text"], "stream": a["stream"], "speed": a["speed"],
        "seed": a["seed"], "rid": rid, "history": history, "browser_id": owner, "live": a["live_text"],
        "wps": a["live_wps"], "lexicon": a["lexicon"],
    }  # fmt: skip
    inputs = [form[name] for name in FORM_FIELDS]
    outputs = [b["audio"], b["metrics"], b["status"], history, b["history"]]
    js = player.generate_js(len(inputs), FORM_FIELDS.index("stream"), FORM_FIELDS.index("rid"))
    generated = gr.on(
        [a["generate"].click, b["retry"].click], on("generate", Form.from_ui), inputs, outputs, js=js,
        show_progress="minimal", show_progress_on=b["status"], **gpu,
    )  # fmt: skip
    generated.then(None, None, None, js=player.FINISHED_JS, **light)
    a["stop"].click(on("stop"), rid, None, js=player.STOP_JS, **light)
    # always_last: .input's default ("once") drops keystrokes while one is being handled, so the box's
    # final words could never reach a live-text request
    keys = {**light, "trigger_mode": "always_last"}
    a["text"].input(on("live_typed"), [a["text"], rid], None, js=player.TYPED_JS, **keys)
    gr.Timer(1.0).tick(on("server_panel"), None, b["server"], **light)
    page = [b["header"], a["mode"], a["language"], a["mode_help"], a["prompt_note"], a["counter"]]
    page += [b["status"], b["metrics"], b["live"], a["preset"]]
    demo.load(on("page"), None, page, **light)
    _keep(demo, on, a, b, history, light)
    # the script draws or reads the id in the browser and hands it over as the input
    picked = [owner, a["voice"], a["voice_note"]]
    js = keep.owner_and_voice_js(OWNER_JS)
    voices = demo.load(on("browser_voices"), [owner, a["kept_voice"]], picked, js=js, **light)
    voices.then(None, None, None, js=keep.VOICE_RESTORED_JS, **light)
    owner.change(voice_library.routed(studios, "page", 0), owner, shelf, **light)  # the id came
    js = keep.owner_and_lexicon_js(OWNER_JS)
    lexicons = [a["lexicon"], a["lexicon_note"]]
    listed = demo.load(on("browser_lexicons"), [owner, a["kept_lexicon"]], lexicons, js=js, **light)
    listed.then(None, None, None, js=keep.LEXICON_RESTORED_JS, **light)
    pick = "(wanted, owner) => [window.cosyLexPick || '', owner]"
    a["lexicon_go"].click(on("pick_lexicon"), [a["lexicon"], owner], a["lexicon"], js=pick, **light)
    demo.load(on("server_panel"), None, b["server"], **light)


def _keep(
    demo: gr.Blocks, on: Callable[..., Any], a: dict[str, Any], b: dict[str, Any], history: gr.State,
    light: dict[str, Any],
) -> None:  # fmt: skip
    """The visit kept in the browser (``keep.py``): the form saved on every change and put back on load,
    the prompt and source files kept and uploaded again, the history restored in the page's language."""
    fields = {"instruct": a["instruct"], "live": a["live_text"], "wps": a["live_wps"]}
    form = [fields.get(name) or a[name] for name in keep.FORM_KEPT]
    gr.on([c.change for c in form], None, form, None, js=keep.save_form_js(), **light)
    demo.load(None, form, form, js=keep.restore_form_js(), **light)
    audio = [a[kind] for kind in keep.AUDIO_KEPT]
    for kind, component in zip(keep.AUDIO_KEPT, audio, strict=True):
        component.change(None, component, None, js=keep.keep_audio_js(kind), **light)
    demo.load(None, audio, audio, js=keep.restore_audio_js(), **light)
    a["voice"].change(None, a["voice"], None, js=keep.KEEP_VOICE_JS, **light)
    a["lexicon"].change(None, a["lexicon"], None, js=keep.KEEP_LEXICON_JS, **light)
    kept = b["kept_history"]
    demo.load(on("restore_history"), kept, [history, b["history"]], js=keep.RESTORE_HISTORY_JS, **light)
