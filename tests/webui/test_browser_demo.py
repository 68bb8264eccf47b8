"""The real thing in headless Chromium: ``python app.py --model demo-tiny`` (a tiny random-weight model
built offline, the native engine on CPU) on 127.0.0.1. Upload a generated prompt, Generate with streaming:
audio arrives and plays, the metrics show numbers; Stop aborts mid-stream (the engine's active streams
return to 0); a missing prompt shows its error. Writes ``test-output/webui-demo-tiny.png`` and
``test-output/webui-demo-latency.json`` (click -> first sound vs the server's time to first audio).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import WAIT_S
from tests.webui.support import (
    OUT,
    REPO,
    TRANSCRIBED,
    WAIT_MS,
    fill_request,
    free_port,
    metric,
    player,
)

pytestmark = pytest.mark.browser
LONG_TEXT = " ".join(f"This is sentence number {i} of a long demo text." for i in range(1, 40))


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=WAIT_S) as r:
        return r.read().decode()


def active_streams(base: str) -> float:
    line = next(x for x in get(base + "metrics").splitlines() if x.startswith("cosystream_active_streams "))
    return float(line.split()[1])


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Iterator[str]:
    home = tmp_path_factory.mktemp("home")  # the demo model and voices are built under $HOME/.cache
    port = free_port()
    cmd = [
        sys.executable,
        "app.py",
        "--model",
        "demo-tiny",
        "--device",
        "cpu",
        "--backend",
        "native",
        "--port",
        str(port),
        "--ui-lang",
        "en",
    ]
    log = (home / "app.log").open("w")
    proc = subprocess.Popen(cmd, cwd=REPO, env=os.environ | {"HOME": str(home)}, stdout=log, stderr=log)
    base = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + 360  # the demo builds its model and a tiny Whisper first; CI may be busy
    while True:
        assert proc.poll() is None, (home / "app.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "app.py --model demo-tiny did not become ready"
        try:
            # ready, and the studio UI mounted: it is built after the server answers ("/" says 503 till then)
            if json.loads(get(base + "ready")).get("status") == "ready" and get(base):
                break
        except OSError:
            pass
        time.sleep(0.5)
    yield base
    proc.terminate()
    proc.wait(20)


@pytest.fixture
def page(browser, demo) -> Iterator[Any]:
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(WAIT_MS)  # every wait, click and fill: a ceiling, not a schedule
    page.goto(demo)
    page.wait_for_function("window.cosyPlayer && document.getElementById('cosy-live')", timeout=WAIT_MS)
    yield page
    page.close()


@pytest.fixture(scope="module")
def prompt_wav(tmp_path_factory) -> str:
    from tests.sounds import write_wav

    return str(write_wav(tmp_path_factory.mktemp("demo") / "prompt.wav", seconds=4.0))


def test_demo_banner_and_missing_prompt_error(page) -> None:
    page.get_by_text("RANDOM weights").first.wait_for(timeout=WAIT_MS)
    fill_request(page, None)
    page.locator("#cosy-generate").click()
    page.get_by_text("A prompt voice is needed").first.wait_for(timeout=WAIT_MS)


def test_demo_upload_is_transcribed_by_the_tiny_whisper(page, prompt_wav) -> None:
    """The real ASR path: a random-weight Whisper fills the transcript with noise, and the note says so."""
    page.locator("#cosy-prompt input[type=file]").set_input_files(prompt_wav)
    page.get_by_text("RANDOM-weight Whisper").first.wait_for(timeout=WAIT_MS)
    assert page.locator("#cosy-transcript textarea").input_value().strip()


def test_demo_streams_plays_and_shows_metrics(page, prompt_wav) -> None:
    fill_request(page, prompt_wav, "Hello there. This is the real engine speaking, streaming as it goes.")
    page.locator("#cosy-generate").click()
    page.wait_for_function("window.cosyPlayer.stats.playedS > 0.2", timeout=WAIT_MS)
    page.locator('.cosy-status[data-state="done"]').wait_for(timeout=WAIT_MS)
    live = player(page)
    assert live["sampleRate"] == 24000 and live["samples"] > 24000 // 2
    server_ttfa = metric(page, "ttfa_server")
    assert server_ttfa > 0 and metric(page, "rtf") > 0 and metric(page, "lm_tokens") > 0
    assert metric(page, "audio_s") == pytest.approx(live["samples"] / 24000, abs=0.05)
    OUT.mkdir(exist_ok=True)
    page.screenshot(path=str(OUT / "webui-demo-tiny.png"), full_page=True)
    numbers = {"server_ttfa_ms": server_ttfa, "click_to_first_sound_ms": round(live["firstSoundMs"], 1)}
    numbers["browser_overhead_ms"] = round(live["firstSoundMs"] - server_ttfa, 1)
    (OUT / "webui-demo-latency.json").write_text(json.dumps(numbers, indent=2))
    print(
        f"\ndemo-tiny: server TTFA {server_ttfa:.0f} ms; click -> first sound {live['firstSoundMs']:.0f} ms"
    )


@pytest.mark.parametrize("seconds", [2.0, 8.0])
def test_demo_voice_conversion_with_an_example_voice(page, tmp_path, seconds) -> None:
    """A visitor's walk on the real engine: an example voice, then Voice conversion, a source, Generate. The
    whole source comes back converted (the frame reuse once failed at a chunk seam here, after 0.5 s)."""
    from tests.sounds import write_wav

    page.locator("#cosy-examples").get_by_text("en-amy", exact=True).click()
    page.wait_for_function(TRANSCRIBED, timeout=WAIT_MS)
    page.locator('#cosy-mode input[value="vc"]').check()
    source = write_wav(tmp_path / "source.wav", seconds=seconds)
    page.locator("#cosy-source input[type=file]").set_input_files(str(source))
    page.locator("#cosy-generate").click()
    page.locator('.cosy-status[data-state="done"]').wait_for(timeout=WAIT_MS)
    samples = player(page)["samples"]
    assert metric(page, "audio_s") == pytest.approx(samples / 24000, abs=0.05)
    assert samples / 24000 == pytest.approx(seconds, rel=0.2)  # the source's length, converted


def test_demo_stop_aborts_the_engine_request(page, demo, prompt_wav) -> None:
    fill_request(page, prompt_wav, LONG_TEXT)
    page.locator("#cosy-generate").click()
    page.wait_for_function("window.cosyPlayer.stats.samples > 0", timeout=WAIT_MS)
    page.locator("#cosy-stop").click()
    page.locator('.cosy-status[data-state="stopped"]').wait_for(timeout=WAIT_MS)
    deadline = time.monotonic() + WAIT_S
    while active_streams(demo) != 0:
        assert time.monotonic() < deadline, "the engine kept computing after Stop"
        time.sleep(0.2)
    samples = player(page)["samples"]
    time.sleep(0.5)
    assert player(page)["samples"] == samples  # nothing more arrives
