"""``/v1/audio/lexicons`` and the speech request's ``lexicon`` field: CRUD, bad entries, owner isolation,
and (on demo-tiny) the speech LM's input ids carrying the hint's tokens."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from api.app import build_api
from engine.config import EngineConfig, Limits
from engine.demo.make_model import build_model_dir
from engine.lexicons import LexiconLibrary
from engine.serving.engine import TTSEngine
from tests.api.support import RecordingEngine, assert_openai_error, b64, client_for, wav_bytes
from tests.sounds import write_wav

KEYS = ("key-alice", "key-bob")
BRANDS = {
    "name": "Brands",
    "entries": [{"word": "Nike", "hint": "N AY1 K IY0"}, {"word": "给", "hint": "ji3"}],
}


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def recording(tmp_path) -> RecordingEngine:
    engine = RecordingEngine(n_chunks=2, chunk_s=0.1, delay_s=0.0)
    engine.lexicons = LexiconLibrary(tmp_path, engine.family)  # type: ignore[attr-defined]
    return engine


@pytest.fixture
async def api(recording) -> AsyncIterator[httpx.AsyncClient]:
    async with client_for(build_api(recording, Limits(), api_key=list(KEYS))) as c:
        yield c


async def test_create_list_get_replace_delete(api):
    made = await api.post("/v1/audio/lexicons", json=BRANDS, headers=auth(KEYS[0]))
    assert made.status_code == 201, made.text
    body = made.json()
    assert body["id"] == "brands" and body["public"] is False
    assert [e["say"] for e in body["entries"]] == ["[N][AY1][K][IY0]", "[j][ǐ]"]
    listed = (await api.get("/v1/audio/lexicons", headers=auth(KEYS[0]))).json()["data"]
    assert [(x["id"], x["entries"]) for x in listed] == [("brands", 2)]
    again = await api.post("/v1/audio/lexicons", json=BRANDS, headers=auth(KEYS[0]))
    assert_openai_error(again, 409, "name")
    new = {"entries": [{"word": "Qwen", "hint": "chwen", "kind": "respell"}]}
    put = await api.put("/v1/audio/lexicons/brands", json=new, headers=auth(KEYS[0]))
    assert put.status_code == 200 and put.json()["name"] == "Brands"
    got = (await api.get("/v1/audio/lexicons/Brands", headers=auth(KEYS[0]))).json()
    assert [e["word"] for e in got["entries"]] == ["Qwen"]
    gone = await api.delete("/v1/audio/lexicons/brands", headers=auth(KEYS[0]))
    assert gone.json() == {"object": "audio.lexicon.deleted", "id": "brands", "deleted": True}
    assert (await api.get("/v1/audio/lexicons", headers=auth(KEYS[0]))).json()["data"] == []


async def test_another_key_never_sees_nor_uses_nor_deletes_it(api, recording):
    assert (await api.post("/v1/audio/lexicons", json=BRANDS, headers=auth(KEYS[0]))).status_code == 201
    bob = auth(KEYS[1])
    assert (await api.get("/v1/audio/lexicons", headers=bob)).json()["data"] == []
    assert_openai_error(await api.get("/v1/audio/lexicons/brands", headers=bob), 404, "lexicon")
    assert_openai_error(await api.delete("/v1/audio/lexicons/brands", headers=bob), 404, "lexicon")
    put = await api.put("/v1/audio/lexicons/brands", json={"entries": []}, headers=bob)
    assert_openai_error(put, 404, "lexicon")
    speech = {"input": "Nike", "voice": "alloy", "lexicon": "Brands", "response_format": "wav"}
    assert_openai_error(await api.post("/v1/audio/speech", json=speech, headers=bob), 404, "lexicon")
    assert recording.requests == []  # nothing reached the engine
    assert (await api.get("/v1/audio/lexicons/brands", headers=auth(KEYS[0]))).status_code == 200
    assert_openai_error(await api.get("/v1/audio/lexicons"), 401)


@pytest.mark.parametrize(
    ("entry", "named"),
    [
        ({"word": "Nike", "hint": "N AY9 K IY0"}, "AY9"),
        ({"word": "给", "hint": "gx3"}, "gx3"),
        ({"word": "给", "hint": "[j][ǐ][zz]"}, "[zz]"),
        ({"word": "", "hint": "ji3"}, "word"),
        ({"word": "Nike", "hint": "N AY1", "kind": "ipa"}, "ipa"),
    ],
)
async def test_a_bad_entry_is_a_422_naming_it_and_nothing_is_stored(api, entry, named):
    bad = await api.post(
        "/v1/audio/lexicons", json={"name": "Bad", "entries": [entry]}, headers=auth(KEYS[0])
    )
    error = assert_openai_error(bad, 422)
    assert named in error["message"]
    assert (await api.get("/v1/audio/lexicons", headers=auth(KEYS[0]))).json()["data"] == []


async def test_the_speech_field_applies_the_lexicon_and_says_where(api, recording):
    await api.post("/v1/audio/lexicons", json=BRANDS, headers=auth(KEYS[0]))
    voice = {"ref_audio": b64(wav_bytes()), "ref_text": "A prompt."}
    speech = {"input": "nike 给予 NIKE.", "lexicon": "brands", "response_format": "wav", **voice}
    r = await api.post("/v1/audio/speech", json=speech, headers=auth(KEYS[0]))
    assert r.status_code == 200, r.text
    assert recording.requests[-1].text == "[N][AY1][K][IY0] [j][ǐ]予 [N][AY1][K][IY0]."
    assert json.loads(r.headers["X-Lexicon-Applied"]) == {"Nike": 2, "给": 1}
    plain = await api.post("/v1/audio/speech", json=speech | {"lexicon": None}, headers=auth(KEYS[0]))
    assert "X-Lexicon-Applied" not in plain.headers and recording.requests[-1].text == speech["input"]
    dry = await api.post(
        "/v1/audio/lexicons/apply", json={"input": "Nike!", "lexicon": "Brands"}, headers=auth(KEYS[0])
    )
    assert dry.json()["hits"] == [
        {"word": "Nike", "matched": "Nike", "say": "[N][AY1][K][IY0]", "start": 0, "end": 4}
    ]


async def test_a_script_applies_the_lexicon_to_spoken_lines_not_to_speaker_names(api, recording, tmp_path):
    await api.post(
        "/v1/audio/lexicons",
        json=BRANDS | {"entries": [{"word": "Alice", "hint": "AE1 L IH0 S"}]},
        headers=auth(KEYS[0]),
    )
    wav = tmp_path / "v.wav"
    wav.write_bytes(wav_bytes(3.0))
    voice = recording.add_voice("Amy", str(wav), "A prompt.", None).id
    script = {
        "script": "Alice: Hello, Alice.\nBob: Hi.",
        "voices": {"Alice": voice, "Bob": voice},
        "lexicon": "Brands",
    }
    r = await api.post("/v1/audio/script", json=script, headers=auth(KEYS[0]))
    assert r.status_code == 200, r.text
    assert [q.text for q in recording.requests] == ["Hello, [AE1][L][IH0][S].", "Hi."]
    assert json.loads(r.headers["X-Lexicon-Applied"]) == {"Alice": 1}
    missing = await api.post("/v1/audio/script", json=script | {"lexicon": "nope"}, headers=auth(KEYS[0]))
    assert_openai_error(missing, 404, "lexicon")


@pytest.fixture(scope="module")
def tiny_v3(tmp_path_factory):
    root = tmp_path_factory.mktemp("lex")
    model = build_model_dir(root / "m", "cosyvoice3", "tiny")
    engine = TTSEngine.load(
        EngineConfig(model=str(model), device="cpu", backend="native", voices_dir=str(root / "v"))
    )
    yield engine, str(write_wav(root / "p.wav"))
    engine.close()


async def test_the_lm_input_ids_carry_the_hint_tokens(tiny_v3, monkeypatch):
    """On demo-tiny: the text ids the speech LM reads hold [N][AY1][K][IY0] and [j][ǐ], one id each."""
    engine, prompt = tiny_v3
    seen: list[list[int]] = []
    assemble = engine.planner.assemble

    def spy(req, features, ids):
        plan = assemble(req, features, ids)
        seen.extend(seg for seg, _, _ in plan.segments)
        return plan

    monkeypatch.setattr(engine.planner, "assemble", spy)
    engine.lexicons.save("Brands", BRANDS["entries"], "api:anonymous")
    engine.ready = True  # as warmup() sets it; its one synthesis is not needed here
    async with client_for(build_api(engine, Limits(forced_tokens=True), api_key="")) as c:
        ref = b64(Path(prompt).read_bytes())
        body = {
            "input": "I like Nike. 报道给予好评。",
            "ref_audio": ref,
            "ref_text": "A prompt.",
            "lexicon": "Brands",
        }
        r = await c.post("/v1/audio/speech", json=body | {"seed": 3, "forced_tokens": 5})
        assert r.status_code == 200, r.text
    ids = [i for seg in seen for i in seg]
    tok = engine.text.tokenizer
    nike = [tok.token_id(t) for t in ("[N]", "[AY1]", "[K]", "[IY0]")]
    gei = [tok.token_id(t) for t in ("[j]", "[ǐ]")]
    joined = ",".join(map(str, ids))
    assert ",".join(map(str, nike)) in joined and ",".join(map(str, gei)) in joined


class PieceEngine(RecordingEngine):
    """Reads a streamed request's text pieces (what the speech LM's input grows by), then speaks."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.pieces: list[str] = []

    async def stream(self, req):
        if req.text_stream is not None:
            self.pieces += [p async for p in req.text_stream]
            req = replace(req, text="".join(self.pieces), text_stream=None)
        async for chunk in super().stream(req):
            yield chunk


def test_the_realtime_socket_applies_the_lexicon_across_pieces(tmp_path):
    from fastapi.testclient import TestClient

    engine = PieceEngine(n_chunks=1, chunk_s=0.1, delay_s=0.0)
    engine.lexicons = LexiconLibrary(tmp_path, engine.family)  # type: ignore[attr-defined]
    engine.lexicons.save("Brands", BRANDS["entries"], "api:anonymous")
    voice = {"ref_audio": b64(wav_bytes()), "mode": "cross_lingual"}
    with TestClient(build_api(engine, Limits(), api_key="")) as client:
        with client.websocket_connect("/v1/audio/speech/realtime") as ws:
            ws.send_json({"type": "session.update", "session": voice | {"lexicon": "nope"}})
            assert ws.receive_json()["error"]["param"] == "lexicon"
        with client.websocket_connect("/v1/audio/speech/realtime") as ws:
            ws.send_json({"type": "session.update", "session": voice | {"lexicon": "Brands"}})
            assert ws.receive_json()["type"] == "session.updated"
            for piece in ["I wear Ni", "ke, ", "报道给", "予好评"]:
                ws.send_json({"type": "input_text_buffer.append", "text": piece})
            ws.send_json({"type": "input_text_buffer.commit"})
            while ws.receive_json()["type"] != "response.done":
                pass
    assert "".join(engine.pieces) == "I wear [N][AY1][K][IY0], 报道[j][ǐ]予好评"


async def test_an_engine_without_lexicons_answers_501(client):
    """A remote engine (the Ray Serve ingress) has no lexicon store: a clear 501, the server keeps serving."""
    error = assert_openai_error(await client.get("/v1/audio/lexicons"), 501)
    assert error["code"] == "no_lexicons"
    speech = {"input": "Nike", "ref_audio": b64(wav_bytes()), "ref_text": "A prompt.", "lexicon": "Brands"}
    assert_openai_error(await client.post("/v1/audio/speech", json=speech), 501, "lexicon")
    assert (await client.post("/v1/audio/speech", json=speech | {"lexicon": None})).status_code == 200
