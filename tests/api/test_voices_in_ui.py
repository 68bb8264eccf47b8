"""A voice saved through the API shows in the studio's saved-voice list and speaks (one engine, real
tiny model): the API and the UI share the engine's voice library."""

from __future__ import annotations

import io

import soundfile as sf

from api.app import build_api
from bench.make_model import build_model_dir
from engine.config import Limits
from tests.api.support import client_for
from tests.reliability.support import load_engine
from tests.sounds import speech_like
from webui.handlers import Studio
from webui.stream_route import AudioStore, StreamHub
from webui.texts import Texts


async def test_api_voice_is_listed_and_usable_in_the_ui(tmp_path):
    engine = load_engine(build_model_dir(tmp_path / "m", "cosyvoice3", "tiny"), tmp_path / "voices")
    try:
        buf = io.BytesIO()
        sf.write(buf, speech_like(3.0, 24000), 24000, format="WAV")
        files = {"audio_sample": ("me.wav", buf.getvalue(), "audio/wav")}
        async with client_for(build_api(engine, Limits(), api_key="")) as client:
            r = await client.post(
                "/v1/audio/voices", data={"name": "Bob", "ref_text": "Hi there."}, files=files
            )
        assert r.status_code == 201, r.text
        voice_id = r.json()["voice"]["id"]
        studio = Studio(engine, Limits(), Texts("en"), StreamHub(), AudioStore())
        choices = await studio.voice_choices()
        assert voice_id in [value for _, value in choices]
        from engine.request import SynthesisRequest

        req = SynthesisRequest(text="Hello.", voice_id=voice_id, seed=1, forced_tokens=30)
        audio = [c.pcm async for c in engine.stream(req)]
        assert sum(a.size for a in audio) == 30 * 960
    finally:
        engine.close()
