"""Read the released HyperPyYAML config AS DATA: tags become plain mappings, nothing is imported or run.

``!new:pkg.Class`` / ``!name:pkg.fn`` / ``!apply:pkg.fn`` nodes become ``{"__tag__": "new:pkg.Class", ...}``
(a sequence node keeps its items under ``"__args__"``); ``!ref <key>`` is resolved against the top-level
keys, including simple arithmetic such as ``<chunk_size> * <token_mel_ratio>``.
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

TAG_KEY = "__tag__"
ARGS_KEY = "__args__"
_REF = re.compile(r"<([A-Za-z_][\w.]*)>")
_OPS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.USub: operator.neg,
}


class _Ref(str):
    """An unresolved ``!ref`` expression."""


class _Loader(yaml.SafeLoader):
    pass


def _tagged(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> Any:
    tag = node.tag.lstrip("!")
    if isinstance(node, yaml.MappingNode):
        return {TAG_KEY: tag, **loader.construct_mapping(node, deep=True)}
    if isinstance(node, yaml.SequenceNode):
        return {TAG_KEY: tag, ARGS_KEY: loader.construct_sequence(node, deep=True)}
    value = loader.construct_scalar(node)
    return {TAG_KEY: tag} if value in ("", None) else {TAG_KEY: tag, ARGS_KEY: [value]}


def _ref(loader: yaml.SafeLoader, node: yaml.Node) -> _Ref:
    return _Ref(loader.construct_scalar(node))  # type: ignore[arg-type]


_Loader.add_multi_constructor("!new:", _tagged)
_Loader.add_multi_constructor("!name:", _tagged)
_Loader.add_multi_constructor("!apply:", _tagged)
_Loader.add_constructor("!ref", _ref)


def _eval_number(expr: str) -> Any:
    """Evaluate +-*/ over numeric literals only (no names, calls or attributes)."""

    def walk(n: ast.AST) -> Any:
        if isinstance(n, ast.Expression):
            return walk(n.body)
        if isinstance(n, ast.Constant) and isinstance(n.value, int | float):
            return n.value
        if isinstance(n, ast.BinOp) and type(n.op) in _OPS:
            return _OPS[type(n.op)](walk(n.left), walk(n.right))
        if isinstance(n, ast.UnaryOp) and type(n.op) in _OPS:
            return _OPS[type(n.op)](walk(n.operand))
        raise ValueError(f"unsupported !ref expression {expr!r}")

    return walk(ast.parse(expr, mode="eval"))


def _resolve(value: Any, top: dict[str, Any], overrides: dict[str, Any]) -> Any:
    if isinstance(value, _Ref):
        names = _REF.findall(value)
        lookup = {n: overrides.get(n, top.get(n)) for n in names}
        if value.strip() == f"<{names[0]}>" and len(names) == 1:
            return _resolve(lookup[names[0]], top, overrides)
        return _eval_number(_REF.sub(lambda m: repr(_resolve(lookup[m.group(1)], top, overrides)), value))
    if isinstance(value, dict):
        return {k: _resolve(v, top, overrides) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, top, overrides) for v in value]
    return value


def read_yaml(path: str | Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Parse a CosyVoice yaml into plain data; ``overrides`` replace top-level keys before ``!ref``."""
    with open(path, encoding="utf-8") as f:
        top = yaml.load(f, Loader=_Loader)  # our loader only builds plain data
    if not isinstance(top, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    top.update(overrides or {})
    return {k: _resolve(v, top, overrides or {}) for k, v in top.items()}


def tag_of(node: Any) -> str:
    """'new:cosyvoice.flow.flow.CausalMaskedDiffWithDiT' -> 'CausalMaskedDiffWithDiT' ('' if untagged)."""
    return str(node.get(TAG_KEY, "")).rsplit(".", 1)[-1] if isinstance(node, dict) else ""
