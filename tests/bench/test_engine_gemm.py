"""benchmarks/engine_gemm.py at toy sizes: every shape and context gets a row, every path it
times computes what the baseline computes (its printed max difference is float32 rounding)."""

from __future__ import annotations

import json

import pytest
import torch
from bench_support import load_benchmark

pytestmark = pytest.mark.timeout(120)

bench = load_benchmark("engine_gemm")


def test_rows_cover_every_shape_and_context_and_paths_agree(capsys) -> None:
    argv = ["--tokens", "8,40", "--contexts", "0,64", "--repeats", "2", "--iters", "1"]
    argv += ["--attn-shapes", "gqa,mla"]
    assert bench.main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result["gemm"]) == {f"{s} M={m}" for s in bench.SHAPES for m in (8, 40)}
    assert set(result["attention"]) == {f"{s} ctx={c}" for s in ("gqa", "mla") for c in (0, 64)}
    assert set(result["attention"]["mla ctx=64"]) >= {"attend", "dense_mask"}
    for row in result["gemm"].values():
        assert row["F.linear"]["ratio"] == 1.0
        if torch.backends.mkldnn.is_available():
            assert "mkldnn_packed" in row
        for cell in row.values():
            assert cell["ms"] > 0 and cell["max_abs_diff"] < 1e-4
    for row in result["attention"].values():
        assert all(cell["max_abs_diff"] < 1e-4 for cell in row.values())


def test_no_contexts_means_no_attention_rows(capsys) -> None:
    argv = ["--tokens", "4", "--contexts", "", "--repeats", "1", "--iters", "1", "--json"]
    assert bench.main(argv) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["attention"] == {}


def test_lists_are_checked() -> None:
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(["--tokens", "a"])
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(["--attn-shapes", "gqa,mha"])
