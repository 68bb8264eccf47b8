"""build_demo wires the studio: labels per UI language, one GPU concurrency group, a bounded queue."""

from __future__ import annotations

import json
import time
from pathlib import Path

import gradio as gr
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from engine.config import Limits
from tests.conftest import WAIT_S
from tests.fakes import FakeEngine
from webui.layout import FILES_KEPT, GPU, SHOWN_IN, build_demo, page_options


def listeners(demo) -> dict[str, object]:
    return {getattr(f.fn, "__name__", ""): f for f in demo.fns.values()}


@pytest.mark.parametrize(("lang", "label"), [("zh", "生成"), ("en", "Generate")])
def test_labels_follow_the_ui_language(lang, label) -> None:
    config = json.dumps(build_demo(FakeEngine(), lang).get_config_file(), ensure_ascii=False, default=str)
    assert f'"value": "{label}"' in config


def test_gpu_work_shares_one_concurrency_group_and_the_queue_is_bounded() -> None:
    demo = build_demo(FakeEngine(), "en", Limits(max_concurrency=3, max_queue=7))
    fns = listeners(demo)
    for name in ("generate", "save_voice"):
        assert (fns[name].concurrency_id, fns[name].concurrency_limit, fns[name].queue) == (GPU, 3, True)
    for name in ("stop", "text_info", "server_panel", "transcript_cleared", "prompt_info", "dice"):
        assert fns[name].queue is False, name  # UI-only work never waits behind the GPU
    assert demo._queue.max_size == 7


def test_generate_hook_hands_the_request_id_to_the_handler() -> None:
    gen = listeners(build_demo(FakeEngine(), "en"))["generate"]
    names = [getattr(c, "elem_id", None) for c in gen.inputs]
    assert len(gen.inputs) == 17 and "slice(0, 17)" in gen.js and "args[11] = rid" in gen.js
    assert "cosy-prompt" in names and "cosy-text" in names and names[13] == "cosy-owner"
    assert "if (args[8]) p.start(rid)" in gen.js  # input 8 is the Stream checkbox


def test_random_weights_banner_and_presets() -> None:
    engine = FakeEngine()
    config = json.dumps(
        build_demo(engine, "en", random_weights=True).get_config_file(), ensure_ascii=False, default=str
    )
    assert "RANDOM weights" in config and engine.instruct_presets()[0] in config
    assert "RANDOM weights" not in json.dumps(build_demo(engine, "en").get_config_file(), default=str)


def test_page_options_carry_the_player_and_styles() -> None:
    opts = page_options()
    assert "window.cosyPlayer" in opts["head"] and opts["head"].startswith("<script>")
    assert ".cosy-tile" in opts["css"] and opts["theme"] is not None


def test_each_mode_shows_exactly_its_inputs_through_css() -> None:
    """No listener toggles visibility: each group carries its modes' classes and the page's css shows a
    group only while the radio's input of one of those modes is checked."""
    demo = build_demo(FakeEngine(), "en")
    classes = {tuple(b.elem_classes or ()) for b in demo.blocks.values()}
    for modes in SHOWN_IN.values():
        assert any(set(c) >= {"cosy-for", *(f"cosy-for-{m}" for m in modes)} for c in classes), modes
    css = page_options()["css"]
    assert ".cosy-for { display: none !important; }" in css
    for mode in ("zero_shot", "cross_lingual", "instruct", "vc", "voice"):
        rule = f'#cosy-mode input[value="{mode}"][aria-checked="true"]) .cosy-for-{mode} {{ display: flex'
        assert rule in css
    assert not any(getattr(f.fn, "__name__", "") == "mode_changed" for f in demo.fns.values())


@pytest.mark.parametrize(("space", "share"), [(None, False), ("someone/cosystream", True)])
def test_the_audio_inputs_offer_share_only_on_a_space(monkeypatch, space, share) -> None:
    if space:  # what a Hugging Face Space sets (gradio.utils.get_space)
        monkeypatch.setenv("SYSTEM", "spaces")
        monkeypatch.setenv("SPACE_ID", space)
    else:
        monkeypatch.delenv("SYSTEM", raising=False)
    config = build_demo(FakeEngine(), "en").get_config_file()
    buttons = {c["props"].get("elem_id"): c["props"].get("buttons") for c in config["components"]}
    for elem_id in ("cosy-prompt", "cosy-source"):
        assert ("share" in buttons[elem_id]) is share and "download" in buttons[elem_id]


def served_take(demo, tmp_path):
    """A take as Gradio plays it: copied into its cache for the result's player, as its output would be."""
    import numpy as np
    import soundfile as sf
    from gradio import processing_utils

    take = tmp_path / "take.wav"
    sf.write(take, np.zeros(2400, dtype=np.float32), 24000)
    result = next(b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "cosy-result")
    cached = Path(processing_utils.move_resource_to_block_cache(str(take), result))
    assert cached.is_file() and cached != take
    return cached


def test_gradios_copies_of_takes_go_after_their_age_while_the_studio_serves(tmp_path) -> None:
    """Without ``delete_cache`` every upload and take stays in Gradio's cache until the server stops."""
    demo = build_demo(FakeEngine(), "en", files_kept=(1, 1))
    with TestClient(gr.mount_gradio_app(FastAPI(), demo, path="/")):
        cached = served_take(demo, tmp_path)
        deadline = time.monotonic() + WAIT_S
        while cached.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not cached.exists()


def test_the_studios_copies_stay_for_hours_and_go_when_the_server_stops(tmp_path) -> None:
    demo = build_demo(FakeEngine(), "en")
    assert demo.delete_cache == FILES_KEPT and FILES_KEPT[1] >= 3600  # hours: a visitor's tab may idle
    with TestClient(gr.mount_gradio_app(FastAPI(), demo, path="/")):
        cached = served_take(demo, tmp_path)
        assert cached.exists()
    assert not cached.exists()  # the server stopped: Gradio's copies go with it
