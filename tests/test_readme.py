"""README.md and docs/*.md stay true: every shell or Python block in them says whether it runs, and each one
that does runs here as written, where a user would run it.

The marker is an HTML comment on the line before the block:

- ``<!-- runs -->``: the block runs; ``<!-- runs: creates a.wav b.srt -->`` also names the files it must
  leave (non-empty; a ``.wav`` must hold audio).
- ``<!-- runs: server -->``: the block is one command that starts the server; it is started once, with
  ``--port`` set to a free port, and the blocks that call ``127.0.0.1:7860`` call it instead.
- ``<!-- no-run: why -->``: not run here (a GPU, Docker, the network, a real checkpoint...), with the reason.

The runner is a user who installed the project: a fresh working directory per page (outside the repository,
holding ``me.wav``, a recording), ``HOME`` in a temporary folder (so ``demo-tiny`` is built under its cache),
``python`` / ``python3`` on ``PATH``, the repository importable (``PYTHONPATH``, as ``pip install -e .``
makes it) and ``cosystream`` the console entry ``pyproject.toml`` declares (the real installed script is
tested in ``tests/test_entry_point.py``). Shell blocks run under ``bash -e -o pipefail``; Python blocks are
complete programs, run as ``python block.py``."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import tomllib
import wave
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO, WAIT_S
from tests.sounds import write_wav

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RUNNABLE = ("bash", "sh", "python", "console")
MARKER = re.compile(r"<!--\s*(runs|no-run)\s*(?::\s*(.*?))?\s*-->\s*$")
FENCE = re.compile(r"^```(\w*)\s*$")
README_PORT = "127.0.0.1:7860"


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # where the fence opens, 1-based
    lang: str
    code: str
    marker: str | None  # "runs", "no-run" or None
    detail: str = ""

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"

    @property
    def server(self) -> bool:
        return self.marker == "runs" and self.detail == "server"

    @property
    def creates(self) -> list[str]:
        words = self.detail.split()
        return words[1:] if words[:1] == ["creates"] else []


def blocks(page: Path) -> list[Block]:
    """Every fenced block of a page with the marker on the line before it (if any)."""
    lines = page.read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i].strip()) if lines[i].startswith("```") else None
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        assert end is not None, f"{page}:{i + 1}: a fence that never closes"
        before = lines[i - 1].strip() if i else ""
        mark = MARKER.match(before)
        code = "\n".join(lines[i + 1 : end])
        found.append(
            Block(page, i + 1, fence.group(1), code, mark and mark.group(1), (mark and mark.group(2)) or "")
        )
        i = end + 1
    return found


ALL = [b for page in DOCS for b in blocks(page)]
RUN = [b for b in ALL if b.marker == "runs" and not b.server]
SERVER = [b for b in ALL if b.server]


def test_every_shell_and_python_block_says_whether_it_runs() -> None:
    unmarked = [b.name for b in ALL if b.lang in RUNNABLE and b.marker is None]
    assert not unmarked, f"mark each with <!-- runs --> or <!-- no-run: why -->: {unmarked}"
    assert not [b.name for b in ALL if b.marker == "no-run" and not b.detail], "a no-run says why"
    assert len(SERVER) == 1 and SERVER[0].page.name == "README.md", [b.name for b in SERVER]
    pages = {b.page.name for b in RUN}
    assert {"README.md", "api.md", "scripts.md", "engine-api.md"} <= pages, pages


def test_the_parser_reads_markers_and_fences(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("<!-- runs: creates a.wav -->\n```bash\necho hi\n```\n\n```python\nx = 1\n```\n")
    first, second = blocks(page)
    assert (first.marker, first.creates, first.code, first.line) == ("runs", ["a.wav"], "echo hi", 2)
    assert (second.marker, second.lang) == (None, "python")


# ---------------------------------------------------------------------------------------------------- runner
def entry_point(name: str) -> str:
    """``module:function`` of a console script in pyproject.toml."""
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    return scripts[name]


@pytest.fixture(scope="module")
def user(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of a user with the project installed: its own HOME, python and cosystream on PATH."""
    home, bin_dir = tmp_path_factory.mktemp("home"), tmp_path_factory.mktemp("bin")
    for name in ("python", "python3"):
        (bin_dir / name).symlink_to(sys.executable)
    module, function = entry_point("cosystream").split(":")
    script = bin_dir / "cosystream"
    script.write_text(
        f"#!{sys.executable}\nimport sys\nfrom {module} import {function}\nsys.exit({function}())\n"
    )
    script.chmod(0o755)
    return {
        "PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin",
        "HOME": str(home),
        "PYTHONPATH": str(REPO),
        "PYTHONUNBUFFERED": "1",
        "LANG": "C.UTF-8",
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    proc: subprocess.Popen[str]
    address: str
    lines: list[str] = field(default_factory=list)

    def read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def ready(self, deadline: float) -> bool:
        """The server listens at once and loads the engine behind it: /ready answers 200 once it is warm."""
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(f"http://{self.address}/ready", timeout=10).status_code == 200:
                    return True
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        return False


@pytest.fixture(scope="module")
def server(user: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """README's "Run it" command, started as written (plus a free port) from a directory of its own."""
    (block,) = SERVER
    (command,) = shell_lines(block.code)
    port = free_port()
    cwd = tmp_path_factory.mktemp("server-cwd")
    proc = subprocess.Popen(
        ["bash", "-c", f"exec {command} --port {port}"],
        cwd=cwd, env=user, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    srv = Server(proc, f"127.0.0.1:{port}")
    threading.Thread(target=srv.read, daemon=True).start()
    try:
        assert srv.ready(time.monotonic() + 2 * WAIT_S), "".join(srv.lines[-40:])
        yield srv.address
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


def shell_lines(code: str) -> list[str]:
    """Commands of a shell block: lines joined at trailing backslashes; comments and blanks dropped."""
    joined = re.sub(r"\s*\\\n\s*", " ", code)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.startswith("#")]


def run_block(block: Block, workdir: Path, env: dict[str, str], address: str | None) -> None:
    code = block.code.replace(README_PORT, address) if address else block.code
    if block.lang == "python":
        program = workdir / f"block_{block.line}.py"
        program.write_text(code + "\n", encoding="utf-8")
        argv = [sys.executable, program.name]
    else:
        argv = ["bash", "-e", "-o", "pipefail", "-c", code]
    done = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (block.name, done.stdout[-3000:], done.stderr[-3000:])
    for name in block.creates:
        path = workdir / name
        assert path.is_file() and path.stat().st_size > 0, (block.name, name)
        if path.suffix == ".wav":  # a streamed wav says "to the end" (2^31-1 frames): audio either way
            with wave.open(str(path)) as w:
                assert w.getframerate() == 24000 and w.getnframes() > 0, (block.name, name)


PAGES = sorted({b.page for b in RUN}, key=DOCS.index)


@pytest.mark.skipif(shutil.which("curl") is None, reason="the pages' API examples use curl")
@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_the_page_runs_as_written(page: Path, user, request, tmp_path_factory) -> None:
    """Each page's blocks in order, in one working directory of its own (outside the repository)."""
    workdir = tmp_path_factory.mktemp(page.stem.lower())
    assert not workdir.resolve().is_relative_to(REPO)
    write_wav(workdir / "me.wav", seconds=3.0)
    page_blocks = [b for b in RUN if b.page == page]
    address = request.getfixturevalue("server") if any(README_PORT in b.code for b in page_blocks) else None
    for block in page_blocks:
        run_block(block, workdir, dict(user), address)
    if page.name == "scripts.md":
        assert (workdir / "dialogue.srt").read_text().startswith("1\n00:00:")


def test_the_runner_fails_a_block_that_fails(user, tmp_path: Path) -> None:
    bad = Block(REPO / "README.md", 1, "bash", "true\nfalse\necho never > never.txt", "runs")
    with pytest.raises(AssertionError):
        run_block(bad, tmp_path, dict(user), None)
    assert not (tmp_path / "never.txt").exists()
    missing = Block(REPO / "README.md", 2, "python", "print('no file')", "runs", "creates out.wav")
    with pytest.raises(AssertionError):
        run_block(missing, tmp_path, dict(user), None)
