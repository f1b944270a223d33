"""Tests for wavepp.runtime.planning: CostModel, fit_cost_model, ChunkPlanner.

Expected chunk lists below are derived by hand from the rules in the ChunkPlanner docstring;
the derivation sits next to each case.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wavepp.runtime.config import BaselineConfig, RuntimeConfig
from wavepp.runtime.planning import (
    Chunk,
    ChunkPlanner,
    CostModel,
    RequestProgress,
    fit_cost_model,
    planner_for,
)

# -- CostModel ----------------------------------------------------------------------------------


def test_chunk_and_microbatch_cost_follow_the_formula() -> None:
    model = CostModel(c=1.0, g=2.0, b=3.0, a=4.0)
    # g*L + b*x + a*(2*L*x + x^2) at L=5, x=7: 10 + 21 + 4*(70 + 49) = 507
    assert model.chunk_cost_s(5, 7) == pytest.approx(507.0)
    # c once per micro-batch: 1 + 507 + (0 + 3*2 + 4*4) = 530
    assert model.microbatch_cost_s([(5, 7), (0, 2)]) == pytest.approx(530.0)
    assert model.microbatch_cost_s([]) == 0.0


@pytest.mark.parametrize(
    ("field", "value"), [("c", -1.0), ("g", float("nan")), ("b", float("inf")), ("a", -1e-9)]
)
def test_cost_model_rejects_bad_coefficients(field: str, value: float) -> None:
    kwargs = {"c": 0.0, "g": 0.0, "b": 1.0, "a": 0.0, field: value}
    with pytest.raises(ValueError, match=f"CostModel.{field}"):
        CostModel(**kwargs)


def test_cost_model_rejects_unknown_label() -> None:
    with pytest.raises(ValueError, match="label"):
        CostModel(c=0, g=0, b=1, a=0, label="guessed")


@pytest.mark.parametrize(
    "model",
    [
        CostModel(c=0.0, g=0.0, b=1.0, a=0.0),
        CostModel(c=0.0, g=0.0, b=0.0, a=1.0),
        CostModel(c=1e-3, g=2.7e-7, b=1.2e-5, a=1.0e-8),
        CostModel(c=0.05, g=6e-9, b=5.3e-5, a=5.8e-11),
        CostModel(c=0.0, g=0.5, b=0.25, a=1 / 64),
    ],
)
@pytest.mark.parametrize("num_context_tokens", [0, 1, 17, 4096, 100_000])
@pytest.mark.parametrize("budget_s", [0.0, 1e-6, 0.01, 0.5, 3.0, 1e4])
def test_max_new_tokens_within_is_exact(
    model: CostModel, num_context_tokens: int, budget_s: float
) -> None:
    x = model.max_new_tokens_within(num_context_tokens, budget_s)
    assert x >= 0
    if x > 0 or model.chunk_cost_s(num_context_tokens, 0) <= budget_s:
        assert model.chunk_cost_s(num_context_tokens, x) <= budget_s
    assert model.chunk_cost_s(num_context_tokens, x + 1) > budget_s


def test_max_new_tokens_within_hand_cases() -> None:
    model = CostModel(c=0.0, g=0.0, b=1.0, a=1 / 64)
    # L=0: x + x^2/64 <= 128 -> x = 64 exactly.
    assert model.max_new_tokens_within(0, 128.0) == 64
    # L=64: 3x + x^2/64 <= 128 -> x^2 + 192x - 8192 <= 0 -> x <= 35.93.
    assert model.max_new_tokens_within(64, 128.0) == 35
    # cap applies; g*L over budget gives 0.
    assert model.max_new_tokens_within(0, 128.0, num_tokens_cap=10) == 10
    assert CostModel(c=0, g=1.0, b=1.0, a=0).max_new_tokens_within(10, 5.0) == 0


def test_max_new_tokens_within_unbounded_needs_cap() -> None:
    flat = CostModel(c=1.0, g=0.0, b=0.0, a=0.0)
    with pytest.raises(ValueError, match="num_tokens_cap"):
        flat.max_new_tokens_within(0, 1.0)
    assert flat.max_new_tokens_within(0, 1.0, num_tokens_cap=99) == 99


def test_scaled_and_dict_round_trip() -> None:
    model = CostModel(c=1.0, g=2.0, b=3.0, a=4.0, label="derived", source="x")
    doubled = model.scaled(2.0)
    assert (doubled.c, doubled.g, doubled.b, doubled.a) == (2.0, 4.0, 6.0, 8.0)
    assert doubled.label == "derived" and "x2" in doubled.source
    assert CostModel.from_dict(model.to_dict()) == model
    with pytest.raises(ValueError, match="factor"):
        model.scaled(0.0)
    with pytest.raises(ValueError, match="missing"):
        CostModel.from_dict({"c": 1.0})
    with pytest.raises(ValueError, match="unknown"):
        CostModel.from_dict({**model.to_dict(), "d": 1.0})


# -- fit_cost_model -------------------------------------------------------------------------------

TRUE_MODEL = CostModel(c=2e-3, g=1e-7, b=5e-5, a=2e-10)


def _grid_samples(model: CostModel, noise: float, seed: int) -> list[tuple[int, int, float]]:
    rng = np.random.default_rng(seed)
    samples = []
    for context in (0, 1024, 4096, 16384, 32768):
        for new in (16, 128, 512, 2048, 8192):
            seconds = model.microbatch_cost_s([(context, new)])
            samples.append((context, new, seconds * (1.0 + noise * rng.standard_normal())))
    return samples


def test_fit_recovers_exact_coefficients_without_noise() -> None:
    fitted, error = fit_cost_model(_grid_samples(TRUE_MODEL, 0.0, seed=0), source="synthetic")
    for name in ("c", "g", "b", "a"):
        assert getattr(fitted, name) == pytest.approx(getattr(TRUE_MODEL, name), rel=1e-6)
    assert error < 1e-9
    assert fitted.label == "measured" and fitted.source == "synthetic"


def test_fit_recovers_coefficients_from_noisy_samples() -> None:
    fitted, error = fit_cost_model(_grid_samples(TRUE_MODEL, 0.02, seed=1234))
    for name in ("c", "g", "b", "a"):
        assert getattr(fitted, name) == pytest.approx(getattr(TRUE_MODEL, name), rel=0.15), name
    # 2 % multiplicative noise: the relative RMS error is about 2 %.
    assert 0.005 < error < 0.04


def test_fit_keeps_coefficients_non_negative() -> None:
    # True g = 0 and noise: an unconstrained fit would give g < 0 about half the time.
    no_context = CostModel(c=1e-3, g=0.0, b=1e-5, a=1e-9)
    negatives = 0
    for seed in range(8):
        samples = _grid_samples(no_context, 0.05, seed=seed)
        design = np.array([(1.0, ctx, new, 2.0 * ctx * new + new * new) for ctx, new, _ in samples])
        times = np.array([t for *_, t in samples])
        free, *_ = np.linalg.lstsq(design / times[:, None], np.ones_like(times), rcond=None)
        negatives += int(np.any(free < 0))
        fitted, error = fit_cost_model(samples)
        assert min(fitted.c, fitted.g, fitted.b, fitted.a) >= 0.0
        assert error < 0.1
    assert negatives > 0, "the test needs a case where unconstrained least squares goes negative"


def test_fit_rejects_bad_samples() -> None:
    with pytest.raises(ValueError, match="at least 4"):
        fit_cost_model([(0, 1, 1.0)] * 3)
    with pytest.raises(ValueError, match="seconds"):
        fit_cost_model([(0, 1, 1.0)] * 3 + [(0, 2, 0.0)])
    with pytest.raises(ValueError, match="L"):
        fit_cost_model([(0, 1, 1.0)] * 3 + [(-1, 2, 1.0)])


# -- ChunkPlanner: helpers ---------------------------------------------------------------------


def _drain(
    planner: ChunkPlanner,
    requests: list[RequestProgress],
    *,
    num_stages: int = 1,
    num_inflight: int | None = None,
    max_microbatches: int = 100_000,
) -> list[list[Chunk]]:
    """Plan micro-batches until none is left. num_inflight=None: always S (no shrinking)."""
    microbatches = []
    for index in range(max_microbatches):
        inflight = num_stages if num_inflight is None else min(num_inflight + index, num_stages)
        chunks = planner.plan_microbatch(requests, num_stages=num_stages, num_inflight=inflight)
        if not chunks:
            return microbatches
        microbatches.append(chunks)
    raise AssertionError("planner did not terminate")


def _shape(microbatches: list[list[Chunk]]) -> list[list[tuple[str, int, int, bool]]]:
    return [
        [(c.request_id, c.context_offset, c.num_tokens, c.is_last) for c in mb]
        for mb in microbatches
    ]


def _assert_covers_exactly_once(
    microbatches: list[list[Chunk]], requests: list[RequestProgress], starts: dict[str, int]
) -> None:
    by_request: dict[str, list[Chunk]] = {r.request_id: [] for r in requests}
    for mb in microbatches:
        assert len({c.request_id for c in mb}) == len(mb), "one chunk per request per micro-batch"
        for chunk in mb:
            by_request[chunk.request_id].append(chunk)
    for request in requests:
        chunks = by_request[request.request_id]
        assert [c.chunk_index for c in chunks] == list(range(len(chunks)))
        position = starts[request.request_id]
        for chunk in chunks:
            assert chunk.context_offset == position and chunk.num_tokens >= 1
            position += chunk.num_tokens
            assert chunk.is_last == (position == request.num_prompt_tokens)
        assert position == request.num_prompt_tokens
        assert request.num_computed_tokens == request.num_prompt_tokens
        assert request.num_planned_chunks == len(chunks)


# -- ChunkPlanner: exact small cases -------------------------------------------------------------

LINEAR = CostModel(c=0.0, g=0.0, b=1.0, a=0.0)  # cost = new tokens: budgets read as tokens


def test_dynamic_exact_chunks_with_attention_term() -> None:
    # cost(L, x) = x + (2Lx + x^2)/64; target at chunk_tokens=64: 64 + 64 = 128.
    model = CostModel(c=0.0, g=0.0, b=1.0, a=1 / 64)
    planner = ChunkPlanner(model, policy="dynamic", chunk_tokens=64, block_size=16)
    assert planner.target_cost_s() == pytest.approx(128.0)
    request = RequestProgress("A", num_prompt_tokens=136, num_computed_tokens=0)
    microbatches = _drain(planner, [request])
    # L=0:   x + x^2/64 <= 128 -> 64.
    # L=64:  x <= 35.9 -> cut to the block boundary 96 -> 32.
    # L=96:  4x + x^2/64 <= 128 -> x <= 28.8 -> 16 (boundary 112).
    # L=112: 4.5x + x^2/64 <= 128 -> x <= 26.1 >= the 24 left -> the rest, is_last.
    assert _shape(microbatches) == [
        [("A", 0, 64, False)],
        [("A", 64, 32, False)],
        [("A", 96, 16, False)],
        [("A", 112, 24, True)],
    ]


def test_static_exact_chunks_and_packing() -> None:
    # Token budget 64 per micro-batch, FCFS, cuts rounded down to blocks of 16.
    planner = ChunkPlanner(LINEAR, policy="static", chunk_tokens=64, block_size=16)
    a = RequestProgress("A", num_prompt_tokens=100, num_computed_tokens=0)
    b = RequestProgress("B", num_prompt_tokens=40, num_computed_tokens=32)  # 8 left
    c = RequestProgress("C", num_prompt_tokens=70, num_computed_tokens=0)
    # mb0: A 64 (budget 0).
    # mb1: A rest 36 (budget 28), B rest 8 (budget 20), C min(70, 20)=20 -> cut to 16.
    # mb2: C 54 (rest, 54 <= 64).
    assert _shape(_drain(planner, [a, b, c])) == [
        [("A", 0, 64, False)],
        [("A", 64, 36, True), ("B", 32, 8, True), ("C", 0, 16, False)],
        [("C", 16, 54, True)],
    ]


def test_static_skips_a_request_that_gets_no_tokens_but_fits_a_later_short_one() -> None:
    # TRT-LLM FCFS: after A, 10 tokens of budget are left; B needs 50 -> 0 tokens (skipped);
    # C's 5 remaining tokens fit whole.
    planner = ChunkPlanner(LINEAR, policy="static", chunk_tokens=64, block_size=16)
    a = RequestProgress("A", 54, 0)
    b = RequestProgress("B", 50, 0)
    c = RequestProgress("C", 5, 0)
    first = planner.plan_microbatch([a, b, c], num_stages=1, num_inflight=1)
    assert _shape([first]) == [[("A", 0, 54, True), ("C", 0, 5, True)]]


def test_dynamic_packs_short_requests_into_one_microbatch() -> None:
    planner = ChunkPlanner(LINEAR, policy="dynamic", chunk_tokens=64, block_size=16)
    requests = [RequestProgress(f"r{i}", 10, 0) for i in range(5)]
    microbatches = _drain(planner, requests)
    # 5 x 10 = 50 tokens <= 64: one micro-batch, all prompts finish.
    assert _shape(microbatches) == [[(f"r{i}", 0, 10, True) for i in range(5)]]


def test_dynamic_cuts_the_last_chunk_and_closes_the_microbatch() -> None:
    planner = ChunkPlanner(LINEAR, policy="dynamic", chunk_tokens=64, block_size=16)
    a = RequestProgress("A", 40, 0)
    b = RequestProgress("B", 100, 0)
    c = RequestProgress("C", 3, 0)
    # mb0: A 40 (24 left), B cut to 16 (block boundary), close (C waits: FIFO).
    # mb1: B 64 (boundary 80). mb2: B rest 20, C 3.
    assert _shape(_drain(planner, [a, b, c])) == [
        [("A", 0, 40, True), ("B", 0, 16, False)],
        [("B", 16, 64, False)],
        [("B", 80, 20, True), ("C", 0, 3, True)],
    ]


def test_chunk_boundaries_are_blocks_from_a_cached_prefix() -> None:
    planner = ChunkPlanner(LINEAR, policy="dynamic", chunk_tokens=48, block_size=16)
    request = RequestProgress("A", num_prompt_tokens=150, num_computed_tokens=32)  # L* = 2
    assert _shape(_drain(planner, [request])) == [
        [("A", 32, 48, False)],
        [("A", 80, 48, False)],
        [("A", 128, 22, True)],
    ]


def test_progress_is_guaranteed_when_overhead_exceeds_the_target() -> None:
    # g*L alone is above the target at L=64: still one block per micro-batch.
    model = CostModel(c=0.0, g=10.0, b=1.0, a=0.0)
    planner = ChunkPlanner(model, policy="dynamic", chunk_tokens=32, block_size=16)
    request = RequestProgress("A", 100, 64)
    assert _shape(_drain(planner, [request])) == [
        [("A", 64, 16, False)],
        [("A", 80, 16, False)],
        [("A", 96, 4, True)],
    ]


def test_max_chunks_per_microbatch() -> None:
    planner = ChunkPlanner(
        LINEAR, policy="dynamic", chunk_tokens=64, block_size=16, max_chunks_per_microbatch=2
    )
    requests = [RequestProgress(f"r{i}", 4, 0) for i in range(5)]
    assert [len(mb) for mb in _drain(planner, requests)] == [2, 2, 1]


# -- at least S micro-batches in flight --------------------------------------------------------


def test_at_least_num_stages_microbatches_when_work_is_short() -> None:
    planner = ChunkPlanner(LINEAR, policy="dynamic", chunk_tokens=8192, block_size=16)
    request = RequestProgress("A", 64, 0)
    # idle = 4 - 0: target = 64/4 = 16 tokens; then 48/3, 32/2, 16/1.
    microbatches = _drain(planner, [request], num_stages=4, num_inflight=0)
    assert [[c.num_tokens for c in mb] for mb in microbatches] == [[16], [16], [16], [16]]


def test_at_least_rule_off_while_more_work_is_queued() -> None:
    """Requests on their way to admission will fill the idle stages: no cut (each cut pays c,
    and in a closed loop the cut persists)."""
    planner = ChunkPlanner(LINEAR, policy="dynamic", chunk_tokens=8192, block_size=16)
    request = RequestProgress("A", 64, 0)
    chunks = planner.plan_microbatch([request], num_stages=4, num_inflight=0, more_work_queued=True)
    assert [c.num_tokens for c in chunks] == [64]


def test_at_least_rule_off_when_pipeline_is_full() -> None:
    planner = ChunkPlanner(LINEAR, policy="dynamic", chunk_tokens=8192, block_size=16)
    request = RequestProgress("A", 64, 0)
    microbatches = _drain(planner, [request], num_stages=4, num_inflight=None)
    assert [[c.num_tokens for c in mb] for mb in microbatches] == [[64]]


def test_at_least_rule_never_goes_below_one_block() -> None:
    planner = ChunkPlanner(LINEAR, policy="dynamic", chunk_tokens=8192, block_size=16)
    request = RequestProgress("A", 20, 0)
    # idle 4: share 5 tokens < one block: 16, then the rest 4.
    microbatches = _drain(planner, [request], num_stages=4, num_inflight=0)
    assert [[c.num_tokens for c in mb] for mb in microbatches] == [[16], [4]]


def test_at_least_rule_accounts_for_the_fixed_cost() -> None:
    # c is paid per micro-batch: target = c + W/idle = 10 + 64/4; chunk budget 16 tokens.
    model = CostModel(c=10.0, g=0.0, b=1.0, a=0.0)
    planner = ChunkPlanner(model, policy="dynamic", chunk_tokens=8192, block_size=16)
    first = planner.plan_microbatch([RequestProgress("A", 64, 0)], num_stages=4, num_inflight=0)
    assert [c.num_tokens for c in first] == [16]


def test_static_does_not_shrink_unless_asked() -> None:
    baseline = ChunkPlanner(LINEAR, policy="static", chunk_tokens=8192, block_size=16)
    first = baseline.plan_microbatch([RequestProgress("A", 64, 0)], num_stages=4, num_inflight=0)
    assert [c.num_tokens for c in first] == [64]
    filled = ChunkPlanner(
        LINEAR, policy="static", chunk_tokens=8192, block_size=16, fill_idle_stages=True
    )
    first = filled.plan_microbatch([RequestProgress("A", 64, 0)], num_stages=4, num_inflight=0)
    assert [c.num_tokens for c in first] == [16]


# -- balance: dynamic micro-batches cost the same, static ones grow -------------------------------

ATTENTION_HEAVY = CostModel(c=1e-3, g=1e-8, b=1e-5, a=1e-9)


def _costs(planner: ChunkPlanner, microbatches: list[list[Chunk]]) -> list[float]:
    return [planner.microbatch_cost_s(mb) for mb in microbatches]


def test_dynamic_microbatch_costs_are_balanced_on_a_long_prompt() -> None:
    planner = ChunkPlanner(ATTENTION_HEAVY, policy="dynamic", chunk_tokens=8192, block_size=16)
    request = RequestProgress("long", 65536, 0)
    microbatches = _drain(planner, [request])
    costs = _costs(planner, microbatches)[:-1]  # the last one holds what is left
    assert len(costs) >= 5
    # Within one block's cost (~1.5 % of the target at L = 64k) of the target, never above it.
    target = planner.target_cost_s()
    assert max(costs) <= target * (1 + 1e-12)
    assert min(costs) >= 0.97 * target
    assert max(costs) / min(costs) < 1.03
    sizes = [mb[0].num_tokens for mb in microbatches]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > 3 * sizes[-2]


def test_static_microbatch_costs_grow_with_context() -> None:
    planner = ChunkPlanner(ATTENTION_HEAVY, policy="static", chunk_tokens=8192, block_size=16)
    request = RequestProgress("long", 65536, 0)
    microbatches = _drain(planner, [request])
    costs = _costs(planner, microbatches)
    assert all(len(mb) == 1 and mb[0].num_tokens == 8192 for mb in microbatches)
    assert costs == sorted(costs)
    # Last chunk at L = 57344: b*x + a*(2Lx + x^2) ~ 1.09 s vs ~0.15 s for the first.
    assert costs[-1] / costs[0] > 5


def test_per_stage_models_budget_against_the_slowest() -> None:
    compute_heavy = CostModel(c=0.0, g=0.0, b=2.0, a=0.0)
    attention_heavy = CostModel(c=0.0, g=0.0, b=1.0, a=1 / 64)
    planner = ChunkPlanner(
        [compute_heavy, attention_heavy], policy="dynamic", chunk_tokens=64, block_size=16
    )
    # target = max(128, 128) = 128. L=0: stage 0 allows 64, stage 1 allows 64 -> 64.
    # L=64: stage 0 allows 64, stage 1 allows 35 -> cut to 32.
    request = RequestProgress("A", 200, 0)
    first = planner.plan_microbatch([request], num_stages=2, num_inflight=2)
    second = planner.plan_microbatch([request], num_stages=2, num_inflight=2)
    assert [c.num_tokens for c in first + second] == [64, 32]


# -- validation -----------------------------------------------------------------------------------


def test_planner_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="policy"):
        ChunkPlanner(LINEAR, policy="fixed")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chunk_tokens"):
        ChunkPlanner(LINEAR, policy="static", chunk_tokens=100, block_size=16)
    planner = ChunkPlanner(LINEAR, policy="dynamic", chunk_tokens=64, block_size=16)
    with pytest.raises(ValueError, match="num_stages"):
        planner.plan_microbatch([], num_stages=0, num_inflight=0)
    with pytest.raises(ValueError, match="duplicate"):
        planner.plan_microbatch(
            [RequestProgress("A", 5, 0), RequestProgress("A", 5, 0)], num_stages=1, num_inflight=0
        )
    with pytest.raises(ValueError, match="num_prompt_tokens - 1"):
        planner.plan_microbatch([RequestProgress("A", 32, 32)], num_stages=1, num_inflight=0)
    with pytest.raises(ValueError, match="num_computed_tokens"):
        RequestProgress("A", 5, 6)


def test_no_work_returns_empty() -> None:
    planner = ChunkPlanner(LINEAR, policy="dynamic", chunk_tokens=64, block_size=16)
    assert planner.plan_microbatch([], num_stages=2, num_inflight=0) == []
    done = RequestProgress("A", 5, 5, num_planned_chunks=1)
    assert planner.plan_microbatch([done], num_stages=2, num_inflight=0) == []


# -- property: every prompt is covered exactly once, in order -------------------------------------

_block_sizes = st.sampled_from([1, 4, 16])


@st.composite
def _scenarios(draw: st.DrawFn) -> tuple[ChunkPlanner, list[RequestProgress], int, int]:
    block_size = draw(_block_sizes)
    chunk_tokens = block_size * draw(st.integers(1, 64))
    model = CostModel(
        c=draw(st.sampled_from([0.0, 1e-3, 0.1])),
        g=draw(st.sampled_from([0.0, 1e-7, 1e-3])),
        b=draw(st.sampled_from([1e-5, 1e-3])),
        a=draw(st.sampled_from([0.0, 1e-9, 1e-5])),
    )
    planner = ChunkPlanner(
        model,
        policy=draw(st.sampled_from(["dynamic", "static"])),
        chunk_tokens=chunk_tokens,
        block_size=block_size,
        max_chunks_per_microbatch=draw(st.integers(1, 8)),
        fill_idle_stages=draw(st.sampled_from([None, True, False])),
    )
    requests = []
    for index in range(draw(st.integers(1, 8))):
        num_prompt_tokens = draw(st.integers(1, 600))
        num_cached_blocks = draw(st.integers(0, (num_prompt_tokens - 1) // block_size))
        requests.append(
            RequestProgress(f"r{index}", num_prompt_tokens, num_cached_blocks * block_size)
        )
    return planner, requests, draw(st.integers(1, 5)), draw(st.integers(0, 5))


@settings(max_examples=200, deadline=None)
@given(_scenarios())
def test_chunks_cover_every_prompt_exactly_once_in_order(
    scenario: tuple[ChunkPlanner, list[RequestProgress], int, int],
) -> None:
    planner, requests, num_stages, num_inflight = scenario
    starts = {r.request_id: r.num_computed_tokens for r in requests}
    microbatches = _drain(planner, requests, num_stages=num_stages, num_inflight=num_inflight)
    _assert_covers_exactly_once(microbatches, requests, starts)
    for mb in microbatches:
        assert 1 <= len(mb) <= planner.max_chunks_per_microbatch
        for chunk in mb:
            if not chunk.is_last:
                assert (chunk.context_offset + chunk.num_tokens) % planner.block_size == 0
        if planner.policy == "static":
            assert sum(c.num_tokens for c in mb) <= max(planner.chunk_tokens, planner.block_size)
        elif len(mb) > 1 or mb[0].num_tokens > planner.block_size:
            # Beyond the one-block progress rule, a dynamic micro-batch stays within target.
            assert planner.microbatch_cost_s(mb) <= planner.target_cost_s() * (1 + 1e-9)
    if planner.policy == "dynamic":
        _assert_fifo_starts(microbatches)
    assert not math.isnan(sum(planner.microbatch_cost_s(mb) for mb in microbatches))


def _assert_fifo_starts(microbatches: list[list[Chunk]]) -> None:
    """Dynamic: a request never starts before an earlier one (static may, as TRT-LLM FCFS)."""
    first_seen = []
    for mb in microbatches:
        for chunk in mb:
            if chunk.chunk_index == 0:
                first_seen.append(int(chunk.request_id[1:]))
    assert first_seen == sorted(first_seen)


# ---- closed-loop target, largest micro-batch, slivers ---------------------------------------


def test_the_closed_loop_target_replaces_chunk_tokens_and_the_at_least_s_rule() -> None:
    # LINEAR: a budget in seconds reads as tokens. chunk_tokens 8192 would take all 4 x 512;
    # a target of 1024 (c = 0) takes two requests per micro-batch.
    planner = ChunkPlanner(LINEAR, policy="dynamic", chunk_tokens=8192, block_size=16)
    requests = [RequestProgress(f"r{i}", 512, 0) for i in range(4)]
    chunks = planner.plan_microbatch(
        requests, num_stages=4, num_inflight=0, more_work_queued=True, target_cost_s=1024.0
    )
    assert [(c.request_id, c.num_tokens) for c in chunks] == [("r0", 512), ("r1", 512)]
    with pytest.raises(ValueError, match="target_cost_s"):
        planner.plan_microbatch(requests, num_stages=4, num_inflight=0, target_cost_s=0.0)


def test_a_small_leftover_rides_along_instead_of_travelling_alone() -> None:
    planner = ChunkPlanner(LINEAR, policy="dynamic", chunk_tokens=8192, block_size=16)
    # Target 1000 tokens: r0 takes 512, r1 would be cut to 480 leaving 32 (3% of the budget,
    # under SLIVER_FRACTION): it rides along whole.
    requests = [RequestProgress("r0", 512, 0), RequestProgress("r1", 512, 0)]
    chunks = planner.plan_microbatch(requests, num_stages=4, num_inflight=0, target_cost_s=1000.0)
    assert [(c.request_id, c.num_tokens) for c in chunks] == [("r0", 512), ("r1", 512)]
    # A large leftover is still cut at a block boundary.
    requests = [RequestProgress("r0", 512, 0), RequestProgress("r1", 2048, 0)]
    chunks = planner.plan_microbatch(requests, num_stages=4, num_inflight=0, target_cost_s=1000.0)
    assert [(c.request_id, c.num_tokens) for c in chunks] == [("r0", 512), ("r1", 480)]


@pytest.mark.parametrize("policy", ["dynamic", "static"])
def test_no_microbatch_exceeds_the_engines_largest(policy: str) -> None:
    planner = ChunkPlanner(
        LINEAR, policy=policy, chunk_tokens=8192, block_size=16, max_microbatch_tokens=1024
    )
    requests = [RequestProgress(f"r{i}", 700, 0) for i in range(4)]
    microbatches: list[list[Chunk]] = []
    while not all(r.is_fully_planned for r in requests):
        chunks = planner.plan_microbatch(
            requests, num_stages=4, num_inflight=0, more_work_queued=True, target_cost_s=1e9
        )
        microbatches.append(chunks)
    assert all(sum(c.num_tokens for c in mb) <= 1024 for mb in microbatches)
    assert sum(c.num_tokens for mb in microbatches for c in mb) == 4 * 700
    with pytest.raises(ValueError, match="max_microbatch_tokens"):
        ChunkPlanner(LINEAR, policy=policy, block_size=16, max_microbatch_tokens=8)


def test_only_a_cut_request_rides_along_and_the_microbatch_then_closes() -> None:
    # Target 1000 tokens (LINEAR: seconds read as tokens), requests of 100 tokens: each whole
    # request costs 10% of the budget, under SLIVER_FRACTION. Ten fill the micro-batch; the
    # eleventh gets no tokens and must wait, not ride along (found: a ramp-up micro-batch took
    # 15 requests of a target of 8, each "leftover" being a whole request).
    planner = ChunkPlanner(LINEAR, policy="dynamic", chunk_tokens=8192, block_size=4)
    requests = [RequestProgress(f"r{i}", 100, 0) for i in range(20)]
    chunks = planner.plan_microbatch(requests, num_stages=4, num_inflight=0, target_cost_s=1000.0)
    assert [c.num_tokens for c in chunks] == [100] * 10


def test_a_cut_one_block_further_stays_within_the_chunk_tokens_target() -> None:
    # At-least-S (2 idle stages) lowers the target to c + W/2 = 5.5e-5 s; r0 (9 tokens) is cut
    # at 4 and then one block further to lessen its pieces. That block must not take the chunk
    # past the chunk_tokens target (8 tokens = 8e-5 s): 8 tokens, not the whole 9.
    model = CostModel(c=0.0, g=1e-3, b=1e-5, a=0.0)
    planner = ChunkPlanner(
        model,
        policy="dynamic",
        chunk_tokens=8,
        block_size=4,
        max_chunks_per_microbatch=1,
        fill_idle_stages=True,
    )
    requests = [
        RequestProgress("r0", 9, 0),
        RequestProgress("r1", 1, 0),
        RequestProgress("r2", 1, 0),
    ]
    first = planner.plan_microbatch(requests, num_stages=2, num_inflight=0)
    assert [(c.request_id, c.num_tokens) for c in first] == [("r0", 8)]
    assert planner.microbatch_cost_s(first) <= planner.target_cost_s() * (1 + 1e-9)


# -- the baseline's planning switches (planner policy) -------------------------------------------


def test_the_dynamic_policy_refuses_inexact_budget_accounting() -> None:
    with pytest.raises(ValueError, match="budget_accounting='none'.*dynamic"):
        ChunkPlanner(LINEAR, policy="dynamic", budget_accounting="none")
    with pytest.raises(ValueError, match="budget_accounting='rough'"):
        ChunkPlanner(LINEAR, policy="static", budget_accounting="rough")  # type: ignore[arg-type]


def test_one_chunk_inflight_holds_a_request_back_while_its_chunk_runs() -> None:
    held = ChunkPlanner(LINEAR, policy="static", one_chunk_inflight=True)
    free = ChunkPlanner(LINEAR, policy="static")
    assert held.may_cut(0) and not held.may_cut(1)
    assert free.may_cut(0) and free.may_cut(3)


@pytest.mark.parametrize(
    ("mode", "chunk_policy", "accounting", "one_chunk"),
    [
        ("wave", None, "exact", False),  # the baseline's switches are off in wave mode
        ("sync", None, "none", True),
        ("sync", "dynamic", "exact", True),  # the dynamic policy always accounts exactly
    ],
)
def test_planner_for_applies_the_baseline_switches_as_the_config_resolves_them(
    mode: str, chunk_policy: str | None, accounting: str, one_chunk: bool
) -> None:
    config = RuntimeConfig(
        mode=mode,
        chunk_policy=chunk_policy,
        baseline=BaselineConfig(budget_accounting="none", one_chunk_inflight=True),
    )
    planner = planner_for(config, LINEAR)
    assert (planner.budget_accounting, planner.one_chunk_inflight) == (accounting, one_chunk)
