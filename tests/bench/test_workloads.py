"""Workload generator and the hit-ratio definition of reuse."""

from __future__ import annotations

import json

import pytest

from wavepp.bench.workloads import (
    ideal_hit_ratio,
    mooncake_workload,
    preset_workload,
    shared_prefix_workload,
)


def test_ideal_hit_ratio_counts_whole_shared_blocks_only() -> None:
    a = [1, 2, 3, 4, 5, 6, 7]  # blocks of 2: [1,2] [3,4] [5,6] + partial [7]
    b = [1, 2, 3, 4, 9, 9, 9]  # shares two blocks with a
    c = [8, 8]  # shares nothing
    assert ideal_hit_ratio([a, b, c], block_size=2) == pytest.approx(4 / 16)
    # Repeating a prompt reuses all its full blocks but must compute its last token:
    # [1,2,3,4] cached blocks cap at (4 - 1) // 2 = 1 block.
    assert ideal_hit_ratio([[1, 2, 3, 4], [1, 2, 3, 4]], block_size=2) == pytest.approx(2 / 8)
    # Warm-up fills the cache first and is not counted.
    assert ideal_hit_ratio([b], block_size=2, warmup=[a]) == pytest.approx(4 / 7)


def test_shared_prefix_workload_layout() -> None:
    w = shared_prefix_workload(
        5, num_prefix_tokens=8, num_suffix_tokens=3, num_prefixes=2, vocab_size=50, seed=1
    )
    assert len(w.prompts) == 5 and all(len(p) == 11 for p in w.prompts)
    assert w.prompts[0][:8] == w.prompts[2][:8] == w.prompts[4][:8]
    assert w.prompts[1][:8] == w.prompts[3][:8] != w.prompts[0][:8]
    assert len(w.warmup) == 2 and w.warmup[1][:8] == w.prompts[1][:8]
    assert len(set(w.request_ids)) == 5
    again = shared_prefix_workload(
        5, num_prefix_tokens=8, num_suffix_tokens=3, num_prefixes=2, vocab_size=50, seed=1
    )
    assert again.prompts == w.prompts


def test_presets_are_low_and_high_by_measured_ratio() -> None:
    low = preset_workload("low", 32, vocab_size=1024)
    high = preset_workload("high", 32, vocab_size=1024)
    assert ideal_hit_ratio(low.prompts, 64, low.warmup) < 0.4
    assert ideal_hit_ratio(high.prompts, 64, high.warmup) >= 0.6


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_requests": 0}, "num_requests"),
        ({"num_suffix_tokens": 0}, "num_suffix_tokens"),
        ({"num_prefixes": 0}, "num_prefixes"),
    ],
)
def test_bad_knobs_name_the_field(kwargs: dict, field: str) -> None:
    args = {
        "num_requests": 2,
        "num_prefix_tokens": 4,
        "num_suffix_tokens": 2,
        "num_prefixes": 1,
        **kwargs,
    }
    with pytest.raises(ValueError, match=field):
        shared_prefix_workload(**args)
    with pytest.raises(ValueError, match="reuse"):
        preset_workload("medium", 2)


def test_mooncake_workload_reproduces_the_trace_reuse(tmp_path) -> None:  # noqa: ANN001
    lines = [
        {"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [0, 1]},
        {"timestamp": 1, "input_length": 1500, "output_length": 1, "hash_ids": [0, 1, 2]},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    w = mooncake_workload(path, 2, tokens_per_block=16, vocab_size=100)
    # 1500 - 2 * 512 = 476 tokens in the last block -> ceil(476 * 16 / 512) = 15
    assert [len(p) for p in w.prompts] == [32, 16 + 16 + 15]
    assert w.prompts[1][:32] == w.prompts[0]
    assert ideal_hit_ratio(w.prompts, 16) == pytest.approx(32 / 79)
