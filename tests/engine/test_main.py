"""The engine CLI: synth writes a wav and prints metrics; voices add/list/rm; bad input -> exit 2."""

from __future__ import annotations

import json

import pytest
import soundfile as sf

from engine.__main__ import main
from engine.demo.make_model import build_model_dir
from tests.sounds import write_wav


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(build_model_dir(tmp_path_factory.mktemp("m"), "cosyvoice3", "tiny"))


def test_synth_writes_a_wav_and_prints_metrics(model, tmp_path, capsys):
    prompt = write_wav(tmp_path / "p.wav")
    out = tmp_path / "out.wav"
    args = [
        "synth",
        "--model",
        model,
        "--device",
        "cpu",
        "--text",
        "Hello world.",
        "--prompt-wav",
        str(prompt),
        "--prompt-text",
        "A transcript.",
        "--seed",
        "3",
        "--stream",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    audio, sr = sf.read(out)
    metrics = json.loads(capsys.readouterr().out)
    assert sr == 24000 and audio.size > 0
    assert metrics["audio_s"] == pytest.approx(audio.size / 24000, abs=1e-3) and metrics["seed"] == 3


def test_voices_add_list_rm(model, tmp_path, capsys):
    prompt = write_wav(tmp_path / "p.wav")
    common = ["--model", model, "--device", "cpu", "--voices-dir", str(tmp_path / "v")]
    assert (
        main(
            ["voices", "add", *common, "--name", "Alice", "--prompt-wav", str(prompt), "--prompt-text", "Hi."]
        )
        == 0
    )
    assert main(["voices", "list", *common]) == 0
    assert "alice\tAlice" in capsys.readouterr().out
    assert main(["voices", "rm", *common, "alice"]) == 0
    assert main(["voices", "rm", *common, "alice"]) == 2
    assert "no saved voice" in capsys.readouterr().err.lower()


def test_bad_input_is_a_clear_error(model, tmp_path, capsys):
    args = [
        "synth",
        "--model",
        model,
        "--device",
        "cpu",
        "--text",
        "",
        "--prompt-wav",
        "x.wav",
        "--out",
        str(tmp_path / "o.wav"),
    ]
    assert main(args) == 2
    assert "empty" in capsys.readouterr().err


def test_public_voice_transcribed_by_the_asr(model, tmp_path, capsys):
    """``voices add --public`` without a transcript: Whisper (tiny, random) writes one; only --public rm
    removes a public voice."""
    from engine.demo.tiny_whisper import build_whisper_dir

    whisper = str(build_whisper_dir(tmp_path / "whisper"))
    prompt = write_wav(tmp_path / "p.wav")
    common = ["--model", model, "--device", "cpu", "--voices-dir", str(tmp_path / "v")]
    add = ["voices", "add", *common, "--name", "Pub", "--prompt-wav", str(prompt), "--asr-model", whisper]
    assert main([*add, "--public"]) == 0
    assert "saved pub" in (out := capsys.readouterr().out) and "public" in out
    assert main(["voices", "list", *common]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("pub\t"))
    assert line.split("\t")[2] == "public" and line.split("\t")[-1].strip()  # a (noise) transcript
    assert main(["voices", "rm", *common, "pub"]) == 2
    assert "public" in capsys.readouterr().err
    assert main(["voices", "rm", *common, "pub", "--public"]) == 0
