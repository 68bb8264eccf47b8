"""Request -> plan: the LM prefix layout of each mode (spec section 4) and the flow's prompt."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.demo.make_model import build_model_dir
from engine.request import Mode, SynthesisRequest
from engine.serving.engine import TTSEngine
from engine.text.frontend import END_OF_PROMPT_ID
from tests.sounds import write_wav


@pytest.fixture(scope="module", params=["cosyvoice2", "cosyvoice3"])
def setup(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    engine = TTSEngine.load(
        EngineConfig(
            model=str(build_model_dir(root / "m", request.param, "tiny")),
            device="cpu",
            backend="native",
            voices_dir=str(root / "v"),
        )
    )
    yield engine, str(write_wav(root / "p.wav")), str(write_wav(root / "s.wav", 2.0, 16000, seed=2))
    engine.close()


def plan(setup, **kw):
    engine, prompt, _ = setup
    return engine.planner.plan(SynthesisRequest(**({"text": "Hello there.", "prompt_wav": prompt} | kw)))


def test_zero_shot_prefix_has_transcript_and_prompt_speech(setup):
    p = plan(setup, prompt_text="A transcript.")
    ((text, prompt_ids, speech),) = p.segments
    assert text and prompt_ids and speech == [int(t) for t in p.flow_prompt.speech_tokens]
    assert p.flow_prompt.trimmed and len(p.flow_prompt.prompt_mel) == 2 * len(speech)  # the 2:1 trim
    v3 = setup[0].family == "cosyvoice3"
    assert (END_OF_PROMPT_ID in prompt_ids) == v3  # v3's system prompt is added for the user


def test_cross_lingual_has_no_prompt_parts(setup):
    ((text, prompt_ids, speech),) = plan(setup, mode=Mode.CROSS_LINGUAL).segments
    assert prompt_ids == [] and speech == []
    assert (END_OF_PROMPT_ID in text) == (setup[0].family == "cosyvoice3")


def test_instruct_puts_the_instruction_first_and_no_prompt_speech(setup):
    ((_, prompt_ids, speech),) = plan(setup, mode=Mode.INSTRUCT, instruct_text="Speak happily.").segments
    assert prompt_ids[-1] == END_OF_PROMPT_ID and speech == []


def test_vc_sends_source_tokens_to_the_flow_with_an_untrimmed_prompt(setup):
    p = plan(setup, mode=Mode.VC, text="", source_wav=setup[2])
    assert p.segments == [] and len(p.source_tokens) == 50  # 2 s at 25 tokens/s
    assert not p.flow_prompt.trimmed
