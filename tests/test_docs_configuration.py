"""docs/configuration.md's flag table is the server's parser (``server.cli.build_parser``) written out: every
flag, its ``--help`` group, its default and its environment variable, so the page cannot drift from the code.
After changing a flag, rewrite the table with ``python -m tests.test_docs_configuration`` (from the
repository root) and commit it. ``--help`` itself lists the flags in those groups, each with its default."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

from server import cli

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
BEGIN, END = "<!-- flags:begin (generated: python -m tests.test_docs_configuration) -->", "<!-- flags:end -->"
GROUPS = ("serving", "model", "limits", "GPU tuning", "scale out")


@contextlib.contextmanager
def clean_environment() -> Iterator[None]:
    """The defaults as a fresh shell sees them: the variables that set flags' defaults unset."""
    saved = {name: os.environ.pop(name) for name in cli.ENV_DEFAULTS.values() if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def parser() -> argparse.ArgumentParser:
    with clean_environment():
        return cli.build_parser()


def shown_default(action: argparse.Action) -> str:
    """The default as a reader wants it: switches are off until given, a --x/--no-x pair is on or off as
    its default says, None is what the help text says."""
    if isinstance(action, argparse.BooleanOptionalAction) and action.default is not None:
        return "on" if action.default else "off"
    if action.nargs == 0 and action.default is not None:  # store_true / _false / _const
        return "off"
    if action.default is None:
        return "auto (see text)"
    if isinstance(action.default, float) and action.default.is_integer():
        return f"`{int(action.default)}`"
    return f"`{action.default}`"


def cell(text: str) -> str:
    return text.replace("%%", "%").replace("|", "\\|").replace("\n", " ")


def flag_table() -> str:
    """One Markdown table per ``--help`` group, in its order."""
    out = []
    for group in parser()._action_groups:
        actions = [a for a in group._group_actions if a.option_strings and a.help != argparse.SUPPRESS]
        actions = [a for a in actions if "-h" not in a.option_strings]
        if not actions:
            continue
        out += [f"### {group.title}", "", "| flag | default | env | what it sets |", "|---|---|---|---|"]
        for a in actions:
            names = " / ".join(f"`{name}`" for name in a.option_strings)
            env = next((f"`{v}`" for k, v in cli.ENV_DEFAULTS.items() if k in a.option_strings), "")
            out.append(f"| {names} | {shown_default(a)} | {env} | {cell(a.help or '')} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def documented_table() -> str:
    text = DOC.read_text(encoding="utf-8")
    match = re.search(re.escape(BEGIN) + r"\n(.*?)" + re.escape(END), text, re.S)
    assert match, f"{DOC} lacks the {BEGIN} ... {END} block"
    return match.group(1)


def test_configuration_md_lists_every_flag_as_the_parser_declares_it() -> None:
    assert documented_table() == flag_table(), "run: python -m tests.test_docs_configuration"


def test_every_flag_of_the_parser_is_in_the_page() -> None:
    page = documented_table()
    for action in parser()._actions:
        for name in action.option_strings:
            if name not in ("-h", "--help"):
                assert f"`{name}`" in page, name
    # a --x/--no-x pair shows its default: the kept flow programs and the step graphs are on
    assert "| `--flow-precompiled` / `--no-flow-precompiled` | on |" in page
    assert "| `--flow-step-graphs` / `--no-flow-step-graphs` | on |" in page


def test_help_groups_the_flags_and_shows_each_default() -> None:
    p = parser()
    titles = [g.title or "" for g in p._action_groups]
    positions = [next(i for i, t in enumerate(titles) if t.startswith(name)) for name in GROUPS]
    assert positions == sorted(positions), titles  # serving first, the GPU and the cluster last
    serving = next(g for g in p._action_groups if g.title == "serving")
    assert {"--host", "--port"} <= {s for a in serving._group_actions for s in a.option_strings}
    text = " ".join(p.format_help().split())  # as wrapped to any terminal width
    formatter = p._get_formatter()
    for action in p._actions:
        if not action.option_strings or "-h" in action.option_strings:
            continue
        said = formatter._get_help_string(action) or ""
        partner = action.default is None and action.option_strings[0].startswith("--no-")
        assert partner or "default" in said.lower(), action.option_strings  # each flag says its default
    assert "(default: 7860)" in text and "(default: 127.0.0.1)" in text
    assert "COSYSTREAM_MODEL" in text and "COSYSTREAM_CACHE" in text


def test_each_env_variable_sets_what_the_page_says(monkeypatch, tmp_path) -> None:
    from api.auth import resolve_api_keys
    from engine.cache_root import cache_root

    assert set(cli.ENV_DEFAULTS) == {"--model", "--device", "--cache-dir", "--api-key"}
    monkeypatch.setenv("COSYSTREAM_MODEL", "demo-tiny")
    monkeypatch.setenv("COSYSTREAM_DEVICE", "cpu")
    monkeypatch.setenv("COSYSTREAM_CACHE", str(tmp_path))
    monkeypatch.setenv("COSYSTREAM_API_KEY", "k1,k2")
    args = cli.build_parser().parse_args([])
    assert (args.model, args.device) == ("demo-tiny", "cpu")
    page = DOC.read_text(encoding="utf-8")
    assert all(f"| `{name}` | `{flag}`" in page for flag, name in cli.ENV_DEFAULTS.items())
    assert cache_root(args.cache_dir) == tmp_path
    assert resolve_api_keys(args.api_key) == ("k1", "k2")


if __name__ == "__main__":
    doc = DOC.read_text(encoding="utf-8")
    doc = re.sub(
        re.escape(BEGIN) + r"\n.*?" + re.escape(END),
        lambda _: f"{BEGIN}\n{flag_table()}{END}",
        doc,
        flags=re.S,
    )
    DOC.write_text(doc, encoding="utf-8")
    sys.exit(0)
