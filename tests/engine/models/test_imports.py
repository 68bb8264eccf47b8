"""engine/models/ imports point one way: no module imports one that (directly or not) imports it back,
``TYPE_CHECKING`` imports included (configs live in their own modules for that)."""

from __future__ import annotations

import ast
from pathlib import Path

import engine.models

MODELS = Path(engine.models.__file__).parent


def model_imports() -> dict[str, set[str]]:
    """Module stem -> the engine.models modules it imports (anywhere in the file)."""
    graph: dict[str, set[str]] = {}
    for path in MODELS.glob("*.py"):
        found = graph.setdefault(path.stem, set())
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("engine.models."):
                found.add(node.module.rsplit(".", 1)[-1])  # type: ignore[union-attr]
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


def test_model_imports_have_no_cycle() -> None:
    graph = model_imports()
    assert {"hift_config", "lm_config", "hift", "speech_lm"} <= set(graph)
    cycles = [c for m in sorted(graph) if (c := cycle_from(graph, m))]
    assert not cycles, " ; ".join(" -> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_one() -> None:
    assert cycle_from({"a": {"b"}, "b": {"c"}, "c": {"a"}}, "a") == ["a", "b", "c", "a"]
    assert cycle_from({"a": {"b"}, "b": set()}, "a") is None
