"""``build_demo(engine, ui_lang, limits)`` -> ``gr.Blocks``: components, layout and listeners only.

Two columns: the left one asks (mode, voice, text, settings, Generate / Stop, examples), the right one
answers (live player, result, this request's metrics, the server panel, the session's history). What the
listeners do lives in ``handlers.Studio``; how numbers look lives in ``views``. The page's css and the
player's script are not Blocks arguments in Gradio 6: pass ``page_options()`` to ``gr.mount_gradio_app``.
"""

from __future__ import annotations

from typing import Any

import gradio as gr

from engine.config import Limits
from webui import player, views
from webui.handlers import UI_MODES, Engine, Studio
from webui.stream_route import AudioStore, StreamHub
from webui.texts import EXAMPLES, LANGUAGES, Texts

GPU = "gpu"  # one concurrency group for every listener that computes on the device
CARD = ["cosy-card"]


def page_options() -> dict[str, Any]:
    """Theme, css and head for ``gr.mount_gradio_app`` (Gradio 6 takes them there, not in ``Blocks``)."""
    theme = gr.themes.Soft(
        primary_hue="violet", secondary_hue="indigo", neutral_hue="slate",
        font=["Inter", "ui-sans-serif", "system-ui", "-apple-system", "Segoe UI", "sans-serif"],
    )  # fmt: skip
    return {"theme": theme, "css": player.css(), "head": player.head_html()}


def build_demo(
    engine: Engine,
    ui_lang: str = "zh",
    limits: Limits | None = None,
    *,
    hub: StreamHub | None = None,
    store: AudioStore | None = None,
    random_weights: bool = False,
) -> gr.Blocks:
    """The studio over one resident engine; ``hub``/``store`` must be the ones ``stream_route`` serves."""
    limits, t = limits or Limits(), Texts(ui_lang)
    hub = hub if hub is not None else StreamHub()  # an empty hub is falsy (it has __len__)
    studio = Studio(engine, limits, t, hub, store if store is not None else AudioStore())
    chips = {"model": str(engine.model_name), "family": str(getattr(engine, "family", "?"))}
    chips["rate"] = f"{engine.sample_rate // 1000} kHz"
    with gr.Blocks(title=t("title"), analytics_enabled=False) as demo:
        gr.HTML(views.header_html(t, chips, t("banner_random") if random_weights else None), js_on_load=None)
        with gr.Row(equal_height=False):
            with gr.Column(scale=11, min_width=420):
                ask = _ask_column(t, engine, limits)
            with gr.Column(scale=9, min_width=380):
                answer = _answer_column(t)
                examples = [[text, lang] for lang, text in EXAMPLES]  # under the panels: fills the column
                gr.Examples(examples, [ask["text"], ask["language"]], label=t("examples"))
        with gr.Accordion(t("history"), open=True, elem_classes=CARD):
            answer["history"] = gr.HTML(views.note_html(t("history_empty")), js_on_load=None)
        history = gr.State([])
        rid = gr.Textbox(visible=False)
        _listen(demo, studio, limits, ask, answer, history, rid)
    demo.queue(max_size=limits.max_queue)
    return demo


def _ask_column(t: Texts, engine: Engine, limits: Limits) -> dict[str, Any]:
    c: dict[str, Any] = {}
    with gr.Column(elem_classes=CARD):
        c["mode"] = gr.Radio([(t(f"mode_{m}"), m) for m in UI_MODES], value="zero_shot", label=t("mode"))
        c["mode_help"] = gr.HTML(views.note_html(t("mode_help_zero_shot")), js_on_load=None)
    with gr.Column(elem_classes=CARD):
        gr.HTML(f'<div class="cosy-section">{t("voice_group")}</div>', js_on_load=None)
        with gr.Column() as c["prompt_box"]:
            wave = gr.WaveformOptions(waveform_color="#a78bfa", waveform_progress_color="#7c3aed")
            c["prompt"] = gr.Audio(
                sources=["upload", "microphone"],
                type="filepath",
                label=t("prompt_audio"),
                waveform_options=wave,
                elem_id="cosy-prompt",
            )
            c["prompt_note"] = gr.HTML(views.note_html(t("prompt_none")), js_on_load=None)
            c["prompt_text"] = gr.Textbox(
                label=t("prompt_text"), placeholder=t("prompt_text_ph"), lines=2, elem_id="cosy-transcript"
            )
            with gr.Row(equal_height=True):
                c["save_name"] = gr.Textbox(label=t("save_name"), placeholder=t("save_name_ph"), scale=3)
                c["save"] = gr.Button(t("save_btn"), scale=1, size="md")
            c["save_note"] = gr.HTML("", js_on_load=None)
        with gr.Column(visible=False) as c["voice_box"]:
            with gr.Row(equal_height=True):
                c["voice"] = gr.Dropdown([], label=t("saved_voice"), scale=4)
                c["delete"] = gr.Button(t("delete_btn"), variant="stop", size="md", scale=1)
            c["voice_note"] = gr.HTML("", js_on_load=None)
        with gr.Column(visible=False) as c["source_box"]:
            c["source"] = gr.Audio(sources=["upload", "microphone"], type="filepath", label=t("source_audio"))
        with gr.Column(visible=False) as c["instruct_box"]:
            presets = views.preset_choices(engine.instruct_presets())
            c["preset"] = gr.Dropdown(presets, value=None, label=t("instruct_preset"))
            c["instruct"] = gr.Textbox(label=t("instruct_text"), placeholder=t("instruct_ph"), lines=2)
    with gr.Column(elem_classes=CARD) as c["text_box"]:
        gr.HTML(f'<div class="cosy-section">{t("text_group")}</div>', js_on_load=None)
        c["language"] = gr.Dropdown(
            [(t(f"lang_{x}"), x) for x in LANGUAGES], value="auto", label=t("language")
        )
        c["text"] = gr.Textbox(
            label=t("text"), placeholder=t("text_ph"), lines=5, max_lines=14, elem_id="cosy-text"
        )
        c["counter"] = gr.HTML(views.counter_text("", limits.max_text_chars, 0, t), js_on_load=None)
        with gr.Row(equal_height=True):
            c["live_text"] = gr.Checkbox(False, label=t("live_text"), info=t("live_text_info"), scale=2)
            c["live_wps"] = gr.Slider(1, 20, value=4, step=1, label=t("live_wps"), scale=1)
        with gr.Accordion(t("split_preview"), open=False):
            c["split"] = gr.HTML(views.split_preview_html([]), js_on_load=None)
    with gr.Column(elem_classes=CARD):
        with gr.Row(equal_height=True, elem_classes="cosy-settings"):
            c["stream"] = gr.Checkbox(True, label=t("streaming"), info=t("streaming_info"), scale=1)
            c["speed"] = gr.Slider(0.5, 2.0, value=1.0, step=0.05, label=t("speed"), scale=2)
            c["seed"] = gr.Number(-1, label=t("seed"), info=t("seed_info"), precision=0, minimum=-1, scale=1)
            c["dice"] = gr.Button(t("dice"), elem_classes="cosy-dice", scale=0, min_width=52)
        with gr.Row():
            go = "cosy-go"
            c["generate"] = gr.Button(
                t("generate"), variant="primary", scale=3, elem_id="cosy-generate", elem_classes=go
            )
            c["stop"] = gr.Button(t("stop"), variant="stop", scale=1, elem_id="cosy-stop", elem_classes=go)
    return c


def _answer_column(t: Texts) -> dict[str, Any]:
    c: dict[str, Any] = {}
    c["live"] = gr.HTML(player.card_html(t), js_on_load=None)
    wave = gr.WaveformOptions(waveform_color="#a78bfa", waveform_progress_color="#7c3aed")
    c["audio"] = gr.Audio(
        label=t("final_audio"),
        type="filepath",
        interactive=False,
        buttons=["download"],
        waveform_options=wave,
    )
    c["status"] = gr.HTML(
        f'<div class="cosy-status" data-state="idle">{t("status_idle")}</div>', js_on_load=None
    )
    with gr.Column(elem_classes=CARD):
        gr.HTML(f'<div class="cosy-section">{t("metrics")}</div>', js_on_load=None)
        c["metrics"] = gr.HTML(views.metrics_html(None, t), js_on_load=None)
    with gr.Column(elem_classes=CARD):
        gr.HTML(f'<div class="cosy-section">{t("server")}</div>', js_on_load=None)
        c["server"] = gr.HTML("", js_on_load=None)
    return c


def _listen(
    demo: gr.Blocks, studio: Studio, limits: Limits, a: dict[str, Any], b: dict[str, Any], history: gr.State,
    rid: gr.Textbox,
) -> None:  # fmt: skip
    light: dict[str, Any] = {"queue": False, "show_progress": "hidden"}  # UI-only work skips the GPU queue
    gpu: dict[str, Any] = {"concurrency_id": GPU, "concurrency_limit": limits.max_concurrency}
    boxes = ["prompt_box", "prompt_text", "voice_box", "instruct_box", "source_box", "text_box", "mode_help"]
    a["mode"].change(studio.mode_changed, a["mode"], [a[k] for k in boxes], **light)
    a["prompt"].change(studio.prompt_info, a["prompt"], a["prompt_note"], **light)
    gr.on(
        [a["text"].change, a["language"].change], studio.text_info, [a["text"], a["language"]],
        [a["counter"], a["split"]], **light,
    )  # fmt: skip
    a["preset"].change(studio.pick_preset, a["preset"], a["instruct"], **light)
    a["dice"].click(studio.dice, None, a["seed"], **light)
    save_inputs = [a["save_name"], a["prompt"], a["prompt_text"]]
    a["save"].click(studio.save_voice, save_inputs, [a["voice"], a["save_note"]], **gpu)
    a["delete"].click(studio.delete_voice, a["voice"], [a["voice"], a["voice_note"]], **light)
    names = [
        "mode",
        "prompt",
        "prompt_text",
        "instruct",
        "source",
        "voice",
        "language",
        "text",
        "stream",
        "speed",
    ]
    inputs = [*(a[k] for k in names), a["seed"], rid, history, a["live_text"], a["live_wps"]]
    outputs = [b["audio"], b["metrics"], b["status"], history, b["history"]]
    js = player.generate_js(len(inputs), names.index("stream"), inputs.index(rid))
    a["generate"].click(
        studio.generate, inputs, outputs, js=js, show_progress="minimal", show_progress_on=b["status"], **gpu
    )
    a["stop"].click(studio.stop, rid, b["status"], js=player.STOP_JS, **light)
    a["text"].input(studio.live_typed, [a["text"], rid], None, js=player.TYPED_JS, **light)
    gr.Timer(1.0).tick(studio.server_panel, None, b["server"], **light)
    demo.load(studio.voice_dropdown, None, a["voice"], **light)
    demo.load(studio.server_panel, None, b["server"], **light)
