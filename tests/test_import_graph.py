"""The product's imports point one way: no module imports one that (directly or not) imports it back, the
engine imports none of its callers, and nothing in the product imports the bench harness or the app script.

Every import counts, inside functions and under ``TYPE_CHECKING`` too: a lazy import still ties the modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("engine", "api", "webui", "server", "cluster")
CALLERS = ("api", "webui", "server", "cluster", "bench", "app")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def product_files() -> list[Path]:
    files = [ROOT / "app.py"]
    for package in PRODUCT:
        files += sorted((ROOT / package).rglob("*.py"))
    return files


def imported(node: ast.AST, known: set[str]) -> list[str]:
    """The modules one import statement names (``from a import b`` is a.b when a.b is a module)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and not node.level:
        subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known]
        return subs or [node.module]
    return []


def import_graph(files: list[Path]) -> dict[str, set[str]]:
    """Module -> the modules it imports, all of them (product and not)."""
    known = {module_name(p) for p in files} | {module_name(p) for p in (ROOT / "bench").rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        graph[module_name(path)] = {m for node in ast.walk(tree) for m in imported(node, known)}
    return graph


def cycle_from(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """A path start -> ... -> start, if there is one (depth-first)."""
    stack, seen = [(start, [start])], set()
    while stack:
        node, path = stack.pop()
        for nxt in graph.get(node, ()):
            if nxt == start:
                return [*path, nxt]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, [*path, nxt]))
    return None


def top(module: str) -> str:
    return module.split(".")[0]


def test_the_product_has_no_import_cycle() -> None:
    graph = import_graph(product_files())
    assert {"engine.serving.engine", "engine.lm.speech_lm", "app"} <= set(graph)
    cycles = [c for m in sorted(graph) if (c := cycle_from(graph, m))]
    assert not cycles, " ; ".join(" -> ".join(c) for c in cycles)


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Top-level package (or the app script) -> the other product packages its modules import."""
    names = {*PRODUCT, "app"}
    packages: dict[str, set[str]] = {}
    for module, deps in graph.items():
        packages.setdefault(top(module), set()).update(top(i) for i in deps if top(i) in names)
        packages[top(module)].discard(top(module))
    return packages


def test_the_packages_depend_one_way() -> None:
    """Module cycles are not enough: server.main importing cluster.application while cluster imports
    server.cli is no module cycle, yet the two packages lean on each other (one cannot ship or be read
    without the other). app.py sits above both and picks one."""
    packages = package_graph(import_graph(product_files()))
    cycles = [c for p in sorted(packages) if (c := cycle_from(packages, p))]
    assert not cycles, " ; ".join(" -> ".join(c) for c in cycles)
    assert {"server", "cluster"} <= packages["app"]


def test_the_package_rule_sees_a_cycle_through_different_modules() -> None:
    graph = {"server.main": {"cluster.application"}, "cluster.application": {"server.cli"}}
    packages = package_graph(graph)
    assert cycle_from(graph, "server.main") is None  # the module rule misses it
    assert cycle_from(packages, "server") == ["server", "cluster", "server"]


def test_the_engine_imports_none_of_its_callers() -> None:
    graph = import_graph(product_files())
    upward = {
        m: sorted(i for i in deps if top(i) in CALLERS) for m, deps in graph.items() if top(m) == "engine"
    }
    assert not {m: deps for m, deps in upward.items() if deps}


def test_no_product_module_imports_the_bench_or_the_app_script() -> None:
    graph = import_graph(product_files())
    found = {m: sorted(i for i in deps if top(i) in ("bench", "app")) for m, deps in graph.items()}
    assert not {m: deps for m, deps in found.items() if deps}


def test_the_cycle_finder_finds_one() -> None:
    assert cycle_from({"a": {"b"}, "b": {"c"}, "c": {"a"}}, "a") == ["a", "b", "c", "a"]
    assert cycle_from({"a": {"b"}, "b": set()}, "a") is None


def test_from_imports_resolve_to_submodules() -> None:
    tree = ast.parse("from engine.text import frontend, missing\nimport engine.device")
    known = {"engine.text.frontend", "engine.device"}
    found = [m for node in ast.walk(tree) for m in imported(node, known)]
    assert found == ["engine.text.frontend", "engine.device"]
