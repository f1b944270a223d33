"""benchmarks/sim_served.py at toy sizes: a trace run and a shift run each get a table row and a
JSON entry with every figure (the shift's after-shift figures too); bad flags are refused by
name."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "sim_served.py"


def _load():  # noqa: ANN202
    spec = importlib.util.spec_from_file_location("sim_served", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("sim_served", module)
    spec.loader.exec_module(module)
    return module


def test_a_trace_run_and_a_shift_run_report_every_figure(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--runs", "12x4", "--shift", "10x5", "--short-tokens", "64", "--long-tokens", "512"]
    assert _load().main([*argv, "--shift-window", "4", "--json"]) == 0
    lines = capsys.readouterr().out.splitlines()
    result = json.loads(lines[-1])
    trace, shift = result["runs"]
    assert [row.split(" | ")[:2] for row in lines if row.startswith("| trace") or
            row.startswith("| shift")] == [["| trace", "12, 4"], ["| shift", "10, 5"]]  # fmt: skip
    assert (trace["requests"], trace["concurrency"], shift["requests"]) == (12, 4, 20)
    for run in (trace, shift):
        assert 0 < run["efficiency"] <= 1
        assert run["microbatches"] > 0 and 0 < run["fixed_share"] < 1
        low, high = run["tokens_min_max"]
        assert 0 < low <= run["tokens_mean"] <= high
        assert run["max_over_median_cost"] >= 1 and run["ttft_p99_s"] >= run["ttft_p50_s"] > 0
    assert "after_shift" not in trace
    after = shift["after_shift"]
    assert 0 < after["microbatches"] < shift["microbatches"]
    assert 0 < after["fixed_share_first_4"] < 1


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--runs", "300"], "--runs"),
        (["--shift", "10x0"], "--shift"),
        (["--short-tokens", "512", "--long-tokens", "512"], "--short-tokens"),
        (["--stage-scale", "0"], "--stage-scale"),
    ],
)
def test_bad_flags_are_refused_by_name(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        _load().main(argv)
    assert exc.value.code == 2 and named in capsys.readouterr().err
