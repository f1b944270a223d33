"""benchmarks/decode_startup.py's flags: bad variants and round counts are refused by name
before any vLLM server starts (the measurement itself needs .venv-vllm and minutes)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "decode_startup.py"


def _load():  # noqa: ANN202
    spec = importlib.util.spec_from_file_location("decode_startup", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("decode_startup", module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("argv", "named"),
    [(["--variants", "engine-process,nope"], "--variants"), (["--rounds", "0"], "--rounds")],
)
def test_bad_flags_are_refused_by_name(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        _load().main(argv)
    assert exc.value.code == 2 and named in capsys.readouterr().err
