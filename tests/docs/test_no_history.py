"""The docs state behaviour and current measurements; their history lives in commit messages.
No page narrates work sessions or compares with code that no longer exists ("before: ...")."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md")])

# Diary words: a work session, a comparison with earlier code, a previous run.
HISTORY = re.compile(r"\bsessions?\b|\bbefore:|\(before\b|\blast time\b|\blast session\b", re.I)


def history_lines(text: str) -> list[str]:
    """The lines of ``text`` that narrate history."""
    return [line.strip() for line in text.splitlines() if HISTORY.search(line)]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_a_doc_narrates_no_history(path: Path) -> None:
    assert history_lines(path.read_text()) == []


def test_the_check_finds_diary_wording() -> None:
    text = (
        "p99 4.3 ms (before: 5.1 ms)\n"
        "after the seventh session\n"
        "x1.15 (last time x1.10)\n"
        "the lease frees the pins (before the fix, it waited)\n"
        "pins before plans; the stage prepares before its activations arrive\n"
    )
    assert history_lines(text) == [
        "p99 4.3 ms (before: 5.1 ms)",
        "after the seventh session",
        "x1.15 (last time x1.10)",
        "the lease frees the pins (before the fix, it waited)",
    ]
