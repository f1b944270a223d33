"""``wavepp sim --parallel`` / ``--recommend``: layouts on the simulator (wavepp.cmd.sim_layouts,
wavepp.launch.sim_layouts)."""

from __future__ import annotations

import json
import re

import pytest

from wavepp.cli import main as cli_main
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.planning.parallel import parse_layout, replica_kv_blocks

SMALL = ["--reuse", "high", "--prompt-tokens", "2048", "--requests", "8"]


def _rows(capsys: pytest.CaptureFixture[str]) -> list[dict]:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_one_row_per_layout_and_concurrency(capsys: pytest.CaptureFixture[str]) -> None:
    layouts = "pp8-wave,pp8-sync,tp8,tep8,ep8,pp4xtp2,pp2xtep4-sync"
    argv = ["sim", "--model", "minimax-m2.7", "--parallel", layouts, "--concurrency", "2,4"]
    assert cli_main([*argv, *SMALL, "--json"]) == 0
    rows = _rows(capsys)
    assert [(r["parallel"], r["concurrency"]) for r in rows] == [
        (label, c) for c in (2, 4) for label in layouts.split(",")
    ]
    for row in rows:
        assert row["gpus"] == 8
        assert row["completed"] == 8 and row["failed"] == 0
        assert row["throughput_tokens_per_s"] > 0
        assert 0 < row["ttft_p50_s"] <= row["ttft_p99_s"]
        # Each layout against its own physical bound: below it, and not far below.
        assert 0.2 < row["efficiency"] <= 1.0 + 1e-6
    by = {(r["parallel"], r["concurrency"]): r for r in rows}
    # One stage: no pipeline fill, so at C = 2 a TP replica's first token comes sooner than
    # a pipeline's, whose request crosses 8 stages.
    assert by[("tp8", 2)]["ttft_p50_s"] < by[("pp8-sync", 2)]["ttft_p50_s"]
    assert by[("tp8", 2)]["stages"] == 1 and by[("tp8", 2)]["mode"] == "sync"
    assert by[("pp2xtep4-sync", 2)]["group_size"] == 4
    # Every layout's capacity is the one derivation's (planning.parallel over planning.memory),
    # at the engine's largest micro-batch.
    largest = max(8192, RuntimeConfig().max_microbatch_tokens)
    for row in rows:
        expected = replica_kv_blocks(
            "minimax-m2.7",
            parse_layout(row["parallel"]),
            block_size=64,
            max_microbatch_tokens=largest,
        )
        assert row["kv_blocks_per_stage"] == expected


def test_recommend_ranks_layouts(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["sim", "--model", "minimax-m2.7", "--recommend", "--gpus", "4", "--concurrency", "4"]
    assert cli_main([*argv, *SMALL, "--json"]) == 0
    captured = capsys.readouterr()
    rows = json.loads(captured.out.strip().splitlines()[-1])
    ranked = sorted(rows, key=lambda r: r["rank"])
    assert [r["rank"] for r in ranked] == list(range(1, len(rows) + 1))
    tputs = [r["throughput_tokens_per_s"] for r in ranked]
    assert tputs == sorted(tputs, reverse=True)
    assert all(r["gpus"] == 4 for r in rows)
    # MiniMax-M2.7 (230 GB) fits every candidate of 4 H200s.
    assert {"tp4", "tep4", "ep4", "pp4-wave", "pp4-sync", "pp2xtp2-wave"} <= {
        r["parallel"] for r in rows
    }
    assert "lowest TTFT p50:" in captured.err


def test_recommend_defaults_to_the_exact_budget(capsys: pytest.CaptureFixture[str]) -> None:
    """Without ``--baseline-budget`` the layout comparison charges a chunk its new tokens only
    (``launch.sim.LAYOUTS_BUDGET``). At high reuse the single-stage engine ranks first then;
    charged its cached tokens (``none``, the wave vs sync default) it fits one request per chunk
    and falls below the pipeline, the opposite ranking."""
    setting = ["--model", "minimax-m2.7", "--concurrency", "8", "--reuse", "high"]
    setting += ["--prompt-tokens", "8192", "--requests", "16", "--json"]
    assert cli_main(["sim", "--recommend", "--parallel", "pp8-wave,tep8", *setting]) == 0
    rows = {row["parallel"]: row for row in _rows(capsys)}
    assert {row["baseline_budget"] for row in rows.values()} == {"exact"}
    assert rows["tep8"]["rank"] == 1 and rows["pp8-wave"]["rank"] == 2
    assert cli_main(["sim", "--parallel", "tep8", "--baseline-budget", "none", *setting]) == 0
    (charged,) = _rows(capsys)
    assert charged["baseline_budget"] == "none"
    assert charged["throughput_tokens_per_s"] < rows["pp8-wave"]["throughput_tokens_per_s"]


def test_recommend_names_the_layouts_that_do_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    # GLM-5.2's 746 GB fit no 4 H200s: every candidate refused with its memory, then an error.
    assert cli_main(["sim", "--model", "glm-5.2", "--recommend", "--gpus", "4"]) == 2
    err = capsys.readouterr().err
    assert "refused tp4: glm-5.2 on 1 stages of 4 x H200 does not fit" in err
    assert "wavepp sim: --gpus: no layout of 4 GPUs holds glm-5.2" in err


@pytest.mark.parametrize(
    ("extra", "flag", "message"),
    [
        (["--parallel", "tp16"], "--parallel", r"t=16 must be in \[1, 8\]"),
        (["--parallel", "pp8,tp4"], "--parallel", "pp8=8, tp4=4"),
        (["--parallel", "pp16xtp1"], "--parallel", "at most 8"),
        (["--parallel", "mp8"], "--parallel", "expected pp<S>"),
        (["--parallel", "tp8", "--stages", "8"], "--stages", "layouts"),
        (["--parallel", "tp8", "--host-memory-gib", "64"], "--host-memory-gib", "host tier"),
        (["--parallel", "tp8", "--gpus", "8"], "--gpus", "only with --recommend"),
        (["--parallel", "tp8", "--concurrency", "0"], "--concurrency", ">= 1"),
        (["--recommend", "--gpus", "9"], "--gpus", "no layout fits"),
        (["--parallel", "tp3"], "--parallel", "t=3 must be a power of two"),
    ],
)
def test_bad_flags_name_the_flag_and_limit(
    extra: list[str], flag: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["sim", "--model", "minimax-m2.7", *extra]) == 2
    err = capsys.readouterr().err
    assert f"wavepp sim: {flag}:" in err
    assert re.search(message, err), err


def test_a_layout_that_does_not_fit_is_refused_with_the_memory(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Kimi K3's 1.56 TB of weights do not fit 8 H200s in any layout.
    assert cli_main(["sim", "--model", "kimi-k3", "--parallel", "tep8"]) == 2
    err = capsys.readouterr().err
    assert "--parallel: layout 'tep8': kimi-k3 on 1 stages of 8 x H200 does not fit" in err
