"""benchmarks/pd_latent_check.py's comparison of a handed-over layer with vLLM's saved cache
(pure; the vLLM run itself is the benchmark's)."""

from __future__ import annotations

import pytest
import torch
from bench_support import load_benchmark

check = load_benchmark("pd_latent_check")


def test_compare_reports_max_abs_and_relative() -> None:
    theirs = torch.tensor([[1.0, -4.0], [2.0, 0.5]])
    got = check.compare(theirs + torch.tensor([[0.0, 0.02], [0.0, 0.0]]), theirs)
    assert got["max_abs"] == pytest.approx(0.02) and got["rel"] == pytest.approx(0.005)
    assert check.compare(torch.zeros(2), torch.zeros(2)) == {"max_abs": 0.0, "rel": 0.0}
    with pytest.raises(ValueError, match="shapes differ"):
        check.compare(torch.zeros(2, 3), torch.zeros(3, 2))


def test_mla_layer_splits_latent_and_roped_key_over_the_saved_tokens() -> None:
    ours = torch.randn(1, 7, 1, 6 + 4)  # 7 tokens handed over, 5 saved by vLLM
    theirs = ours[0, :5, 0].clone()
    theirs[2, 7] += 0.5  # in the roped key
    got = check.compare_layer(ours, theirs, kv_lora_rank=6)
    assert got["tokens"] == 5 and got["latent"]["max_abs"] == 0.0
    assert got["rope_key"]["max_abs"] == pytest.approx(0.5)
    assert got["row"]["max_abs"] == pytest.approx(0.5)


def test_kv_layer_compares_k_and_v_in_either_saved_layout() -> None:
    ours = torch.randn(2, 6, 2, 4)
    saved = ours[:, :4].clone()
    saved[1, 3, 1, 2] += 0.25  # V
    for theirs in (saved, saved.transpose(0, 1)):  # [2, tokens, ...] or [tokens, 2, ...]
        got = check.compare_layer(ours, theirs, kv_lora_rank=None)
        assert got["tokens"] == 4 and got["key"]["max_abs"] == 0.0
        assert got["value"]["max_abs"] == pytest.approx(0.25)
