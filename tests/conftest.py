"""Shared test fixtures: the golden fixture root and the GPU marker."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
