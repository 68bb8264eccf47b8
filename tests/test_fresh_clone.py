"""A fresh clone without ``../shared`` and without chromium: every test module still collects (browser
and fixture tests skip later, with their reasons); a missing fixture root or optional fixture file skips."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, fixture_file


def test_the_suite_collects_without_fixtures_or_chromium(tmp_path: Path) -> None:
    empty = tmp_path / "no-fixtures"
    empty.mkdir()
    # only the interpreter's own folder on the PATH: no chromium (the browser tests look it up there)
    env = os.environ | {"COSYSTREAM_FIXTURES": str(empty), "PATH": str(Path(sys.executable).parent)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "error" not in done.stdout.lower().splitlines()[-1]
    assert "tests/webui/test_browser_demo.py::" in done.stdout


def test_a_missing_root_or_optional_file_skips(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("COSYSTREAM_FIXTURES", str(tmp_path / "absent"))
    with pytest.raises(pytest.skip.Exception, match="no fixture root"):
        fixture_file("tokenizer_special_tokens.json")
    monkeypatch.setenv("COSYSTREAM_FIXTURES", str(tmp_path))
    with pytest.raises(pytest.skip.Exception, match=r"cosyvoice3/tiny/ref_e2e\.npz"):
        fixture_file(tmp_path / "cosyvoice3" / "tiny" / "ref_e2e.npz")
    (tmp_path / "tokenizer_special_tokens.json").write_text("{}")
    assert fixture_file("tokenizer_special_tokens.json") == tmp_path / "tokenizer_special_tokens.json"
