"""The docs name only code that exists: a backticked ``Class.method`` or ``_private`` name in
``docs/*.md`` (the design and operations docs, not the benchmark reports, which also quote
TensorRT-LLM's sources) or README.md must be defined somewhere in ``wavepp/``.

Heuristic, stated: a token is checked when it is a dotted identifier whose second-to-last part
is CamelCase (``Class.member``) or whose last part starts with one underscore and has another inside (``_total``, a metric suffix,
is not a name); it is defined when
``wavepp/`` has ``def NAME``, ``class NAME`` or a line assigning/annotating ``NAME``.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Names of other projects' code the docs quote on purpose (TensorRT-LLM's PP executor loop).
EXTERNAL = {"_executor_loop_pp"}
IDENT = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def _defined_names() -> set[str]:
    names: set[str] = set()
    for path in (ROOT / "wavepp").rglob("*.py"):
        text = path.read_text()
        names.update(re.findall(r"(?:def|class)\s+([A-Za-z_]\w*)", text))
        names.update(re.findall(r"^\s*(?:self\.)?([A-Za-z_]\w*)\s*[:=]", text, re.M))
    return names


def _checked_tokens(text: str) -> list[tuple[int, str]]:
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for token in re.findall(r"`([^`\s]+)`", line):
            token = token.removesuffix("()")
            if not IDENT.fullmatch(token) or token.endswith(".md"):
                continue
            parts = token.split(".")
            member = parts[-1]
            on_class = len(parts) >= 2 and parts[-2][:1].isupper()
            # A lone suffix such as ``_total`` (a metric naming rule) is not a name.
            private = member.startswith("_") and not member.startswith("__") and "_" in member[1:]
            if on_class or private:
                found.append((number, token))
    return found


def test_docs_name_only_defined_code():
    defined = _defined_names() | EXTERNAL
    docs = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
    missing = [
        f"{path.relative_to(ROOT)}:{number}: {token}"
        for path in docs
        for number, token in _checked_tokens(path.read_text())
        if token.split(".")[-1] not in defined
    ]
    assert not missing, "docs name code that does not exist:\n" + "\n".join(missing)


def test_the_check_finds_a_missing_name():
    tokens = _checked_tokens("the `Scheduler._no_such_method` and `_gone_helper` and `kv.recent`")
    assert [t for _, t in tokens] == ["Scheduler._no_such_method", "_gone_helper"]
    assert "_gone_helper" not in _defined_names()
