"""The built wheel holds every product package (cluster/ and server/ included) and their data files, so an
installed ``cosystream --replicas N`` finds cluster/ and the text front end finds its json."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("engine", "server", "api", "webui", "cluster", "bench", "app.py", "pyproject.toml", "README.md")


def packages_under(root: Path) -> set[str]:
    """Every folder with an ``__init__.py`` among the sources, as a dotted name."""
    found = set()
    for init in root.rglob("__init__.py"):
        found.add(".".join(init.parent.relative_to(root).parts))
    return found


@pytest.mark.slow
def test_the_wheel_holds_every_package_and_its_data(tmp_path) -> None:
    src = tmp_path / "src"
    for name in SOURCES:  # a copy, so the build leaves no build/ or egg-info in the checkout
        path = ROOT / name
        ignore = shutil.ignore_patterns("__pycache__", "results")
        (shutil.copytree(path, src / name, ignore=ignore) if path.is_dir() else shutil.copy(path, src / name))
    packages = packages_under(src)  # before the build writes its own copies under src/build/
    wheels = tmp_path / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            str(src),
            "-w",
            str(wheels),
        ],
        check=True,
        timeout=600,
    )
    (wheel,) = wheels.glob("cosystream-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"engine.text", "engine.flow", "engine.vocoder", "engine.serving", "server", "cluster"} <= packages
    missing = sorted(p for p in packages if f"{p.replace('.', '/')}/__init__.py" not in names)
    assert not missing, missing
    data = [
        "engine/text/special_tokens.json",
        "engine/text/instruct_presets.json",
        "cluster/serve_config.yaml",
    ]
    data += [f"webui/static/{p.name}" for p in (ROOT / "webui" / "static").iterdir() if p.is_file()]
    assert not [d for d in data if d not in names]
    entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "app.py" in names  # the entry over server/ and cluster/
    assert "cosystream = app:main" in zipfile.ZipFile(wheel).read(entry).decode()
