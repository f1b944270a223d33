"""Every relative link in the README and under docs/ resolves: the file (or folder) exists and a
``#fragment`` names a heading of the target, as GitHub renders it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md")])

# [text](target) and ![alt](target); the target ends at whitespace or the closing parenthesis.
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"`[^`]*`")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def _prose_lines(text: str, *, keep_code_spans: bool = False) -> list[str]:
    """The lines outside fenced code blocks; inline code spans blanked unless kept (a heading's
    code is part of its id, a link inside code is no link)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line if keep_code_spans else CODE_SPAN.sub("", line))
    return lines


def github_anchor(heading: str) -> str:
    """GitHub's id for a heading: the text of links and code kept, lower case, every character
    but letters, digits, spaces, '-' and '_' dropped, spaces turned into '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The ids of a Markdown file's headings (a repeated one gets -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    found = set()
    for line in _prose_lines(path.read_text(), keep_code_spans=True):
        match = HEADING.match(line)
        if not match:
            continue
        slug = github_anchor(match.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def broken_links(path: Path) -> list[str]:
    """Each relative link of ``path`` whose file or heading does not exist, as 'target: why'."""
    problems = []
    for line in _prose_lines(path.read_text()):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
                continue  # http:, https:, mailto: ...
            file_part, _, fragment = target.partition("#")
            resolved = (path.parent / file_part).resolve() if file_part else path
            if not resolved.exists():
                problems.append(f"{target}: no such file")
            elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
                problems.append(f"{target}: no heading #{fragment} in {resolved.name}")
    return problems


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(path: Path) -> None:
    assert broken_links(path) == []


def test_the_checker_finds_a_missing_file_and_a_missing_heading(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Title\n\n## The stages' store (`TCPStore`)\n")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "# Doc\n\n"
        "[ok](other.md#the-stages-store-tcpstore) [self](#doc) ![img](other.md)"
        " [web](https://example.invalid/x) `[code](missing.md)`\n"
        "[gone](missing.md) [bad anchor](other.md#nothing)\n"
        "```\n[in a fence](missing-too.md)\n```\n"
    )
    assert broken_links(doc) == [
        "missing.md: no such file",
        "other.md#nothing: no heading #nothing in other.md",
    ]
