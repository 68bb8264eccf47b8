"""engine/asr.py: Whisper transcription on the tiny random-weight Whisper (engine/demo/tiny_whisper.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine import asr
from engine.demo.tiny_whisper import build_whisper_dir
from engine.errors import InvalidInput, ModelError

VOICES = Path(__file__).resolve().parents[2] / "assets" / "voices"


@pytest.fixture(scope="module")
def transcriber(tmp_path_factory: pytest.TempPathFactory) -> asr.Transcriber:
    folder = build_whisper_dir(tmp_path_factory.mktemp("whisper"))
    return asr.Transcriber.load(str(folder), torch.device("cpu"))


def test_model_choice():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert asr.model_choice("none", cpu) is None
    assert asr.model_choice("auto", cpu) == asr.CPU_DEFAULT
    assert asr.model_choice("auto", gpu) == asr.GPU_DEFAULT
    assert asr.model_choice("/models/whisper", gpu) == "/models/whisper"


def test_tiny_whisper_knows_the_needed_languages(transcriber):
    assert {"zh", "en", "ja", "ko", "yue"} <= set(transcriber.languages)


def test_transcribes_a_file_with_a_given_language(transcriber):
    result = transcriber.transcribe(str(VOICES / "zh-lan.wav"), "zh")
    assert result.language == "zh" and result.duration_s == pytest.approx(7.95, abs=0.01)
    assert result.text  # random weights: noise, but the decode path produced text


def test_detects_a_language_when_none_is_given(transcriber):
    samples = (0.1 * np.random.default_rng(0).standard_normal(3 * 16000)).astype(np.float32)
    result = transcriber.transcribe((samples, 16000), "auto")
    assert result.language in transcriber.languages and result.duration_s == pytest.approx(3.0)


def test_refuses_an_unknown_language_and_overlong_audio(transcriber):
    with pytest.raises(InvalidInput, match="xx"):
        transcriber.transcribe(str(VOICES / "en-amy.wav"), "xx")
    with pytest.raises(InvalidInput):
        transcriber.transcribe((np.zeros(31 * 16000, np.float32), 16000))


def test_a_missing_model_is_a_clear_model_error(tmp_path):
    with pytest.raises(ModelError, match="--asr-model none"):
        asr.Transcriber.load(str(tmp_path / "nothing-here"), torch.device("cpu"))


def test_word_times_need_alignment_heads(transcriber):
    # the tiny Whisper has none (the released ones do): no word times, and subtitles fall back to spreading
    assert not getattr(transcriber.model.generation_config, "alignment_heads", None)
    assert transcriber.words(np.full(24000, 0.1, np.float32), 24000, "en") == []


def test_takes_telephone_rates_and_short_clips_with_whisper_figures(transcriber):
    """Transcription's limits, not a voice prompt's: 8 kHz and a 0.3 s clip are fine; the result carries
    Whisper's per-segment figures."""
    t = np.arange(int(0.3 * 8000)) / 8000
    clip = (0.2 * np.sin(2 * np.pi * 300 * t)).astype(np.float32)
    result = transcriber.transcribe((clip, 8000), "en")
    assert result.duration_s == pytest.approx(0.3) and result.language == "en"
    assert (
        len(result.tokens) > 3
        and result.tokens[0] == transcriber.model.generation_config.decoder_start_token_id
    )
    assert result.avg_logprob < 0.0 and 0.0 < result.no_speech_prob < 1.0
    with pytest.raises(InvalidInput, match="at least 4000 Hz"):
        transcriber.transcribe((clip, 2000), "en")
