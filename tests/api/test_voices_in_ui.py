"""Voice privacy across the API and the studio on one engine (real tiny model): a voice saved through the
API is its caller's alone (the studio's browsers do not list it, the caller speaks with it), and a stock
OpenAI voice name speaks with an example voice from assets/."""

from __future__ import annotations

import io

import soundfile as sf

from api.app import build_api
from api.auth import owner_of
from engine.config import Limits
from engine.demo.make_model import build_model_dir
from engine.request import SynthesisRequest
from tests.api.support import client_for
from tests.reliability.support import load_engine
from tests.sounds import speech_like
from webui.handlers import Studio
from webui.stream_route import AudioStore, StreamHub
from webui.texts import Texts


async def test_api_voice_is_private_and_openai_names_speak(tmp_path):
    engine = load_engine(build_model_dir(tmp_path / "m", "cosyvoice3", "tiny"), tmp_path / "voices")
    try:
        buf = io.BytesIO()
        sf.write(buf, speech_like(3.0, 24000), 24000, format="WAV")
        files = {"audio_sample": ("me.wav", buf.getvalue(), "audio/wav")}
        async with client_for(build_api(engine, Limits(), api_key="k1")) as client:
            r = await client.post(
                "/v1/audio/voices", data={"name": "Bob", "ref_text": "Hi there."}, files=files,
                headers={"Authorization": "Bearer k1"},
            )  # fmt: skip
        assert r.status_code == 201, r.text
        voice_id = r.json()["id"]
        studio = Studio(engine, Limits(), Texts("en"), StreamHub(), AudioStore())
        assert voice_id not in [value for _, value in await studio.voice_choices("b" * 32)]
        for owner, voice in ((owner_of("k1"), voice_id), (None, "alloy")):
            req = SynthesisRequest(text="Hello.", voice_id=voice, voice_owner=owner, seed=1, forced_tokens=30)
            audio = [c.pcm async for c in engine.stream(req)]
            assert sum(a.size for a in audio) == 30 * 960
    finally:
        engine.close()
