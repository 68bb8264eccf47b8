"""Fixtures of the reliability suite: one tiny v3 model directory for the session, one real engine per
module (native backend, CPU), a good prompt and a directory of bad audio files."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.demo.make_model import build_model_dir
from engine.serving.engine import TTSEngine
from tests.reliability.support import PROMPT_S, load_engine
from tests.sounds import write_wav


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("reliability") / "model", "cosyvoice3", "tiny")


@pytest.fixture(scope="module")
def engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TTSEngine]:
    eng = load_engine(model_dir, tmp_path_factory.mktemp("voices"))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def prompt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """1.5 s: over the engine's 1 s floor, and short, as the flow's cost grows with the prompt."""
    return write_wav(tmp_path_factory.mktemp("prompt") / "prompt.wav", PROMPT_S)


@pytest.fixture(scope="module")
def ui_prompt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 s: the UI asks for at least 3 s of speech."""
    return write_wav(tmp_path_factory.mktemp("prompt") / "ui_prompt.wav", 3.0)


@pytest.fixture(scope="module")
def bad_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("bad_audio")
