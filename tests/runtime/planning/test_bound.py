"""The physical bound on closed-loop throughput (wavepp.runtime.planning.bound)."""

from __future__ import annotations

import pytest

from wavepp.bench.workloads import ideal_cached_tokens, ideal_hit_ratio, shared_prefix_workload
from wavepp.runtime.planning import CostModel
from wavepp.runtime.planning.bound import RequestWork, pipeline_bound

MODEL = CostModel(c=1e-3, g=1e-8, b=1e-5, a=1e-10, label="derived", source="test")


def _work(num_requests: int, prompt: int = 4096, cached: int = 3584) -> list[RequestWork]:
    return [RequestWork(prompt, cached) for _ in range(num_requests)]


def test_many_in_flight_is_s_equal_microbatches_back_to_back() -> None:
    # 64 requests of 512 new tokens: 32k new tokens per round, cap 16k -> m = max(S, 2) = 4.
    bound = pipeline_bound([MODEL] * 4, _work(64), concurrency=64, max_microbatch_tokens=16384)
    per_request = MODEL.b * 512 + MODEL.a * (4096**2 - 3584**2) + MODEL.g * 3584
    round_s = 4 * MODEL.c + 64 * per_request
    assert bound.num_microbatches == 4
    # One round (C = N), plus the pipeline's fill and drain: c on each of the 3 other stages.
    assert bound.round_s == pytest.approx(round_s + 3 * MODEL.c)
    assert bound.tokens_per_s == pytest.approx(64 * 4096 / (round_s + 3 * MODEL.c))


def test_fill_and_drain_are_paid_once_per_run_not_per_round() -> None:
    one_round = pipeline_bound([MODEL] * 4, _work(64), concurrency=64, max_microbatch_tokens=16384)
    many = pipeline_bound([MODEL] * 4, _work(64 * 32), concurrency=64, max_microbatch_tokens=16384)
    busy = one_round.busy_s[0]
    assert one_round.round_s == pytest.approx(busy + 3 * MODEL.c)
    assert many.round_s == pytest.approx(busy + 3 * MODEL.c / 32)
    assert many.tokens_per_s > one_round.tokens_per_s


def test_the_cap_forces_more_microbatches_and_each_pays_c() -> None:
    bound = pipeline_bound([MODEL] * 4, _work(256), concurrency=256, max_microbatch_tokens=16384)
    assert bound.num_microbatches == 8  # 256 x 512 = 128k new tokens / 16k
    assert bound.round_s == pytest.approx(bound.busy_s[0] + 3 * MODEL.c)  # one round


def test_fewer_requests_than_stages_pay_for_splitting() -> None:
    one = pipeline_bound([MODEL] * 4, _work(8), concurrency=1, max_microbatch_tokens=16384)
    four = pipeline_bound([MODEL] * 4, _work(8), concurrency=4, max_microbatch_tokens=16384)
    # One request at a time cannot fill four stages as well as four requests do.
    assert one.tokens_per_s < four.tokens_per_s
    assert one.num_microbatches >= 1


def test_the_slowest_stage_binds() -> None:
    slow = CostModel(c=2e-3, g=1e-8, b=2e-5, a=1e-10, label="derived", source="test")
    even = pipeline_bound([MODEL] * 4, _work(64), concurrency=64, max_microbatch_tokens=16384)
    uneven = pipeline_bound(
        [MODEL, MODEL, MODEL, slow], _work(64), concurrency=64, max_microbatch_tokens=16384
    )
    assert uneven.tokens_per_s < even.tokens_per_s
    fill_drain = [3 * MODEL.c] * 3 + [3 * MODEL.c]  # every stage: the c of the 3 others
    fill_drain[:3] = [2 * MODEL.c + slow.c] * 3
    assert uneven.round_s == pytest.approx(
        max(b + f for b, f in zip(uneven.busy_s, fill_drain, strict=True))
    )


def test_bad_arguments_name_the_field() -> None:
    with pytest.raises(ValueError, match="concurrency"):
        pipeline_bound([MODEL], _work(1), concurrency=0, max_microbatch_tokens=16)
    with pytest.raises(ValueError, match="max_microbatch_tokens"):
        pipeline_bound([MODEL], _work(1), concurrency=1, max_microbatch_tokens=0)
    with pytest.raises(ValueError, match="stage_cost_models"):
        pipeline_bound([], _work(1), concurrency=1, max_microbatch_tokens=16)
    with pytest.raises(ValueError, match="num_cached_tokens"):
        RequestWork(16, 16)


def test_ideal_cached_tokens_sum_to_the_ideal_ratio() -> None:
    workload = shared_prefix_workload(
        12, num_prefix_tokens=640, num_suffix_tokens=200, num_prefixes=3, vocab_size=1024
    )
    cached = ideal_cached_tokens(workload.prompts, 64, workload.warmup)
    total = sum(len(p) for p in workload.prompts)
    assert sum(cached) / total == pytest.approx(
        ideal_hit_ratio(workload.prompts, 64, workload.warmup)
    )
    assert all(
        0 <= c < len(p) and c % 64 == 0 for c, p in zip(cached, workload.prompts, strict=True)
    )
