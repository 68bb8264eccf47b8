"""README.md stays true: every code block after a ``<!-- readme-test -->`` marker runs, as written, against
``--model demo-tiny`` served by ``server.web.create_app`` on a free port of 127.0.0.1 (the README's 7860
replaced).
Shell blocks run line by line with bash (each must exit 0), Python blocks with ``exec``; ``me.wav`` is a
generated recording in the working directory, as the README assumes."""

from __future__ import annotations

import io
import re
import shutil
import subprocess
import sys
import wave
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.config import EngineConfig
from server import cli, web
from tests.conftest import REPO
from tests.sounds import write_wav
from tests.webui.support import serving

MARKER = "<!-- readme-test -->"
README_PORT = "127.0.0.1:7860"


def marked_blocks(text: str) -> list[tuple[str, str]]:
    """(language, code) of each fenced block that follows a marker line."""
    pattern = re.escape(MARKER) + r"\s*\n```(\w+)\n(.*?)\n```"
    return [(m.group(1), m.group(2)) for m in re.finditer(pattern, text, re.S)]


def shell_commands(code: str) -> list[str]:
    """Lines joined at trailing backslashes; comments and blank lines dropped."""
    joined = re.sub(r"\s*\\\n\s*", " ", code)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.startswith("#")]


BLOCKS = marked_blocks((REPO / "README.md").read_text(encoding="utf-8"))


def test_the_readme_has_marked_blocks() -> None:
    kinds = [lang for lang, _ in BLOCKS]
    assert kinds.count("bash") >= 2 and "python" in kinds, kinds
    assert shell_commands("a \\\n  b\n# c\n\nd") == ["a b", "d"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The README's "Run it" server (``python app.py --model demo-tiny``), in this process."""
    home = tmp_path_factory.mktemp("readme-home")
    cfg = EngineConfig(
        model="demo-tiny",
        device="cpu",
        backend="native",
        cache_dir=str(home),
        voices_dir=str(home / "voices"),
    )
    fastapi_app = web.create_app(cli.build_engine(cfg), ui_lang="en", random_weights=True)
    with serving(fastapi_app, start_s=120) as url:  # its start-up runs a warm-up synthesis
        yield url.removeprefix("http://").rstrip("/")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("readme-work")
    write_wav(work / "me.wav", seconds=3.0)
    return work


def run_shell(command: str, workdir: Path, home: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(home), "PYTHONPATH": str(REPO)}
    command = re.sub(r"^python3? ", f"{sys.executable} ", command)
    return subprocess.run(
        ["bash", "-c", command], cwd=workdir, env=env, capture_output=True, text=True, timeout=300
    )


def wav_frames(path: Path) -> int:
    with wave.open(io.BytesIO(path.read_bytes())) as w:
        assert w.getframerate() == 24000
        return w.getnframes()


@pytest.mark.skipif(shutil.which("curl") is None, reason="the README's API examples use curl")
def test_the_api_examples_run_as_written(server: str, workdir: Path, monkeypatch) -> None:
    api_blocks = [(lang, code) for lang, code in BLOCKS if README_PORT in code]
    assert len(api_blocks) == 3
    for lang, code in api_blocks:
        code = code.replace(README_PORT, server)
        if lang == "python":
            monkeypatch.chdir(workdir)
            exec(compile(code, "README.md", "exec"), {})
            continue
        for command in shell_commands(code):
            done = run_shell(command, workdir, workdir)
            assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-2000:])
            if "stream_format" in command:
                assert '"type":"speech.audio.done"' in done.stdout
    assert 0 < wav_frames(workdir / "hello.wav") < 2**31 - 1  # "stream": false: exact sizes
    assert wav_frames(workdir / "hi.wav") > 0
    assert wav_frames(workdir / "dialogue.wav") > 0  # the script example
    assert (workdir / "dialogue.srt").read_text().startswith("1\n00:00:")


def test_the_cli_example_runs_as_written(workdir: Path, tmp_path: Path) -> None:
    cli = [code for lang, code in BLOCKS if lang == "bash" and "python -m engine" in code]
    assert len(cli) == 1
    for command in shell_commands(cli[0]):
        done = run_shell(command, workdir, tmp_path)
        assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-2000:])
    assert wav_frames(workdir / "hello.wav") > 0
