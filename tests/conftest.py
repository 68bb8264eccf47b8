"""Shared test fixtures: the golden fixture root, the GPU marker, and the run's own cache root."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
FAMILIES = ("cosyvoice2", "cosyvoice3")  # the fixture format's families: cosyvoice{2,3}/ under the root
NO_CASES = "no cosyvoice*/tiny case under the fixture root (COSYSTREAM_FIXTURES or ../shared/fixtures)"
# the ceiling of a test's wait for an event or a state (a server up, a page drawn, a request freed): a wait
# returns as soon as its condition holds, so only a failing test waits this long; generous for a busy 2-core
# machine, where a page's first load and a tiny model's request take seconds instead of milliseconds
WAIT_S = 120.0


def pytest_configure(config: pytest.Config) -> None:
    """The run writes its caches (every tiny model's weight conversions, demo models, compile caches)
    under a fresh root removed at its end, not under ~/.cache/cosystream: a suite run converts some 600
    tiny models (~20 MB each), which piled up there run after run until the disk was full. A root given
    from the outside (COSYSTREAM_CACHE) is used as it is and kept."""
    from engine.cache_root import ENV

    if ENV not in os.environ:
        root = tempfile.mkdtemp(prefix="cosystream-tests-")
        os.environ[ENV] = root
        config.add_cleanup(lambda: shutil.rmtree(root, ignore_errors=True))


def fixture_root() -> Path | None:
    """``COSYSTREAM_FIXTURES`` or ``../shared/fixtures`` beside the checkout; None when neither exists."""
    env = os.environ.get("COSYSTREAM_FIXTURES")
    root = Path(env) if env else REPO.parent / "shared" / "fixtures"
    return root if root.is_dir() else None


def tiny_cases(family: str | None = None) -> list[Path]:
    """Every ``cosyvoice*/tiny/`` fixture directory under the root (data-driven parity)."""
    root = fixture_root()
    if root is None:
        return []
    pattern = f"{family}/tiny" if family else "cosyvoice*/tiny"
    return sorted(p for p in root.glob(pattern) if p.is_dir())


def case_params(family: str | None = None) -> pytest.MarkDecorator:
    """``@case_params()``: one test per fixture case (``case``: its tiny/ directory), or one skipped test
    naming what is missing when the root has none."""
    cases = tiny_cases(family)
    if cases:
        return pytest.mark.parametrize("case", cases, ids=[c.parent.name for c in cases])
    reason = NO_CASES.replace("cosyvoice*", family) if family else NO_CASES
    return pytest.mark.parametrize("case", [pytest.param(None, marks=pytest.mark.skip(reason=reason))])


def fixture_file(*parts: str | Path) -> Path:
    """A file of the fixture set (a path under the root, or a case directory and a name); the test skips,
    naming the file, when the root or the file is absent: every file beyond a case's weights is optional."""
    root = fixture_root()
    if root is None:
        pytest.skip("no fixture root (COSYSTREAM_FIXTURES or ../shared/fixtures)")
    path = root.joinpath(*parts)
    if not path.is_file():
        pytest.skip(f"the fixture set has no {path.relative_to(root) if path.is_relative_to(root) else path}")
    return path


def tiny_yaml(case: Path) -> dict[str, Any]:
    """A case's ``<family>_tiny.yaml`` read as data (sizes come from here, not from the test)."""
    from engine.yaml_data import read_yaml

    return read_yaml(fixture_file(case / f"{case.parent.name}_tiny.yaml"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
