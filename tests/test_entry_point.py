"""Installed, the project runs from any directory: ``pip install .`` into a fresh virtual environment gives
the ``cosystream`` console script (the server, as ``python app.py``) and ``python -m engine``, both working
from a folder that is not the repository, with the example voices the wheel carries."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import venv
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO, WAIT_S
from tests.sounds import write_wav
from tests.test_readme import Server, free_port

SOURCES = (
    "app.py",
    "engine",
    "server",
    "api",
    "webui",
    "cluster",
    "bench",
    "assets",
    "pyproject.toml",
    "README.md",
)


def copy_sources(dest: Path) -> Path:
    """The project's files, copied: a build or an editable install leaves nothing in the checkout."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in SOURCES:
        path = REPO / name
        ignore = shutil.ignore_patterns("__pycache__", "results")
        (
            shutil.copytree(path, dest / name, ignore=ignore)
            if path.is_dir()
            else shutil.copy(path, dest / name)
        )
    return dest


def fresh_venv(env_dir: Path, *install: str) -> Path:
    """A virtual environment that sees the machine's packages (as after ``pip install -r requirements.txt``),
    with ``pip install --no-deps *install`` run into it."""
    venv.create(env_dir, system_site_packages=True, with_pip=False)
    pip = [sys.executable, "-m", "pip", "--python", str(env_dir / "bin" / "python"), "install", "-q"]
    subprocess.run(
        [*pip, "--no-deps", "--no-index", "--no-build-isolation", *install], check=True, timeout=600
    )
    return env_dir


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project installed from a wheel built from it (``pip install .``), not from the checkout."""
    tmp = tmp_path_factory.mktemp("install")
    src, wheels = copy_sources(tmp / "src"), tmp / "wheels"
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(src)]
    subprocess.run([*build, "-w", str(wheels)], check=True, timeout=600)
    (wheel,) = wheels.glob("cosystream-*.whl")
    return fresh_venv(tmp / "venv", str(wheel))


def user_env(env_dir: Path, home: Path) -> dict[str, str]:
    path = f"{env_dir / 'bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}"
    return {"PATH": path, "HOME": str(home), "PYTHONUNBUFFERED": "1", "LANG": "C.UTF-8"}


@pytest.mark.slow
def test_cosystream_and_python_m_engine_run_from_any_directory(installed: Path, tmp_path: Path) -> None:
    env = user_env(installed, tmp_path / "home")
    where = subprocess.run(
        ["python", "-c", "import engine, server; print(engine.__file__)"],
        cwd=tmp_path, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert Path(where.stdout.strip()).is_relative_to(installed), where.stdout  # the wheel's, not the checkout
    shown = subprocess.run(["cosystream", "--help"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    for group in ("serving:", "model:", "limits", "GPU tuning", "(default: 7860)"):
        assert group in shown.stdout, group
    write_wav(tmp_path / "me.wav", seconds=3.0)
    synth = ["python", "-m", "engine", "synth", "--model", "demo-tiny", "--text", "Hello!",
             "--prompt-wav", "me.wav", "--prompt-text", "What I said.", "--out", "hello.wav"]  # fmt: skip
    done = subprocess.run(synth, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["audio_s"] > 0 and (tmp_path / "hello.wav").stat().st_size > 44


@pytest.mark.slow
def test_the_installed_server_serves_with_its_example_voices(installed: Path, tmp_path: Path) -> None:
    env, port = user_env(installed, tmp_path / "home"), free_port()
    argv = ["cosystream", "--model", "demo-tiny", "--asr-model", "none", "--port", str(port)]
    proc = subprocess.Popen(
        argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    srv = Server(proc, f"127.0.0.1:{port}")
    threading.Thread(target=srv.read, daemon=True).start()
    try:
        assert srv.ready(time.monotonic() + 2 * WAIT_S), "".join(srv.lines[-40:])
        voices = httpx.get(f"http://{srv.address}/v1/audio/voices", timeout=30).json()["voices"]
        assert {"en-amy", "en-ben", "zh-lan"} <= set(voices), voices  # assets/voices came with the wheel
    finally:
        proc.terminate()
        assert proc.wait(60) == 0, "".join(srv.lines[-40:])


@pytest.mark.slow
def test_an_editable_install_gives_the_same_commands(tmp_path: Path) -> None:
    """README's install line (``pip install -r requirements.txt -e .``) from a clone: the commands work
    from any folder and run the clone's code."""
    clone = copy_sources(tmp_path / "clone")
    env_dir = fresh_venv(tmp_path / "venv", "-e", str(clone))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = user_env(env_dir, tmp_path / "home")
    shown = subprocess.run(["cosystream", "--help"], cwd=elsewhere, env=env, capture_output=True, text=True)
    assert shown.returncode == 0 and "GPU tuning" in shown.stdout, shown.stderr
    where = subprocess.run(
        ["python", "-m", "engine", "--help"], cwd=elsewhere, env=env, capture_output=True, text=True
    )
    assert where.returncode == 0 and "synth" in where.stdout, where.stderr
    found = subprocess.run(
        ["python", "-c", "import engine.voices as v; print(v.DEFAULT_EXAMPLES_DIR)"],
        cwd=elsewhere, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert Path(found.stdout.strip()).is_relative_to(clone)
