"""The install files agree with each other and with what the tests run on: the Space front matter names
the Gradio that requirements.txt pins, constraints.txt pins the same, and that is the Gradio installed here
(so a Space never runs a Gradio no test has seen, and ``pip install -r requirements-dev.txt`` resolves at
once instead of backtracking through Gradio releases)."""

from __future__ import annotations

import re
from importlib import metadata

from packaging.requirements import Requirement

from tests.conftest import REPO


def pins(path: str) -> dict[str, str]:
    """name -> exact version of every ``name==version`` line (comments and ``-r``/``-c`` lines skipped)."""
    found = {}
    for line in (REPO / path).read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        req = Requirement(line)
        exact = [s.version for s in req.specifier if s.operator == "=="]
        if exact:
            found[req.name.lower()] = exact[0]
    return found


def space_sdk_version() -> str:
    front = (REPO / "README.md").read_text(encoding="utf-8").split("---", 2)[1]
    match = re.search(r"^sdk_version:\s*(\S+)\s*$", front, re.MULTILINE)
    assert match, "README's front matter has no sdk_version"
    return match.group(1)


def test_space_gradio_is_the_pinned_and_tested_gradio() -> None:
    sdk = space_sdk_version()
    assert pins("requirements.txt")["gradio"] == sdk
    assert pins("constraints.txt")["gradio"] == sdk
    assert metadata.version("gradio") == sdk, "the tests run on another Gradio than the Space would"


def test_dev_install_is_constrained_to_the_tested_versions() -> None:
    dev = (REPO / "requirements-dev.txt").read_text(encoding="utf-8").splitlines()
    assert "-c constraints.txt" in [line.split("#", 1)[0].strip() for line in dev]
    constraints = pins("constraints.txt")
    assert len(constraints) > 50  # the whole resolved set, not a few names
    for name in ("fastapi", "openai", "transformers", "huggingface-hub", "pydantic"):
        assert metadata.version(name) == constraints[name], name
