"""Every relative link of the README and docs/ reaches a file, and every ``#anchor`` a heading of it (GitHub's
anchors: the heading lowercased, punctuation dropped, spaces as hyphens, a repeated one numbered)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def prose(text: str) -> str:
    """The page without its fenced code blocks (a link-like text inside code is no link)."""
    lines, inside = [], False
    for line in text.splitlines():
        if FENCE.match(line.lstrip()):
            inside = not inside
            continue
        if not inside:
            lines.append(line)
    return "\n".join(lines)


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the headings of ``page``."""
    seen: dict[str, int] = {}
    found = set()
    for line in prose(page.read_text()).splitlines():
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def links(page: Path) -> list[str]:
    text = re.sub(r"`[^`\n]*`", "", prose(page.read_text()))  # inline code holds no link either
    return [a or b for a, b in LINK.findall(text)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_and_anchor_resolves(page):
    dead = []
    for target in links(page):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:: not checked offline
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            dead.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            dead.append(f"{target}: no heading #{anchor} in {file.relative_to(REPO)}")
    assert not dead, f"{page.relative_to(REPO)}: " + "; ".join(dead)


def test_every_docs_page_is_reached_from_the_readme_or_another_page():
    reached = {
        (page.parent / t.partition("#")[0]).resolve()
        for page in PAGES
        for t in links(page)
        if not re.match(r"^[a-z]+:", t) and t.partition("#")[0]
    }
    unlinked = [str(p.relative_to(REPO)) for p in PAGES[1:] if p.resolve() not in reached]
    assert not unlinked, f"docs pages no page links to: {unlinked}"
