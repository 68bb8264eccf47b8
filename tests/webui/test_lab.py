"""The prompt lab's logic and routes (a fake engine): code for a take, batch files, the routes' owner."""

from __future__ import annotations

import io
import json
import zipfile
from collections.abc import AsyncIterator

import httpx
import pytest
import soundfile as sf

from engine.lexicons import LexiconLibrary
from server import web
from tests.api.support import RecordingEngine
from webui.lab import BatchError, TakeSettings, code_for, parse_batch
from webui.lab_texts import TABLES
from webui.lab_views import STATIC, page_html
from webui.player import head_html

ALICE, BOB = "a" * 32, "b" * 32


def as_browser(browser_id: str) -> dict[str, str]:
    return {"X-Cosy-Browser": browser_id}


@pytest.fixture
def engine(tmp_path) -> RecordingEngine:
    engine = RecordingEngine(n_chunks=2, chunk_s=0.1, delay_s=0.0)
    engine.lexicons = LexiconLibrary(tmp_path, engine.family)  # type: ignore[attr-defined]
    engine.add_voice("Amy", "amy.wav", "A public voice.", None)
    return engine


@pytest.fixture
async def lab(engine) -> AsyncIterator[httpx.AsyncClient]:
    app = web.create_app(engine, ui_lang="en", studio_later=True)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://lab.test") as c:
        yield c


def test_the_python_code_is_the_api_body_with_our_fields_in_extra_body_and_no_key():
    s = TakeSettings('Nike 给予 it\'s "x"', "amy", "instruct", "speak happily", 42, 1.25, "auto", "brands")
    code = code_for(s, "http://host:7860/", "Fun-CosyVoice3", private_voice=True)
    scope: dict = {}
    body = s.body("Fun-CosyVoice3")
    exec(code.python.split("client = ")[0], scope)  # the imports run; the call needs a server
    assert 'base_url="http://host:7860/v1"' in code.python and "COSYSTREAM_API_KEY" in code.python
    assert (
        '"seed": 42' in code.python and '"lexicon": "brands"' in code.python and "speed=1.25" in code.python
    )
    assert json.dumps(body["input"], ensure_ascii=False) in code.python
    assert "http://host:7860/v1/audio/speech" in code.curl and "$COSYSTREAM_API_KEY" in code.curl
    assert "ws://host:7860/v1/audio/speech/realtime" in code.realtime
    compile(code.python, "take.py", "exec")
    compile(code.realtime, "realtime.py", "exec")
    assert code.notes == ["private_voice"]
    assert body["stream"] is False and body["instructions"] == "speak happily"


def test_batch_files_txt_and_csv_with_a_bad_line():
    lines = parse_batch("a.txt", b"one\n\n" + b"x" * 50 + b"\nthree\n", 40)
    assert [(x.number, x.error != "") for x in lines] == [(1, False), (3, True), (4, False)]
    assert "50 characters" in lines[1].error
    rows = parse_batch("a.csv", b"text,voice,instruct\nHello,amy,\n,amy,\nHi,,speak slowly\n", 40)
    assert [(x.number, x.text, x.voice, x.instruct, bool(x.error)) for x in rows] == [
        (2, "Hello", "amy", "", False), (3, "", "amy", "", True), (4, "Hi", "", "speak slowly", False)
    ]  # fmt: skip
    with pytest.raises(BatchError, match="'text' column"):
        parse_batch("a.csv", b"words\nhello\n", 40)
    with pytest.raises(BatchError, match="at most 3"):
        parse_batch("a.txt", b"a\nb\nc\nd\n", 40, max_lines=3)
    with pytest.raises(BatchError, match="UTF-8"):
        parse_batch("a.txt", b"\xff\xfe\x00bad", 40)


def test_every_label_exists_in_both_languages_and_the_page_renders_them():
    assert set(TABLES["en"]) == set(TABLES["zh"])
    for lang in ("en", "zh"):
        page = page_html(lang)
        assert TABLES[lang]["generate"] in page and "{{" not in page


def test_the_lab_and_the_studio_load_the_one_script_that_draws_the_browser_id():
    """Both pages of one browser must name the same owner: the id's key and its drawing live in
    ``static/browser_id.js`` alone, which the lab's page and the studio's head both carry, before the
    scripts that read it."""
    drawer = (STATIC / "browser_id.js").read_text(encoding="utf-8")
    sources = [*STATIC.iterdir(), *STATIC.parent.glob("*.py")]
    naming = [p.name for p in sources if "cosystream-browser-id" in p.read_text(errors="replace")]
    assert naming == ["browser_id.js"] and "window.cosyBrowserId = " in drawer
    lab, head = page_html("en"), head_html()
    assert lab.index(drawer) < lab.index("window.cosyBrowserId()")
    assert head.index(drawer) < head.index("window.cosyKeep =")


async def test_the_page_config_and_a_take(lab):
    assert "Prompt lab" in (await lab.get("/lab?lang=en")).text
    assert "提示词实验室" in (await lab.get("/lab", headers={"Accept-Language": "zh-CN,zh"})).text
    assert (await lab.get("/lab/config")).status_code == 400  # no browser id
    cfg = (await lab.get("/lab/config", headers=as_browser(ALICE))).json()
    assert [v["id"] for v in cfg["voices"]] == ["amy"] and cfg["limits"]["max_takes"] == 8
    take = {"input": "Hello.", "voice": "amy", "seed": 7, "stream": False, "response_format": "wav"}
    r = await lab.post("/lab/speech", json=take, headers=as_browser(ALICE))
    assert r.status_code == 200 and r.headers["X-Seed"] == "7" and "X-RTF" in r.headers
    assert sf.info(io.BytesIO(r.content)).duration == pytest.approx(0.2)


async def test_lexicons_belong_to_the_browser(lab, engine):
    entries = [{"word": "Nike", "hint": "N AY1 K IY0"}]
    made = await lab.post(
        "/lab/lexicons", json={"name": "Mine", "entries": entries}, headers=as_browser(ALICE)
    )
    assert made.status_code == 201, made.text
    assert (await lab.get("/lab/lexicons", headers=as_browser(BOB))).json()["data"] == []
    assert (await lab.get("/lab/lexicons/mine", headers=as_browser(BOB))).status_code == 404
    take = {"input": "Nike.", "voice": "amy", "lexicon": "mine", "stream": False}
    assert (await lab.post("/lab/speech", json=take, headers=as_browser(BOB))).status_code == 404
    r = await lab.post("/lab/speech", json=take, headers=as_browser(ALICE))
    assert r.status_code == 200, r.text
    assert json.loads(r.headers["X-Lexicon-Applied"]) == {"Nike": 1}
    assert engine.requests[-1].text == "[N][AY1][K][IY0]."
    assert engine.requests[-1].voice_owner == "studio:" + ALICE


async def test_a_batch_renders_the_good_lines_reports_the_bad_one_and_zips_them(lab, engine):
    csv_file = (
        "text,voice,instruct\nFirst line.,,\nSecond.,nobody,\nThird.,,speak slowly\n" + "x" * 5000 + ",,\n"
    )
    settings = {"voice": "amy", "mode": "zero_shot", "seed": 5, "speed": 1.0, "language": "auto"}
    r = await lab.post(
        "/lab/batch", headers=as_browser(ALICE),
        files={"file": ("lines.csv", csv_file.encode())}, data={"settings": json.dumps(settings)},
    )  # fmt: skip
    assert r.status_code == 200, r.text
    events = [json.loads(line) for line in r.text.splitlines()]
    assert events[0] == {
        "type": "start",
        "total": 4,
        "errors": [{"line": 5, "error": events[0]["errors"][0]["error"]}],
    }
    lines = {e["line"]: e for e in events if e["type"] == "line"}
    assert lines[2]["file"] == "0002.wav" and not lines[2]["error"]
    assert "nobody" in lines[3]["error"] and lines[3]["file"] == ""
    assert lines[4]["mode"] == "instruct" and lines[4]["instructions"] == "speak slowly"
    assert "characters" in lines[5]["error"]
    done = events[-1]
    assert done["type"] == "done" and (done["rendered"], done["failed"]) == (2, 2)
    z = await lab.get(done["zip"])
    with zipfile.ZipFile(io.BytesIO(z.content)) as zf:
        assert sorted(zf.namelist()) == ["0002.wav", "0004.wav", "manifest.csv", "manifest.json"]
        manifest = json.loads(zf.read("manifest.json"))
        assert [m["line"] for m in manifest] == [2, 3, 4, 5] and manifest[0]["seed"] == 5
    # the engine refused the unknown voice; the over-long line never reached it
    assert [q.text for q in engine.requests] == ["First line.", "Second.", "Third."]


async def test_a_batch_past_the_limits_is_refused_whole(lab):
    many = "\n".join(f"line {i}" for i in range(500)).encode()
    r = await lab.post(
        "/lab/batch", headers=as_browser(ALICE), files={"file": ("a.txt", many)}, data={"settings": "{}"}
    )
    assert r.status_code == 413 and "at most 200" in r.json()["error"]["message"]
    bad = await lab.post(
        "/lab/batch",
        headers=as_browser(ALICE),
        files={"file": ("a.txt", b"hi")},
        data={"settings": '{"speed": 9}'},
    )
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "settings"


async def test_code_for_a_take_names_the_server_as_reached(lab):
    take = {"input": "Hi", "voice": "amy", "seed": 3, "speed": 1.0}
    code = (await lab.post("/lab/code", json=take, headers=as_browser(ALICE))).json()
    assert 'base_url="http://lab.test/v1"' in code["python"] and code["notes"] == []
    bad = await lab.post("/lab/code", json=take | {"secret": 1}, headers=as_browser(ALICE))
    assert bad.status_code == 422
    broken = await lab.post("/lab/code", content=b"{", headers=as_browser(ALICE))
    assert broken.status_code == 422 and broken.json()["error"]["code"] == "invalid_value"


def test_with_a_login_the_lab_needs_it_and_works_in_the_key_namespace(tmp_path):
    """As the studio's voices after signing in: the lab's lexicons are the key's, whichever browser id."""
    from fastapi.testclient import TestClient

    from api.auth import owner_of

    engine = RecordingEngine(n_chunks=1, chunk_s=0.1, delay_s=0.0)
    engine.lexicons = LexiconLibrary(tmp_path, engine.family)  # type: ignore[attr-defined]
    with TestClient(web.create_app(engine, ui_lang="en", api_key=["k1", "k2"])) as client:
        assert client.get("/lab/config", headers=as_browser(ALICE)).status_code == 401
        form = [("username", (None, "alice")), ("password", (None, "k1"))]
        assert client.post("/login", files=form).status_code == 200
        lexicon = {"name": "Keyed", "entries": [{"word": "Nike", "hint": "N AY1 K IY0"}]}
        assert client.post("/lab/lexicons", json=lexicon, headers=as_browser(BOB)).status_code == 201
    assert [x.name for x in engine.lexicons.list(owner_of("k1"))] == ["Keyed"]
    assert engine.lexicons.list("studio:" + BOB) == []


def test_leaving_a_batch_stops_its_rendering_and_keeps_no_zip(engine):
    """The client reads two lines' events and leaves: the server renders no more lines and keeps no zip."""
    import tempfile
    from pathlib import Path

    from tests.api.support import live_server, wait_until

    engine.delay_s = 0.05  # each line takes a moment, so most are still to come when the client leaves
    lines = "\n".join(f"Line {i}." for i in range(40)).encode()
    before = set(Path(tempfile.gettempdir()).glob("cosystream-lab-*"))
    app = web.create_app(engine, ui_lang="en", studio_later=True)
    with live_server(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        files, data = {"file": ("a.txt", lines)}, {"settings": json.dumps({"voice": "amy"})}
        with client.stream("POST", "/lab/batch", headers=as_browser(ALICE), files=files, data=data) as r:
            seen = 0
            for line in r.iter_lines():
                seen += json.loads(line)["type"] == "line"
                if seen == 2:
                    break
        (folder,) = set(Path(tempfile.gettempdir()).glob("cosystream-lab-*")) - before  # this app's batches
        assert wait_until(lambda: not engine.active and not list(folder.iterdir()))  # closed, no zip kept
        ran = len(engine.requests)
        assert ran < 10
        assert client.get("/lab/config", headers=as_browser(ALICE)).status_code == 200  # still serving
    assert len(engine.requests) == ran  # nothing started after the client left
