"""``python -m wavepp.bench.checkpoints`` (the README's demo checkpoint)
after only ``pip install -e .``, and its ``--help``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from wavepp.bench import checkpoints


def test_without_transformers_one_line_names_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """One line naming what to install, not a ModuleNotFoundError traceback. transformers is
    installed here (the test
    extra); a None entry in sys.modules makes ``import transformers`` fail as it does without
    it."""
    monkeypatch.setitem(sys.modules, "transformers", None)
    out = tmp_path / "dsv3"
    assert checkpoints.main(["deepseek_v3", str(out), "--layers", "2"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "transformers" in err[0] and "pip install -e '.[test]'" in err[0]
    assert captured.out == "" and not out.exists()


def test_help_describes_every_argument(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        checkpoints.main(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for expected in ("model family", "directory to write", "decoder layers", "vocabulary size"):
        assert expected in text, text
    assert "seed of the random weights (default: 0)" in text


def test_readme_says_what_the_demo_checkpoint_needs() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    at = readme.index("python -m wavepp.bench.checkpoints")
    assert "pip install -e '.[test]'" in readme[at - 300 : at + 300]
