"""Every relative link and image in README.md, BENCHMARKS.md and docs/*.md points at a file of the checkout,
and README stays a page a newcomer reads in five minutes."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import REPO

PAGES = [REPO / "README.md", REPO / "BENCHMARKS.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
# written by the limits branch (issue 58) beside this one; checked like any other link once it exists
ELSEWHERE = {REPO / "docs" / "limits.md"}


def relative_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)  # code is not a link
    found = [m.group(1) for m in LINK.finditer(text)]
    return [link for link in found if not re.match(r"[a-z]+:|#", link)]


def test_every_relative_link_resolves() -> None:
    broken = []
    for page in PAGES:
        for link in relative_links(page):
            target = (page.parent / link.split("#")[0]).resolve()
            if not target.exists() and target not in ELSEWHERE:
                broken.append(f"{page.relative_to(REPO)} -> {link}")
    assert not broken, broken


def test_readme_is_short_and_links_every_doc() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 250
    links = set(relative_links(REPO / "README.md"))
    docs = {f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")} | {"docs/limits.md", "BENCHMARKS.md"}
    assert docs <= links, sorted(docs - links)
    assert "docs/screens/studio-en-1440x900.png" in links


def test_the_checker_sees_a_broken_link(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("[a](missing.md) ![b](img.png) [c](https://x.org) [d](#here)\n```\n[e](code.md)\n```\n")
    assert relative_links(page) == ["missing.md", "img.png"]
