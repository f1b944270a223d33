"""The tie-aware comparison of two greedy decodes (wavepp.bench.greedy_agreement): pure."""

from __future__ import annotations

import pytest

from wavepp.bench.greedy_agreement import (
    NOISE_CEILING,
    TIE_MARGIN_FACTOR,
    agreement,
    compare_greedy,
    first_divergence,
    matched_logprob_noise,
)

# Two runs of 3 steps; the reference picks 5 then 7 then 9.
REF_TOKENS = [5, 7, 9]
REF_LOGPROBS = [
    {5: -0.10, 6: -3.0},
    {7: -0.60, 8: -0.62, 4: -4.0},  # 7 and 8 nearly tied (gap 0.02)
    {9: -0.01, 3: -5.0},
]


def test_first_divergence() -> None:
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 4, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    assert first_divergence([], []) is None


def test_equal_sequences_are_equal() -> None:
    verdict = compare_greedy(REF_TOKENS, REF_LOGPROBS, REF_TOKENS, REF_LOGPROBS, margin=0.0)
    assert verdict.kind == "equal" and verdict.step is None


def test_a_divergence_at_a_near_tie_is_not_a_mismatch() -> None:
    tokens = [5, 8, 2]  # parts at step 1 on the 7/8 tie; later steps are not compared
    logprobs = [{5: -0.11, 6: -3.0}, {8: -0.59, 7: -0.61}, {2: -0.1}]
    verdict = compare_greedy(tokens, logprobs, REF_TOKENS, REF_LOGPROBS, margin=0.05)
    assert verdict.kind == "near_tie" and verdict.step == 1
    assert verdict.gap == pytest.approx(0.02)


def test_a_divergence_at_a_clear_gap_is_a_mismatch() -> None:
    tokens = [6, 7, 9]  # the reference's 5 beats 6 by 2.9
    logprobs = [{6: -0.1, 5: -0.2}, {7: -0.6}, {9: -0.01}]
    verdict = compare_greedy(tokens, logprobs, REF_TOKENS, REF_LOGPROBS, margin=0.05)
    assert verdict.kind == "mismatch" and verdict.step == 0
    assert verdict.gap == pytest.approx(2.9) and "margin" in verdict.reason
    # the same divergence is a tie under a margin above its gap
    assert compare_greedy(tokens, logprobs, REF_TOKENS, REF_LOGPROBS, margin=3.0).kind == (
        "near_tie"
    )


def test_a_token_outside_the_other_runs_top_k_is_a_mismatch() -> None:
    outside = [5, 1, 9]  # 1 is not among the reference's tokens at step 1
    logprobs = [{5: -0.1}, {1: -0.5, 7: -0.6}, {9: -0.01}]
    verdict = compare_greedy(outside, logprobs, REF_TOKENS, REF_LOGPROBS, margin=10.0)
    assert verdict.kind == "mismatch" and "not in the reference's top-k" in verdict.reason
    # the reference's token missing from this run's top-k is a mismatch too
    tokens = [5, 8, 9]
    logprobs = [{5: -0.1}, {8: -0.5, 4: -0.6}, {9: -0.01}]
    verdict = compare_greedy(tokens, logprobs, REF_TOKENS, REF_LOGPROBS, margin=10.0)
    assert verdict.kind == "mismatch" and "reference token 7 not in the top-k" in verdict.reason


def test_a_short_or_empty_run_is_a_mismatch() -> None:
    assert compare_greedy([5], [{5: -0.1}], REF_TOKENS, REF_LOGPROBS, 1.0).kind == "mismatch"
    assert compare_greedy([], [], REF_TOKENS, REF_LOGPROBS, 1.0).reason.startswith("lengths")
    with pytest.raises(ValueError, match="margin=-1"):
        compare_greedy(REF_TOKENS, REF_LOGPROBS, REF_TOKENS, REF_LOGPROBS, -1.0)


def test_noise_counts_only_matched_steps_and_common_tokens() -> None:
    # step 0: |-0.13 - -0.10| = 0.03 on token 5; token 4 only here; the differing step 1 and
    # what follows are excluded, however far apart
    tokens = [5, 8, 9]
    logprobs = [{5: -0.13, 6: -3.01, 4: -1.0}, {8: -0.2, 7: -9.0}, {9: -3.0}]
    assert matched_logprob_noise(tokens, logprobs, REF_TOKENS, REF_LOGPROBS) == pytest.approx(0.03)
    assert matched_logprob_noise(REF_TOKENS, REF_LOGPROBS, REF_TOKENS, REF_LOGPROBS) == 0.0


def test_agreement_derives_the_margin_from_the_measured_noise() -> None:
    reference = {"a": (REF_TOKENS, REF_LOGPROBS), "b": (REF_TOKENS, REF_LOGPROBS)}
    runs = {
        # matches, its logprobs off by at most 0.015: the noise
        "a": (REF_TOKENS, [{5: -0.115, 6: -3.0}, {7: -0.6, 8: -0.62}, {9: -0.01}]),
        # parts at step 1 on the 0.02 gap, under 2 * 0.015
        "b": ([5, 8, 9], [{5: -0.1}, {8: -0.6, 7: -0.61}, {9: -0.01}]),
    }
    result = agreement(runs, reference, ceiling=0.1)
    assert result.noise == pytest.approx(0.015)
    assert result.margin == pytest.approx(TIE_MARGIN_FACTOR * 0.015)
    assert result.ceiling == 0.1 and not result.noise > result.ceiling
    assert agreement(runs, reference).ceiling == NOISE_CEILING
    assert (result.strict_mismatches, result.mismatches, result.near_ties) == (1, 0, 1)
    # less noise: the same 0.02 gap is above the margin, a mismatch
    quiet = dict(runs, a=(REF_TOKENS, REF_LOGPROBS))
    strict = agreement(quiet, reference, ceiling=0.1)
    assert strict.margin == 0.0 and (strict.mismatches, strict.near_ties) == (1, 0)
    # a request without a run is a mismatch
    missing = agreement({"a": runs["a"]}, reference)
    assert missing.verdicts["b"].kind == "mismatch" and missing.mismatches == 1
    with pytest.raises(ValueError, match="factor=-2"):
        agreement(runs, reference, factor=-2.0)
    with pytest.raises(ValueError, match="ceiling=-1"):
        agreement(runs, reference, ceiling=-1.0)


def test_noise_above_the_ceiling_grants_no_tie() -> None:
    """A reference that computes something else makes the measured noise large; the margin it
    would give must not turn real divergences into ties."""
    reference = {"a": (REF_TOKENS, REF_LOGPROBS), "b": (REF_TOKENS, REF_LOGPROBS)}
    runs = {
        "a": (REF_TOKENS, [{5: -0.4, 6: -3.0}, {7: -0.6, 8: -0.62}, {9: -0.01}]),  # 0.3 off
        "b": ([5, 8, 9], [{5: -0.1}, {8: -0.6, 7: -0.61}, {9: -0.01}]),  # parts on 0.02
    }
    wide = agreement(runs, reference, ceiling=1.0)
    assert not wide.noise > wide.ceiling and wide.near_ties == 1 and wide.mismatches == 0
    result = agreement(runs, reference, ceiling=0.1)
    assert result.noise == pytest.approx(0.3) and result.noise > result.ceiling
    assert result.margin == 0.0 and (result.mismatches, result.near_ties) == (1, 0)
    assert result.verdicts["b"].kind == "mismatch"


def test_a_request_empty_on_both_sides_is_a_mismatch() -> None:
    """Two runs that decoded nothing (both engines failed the request) agree on nothing."""
    assert compare_greedy([], [], [], [], 1.0).kind == "mismatch"
    result = agreement({}, {"a": ((), ())})
    assert result.verdicts["a"].kind == "mismatch" and result.mismatches == 1


def test_a_run_without_a_reference_is_a_mismatch() -> None:
    """A request the reference did not answer is judged, not dropped from the count."""
    runs = {"a": (REF_TOKENS, REF_LOGPROBS), "b": (REF_TOKENS, REF_LOGPROBS)}
    result = agreement(runs, {"a": (REF_TOKENS, REF_LOGPROBS)})
    assert set(result.verdicts) == {"a", "b"}
    assert result.verdicts["b"].kind == "mismatch" and result.mismatches == 1


def test_a_nan_logprob_is_no_tie_and_no_quiet_noise() -> None:
    """A NaN gap is not 'at most the margin', and a NaN at a matched step is not 0 noise."""
    nan = float("nan")
    tokens = [5, 8, 9]
    logprobs = [{5: -0.1}, {8: -0.6, 7: -0.61}, {9: -0.01}]
    ref_logprobs = [REF_LOGPROBS[0], {7: nan, 8: -0.62}, REF_LOGPROBS[2]]
    verdict = compare_greedy(tokens, logprobs, REF_TOKENS, ref_logprobs, margin=1.0)
    assert verdict.kind == "mismatch"
    noisy = [{5: nan, 6: -3.0}, *REF_LOGPROBS[1:]]
    assert matched_logprob_noise(REF_TOKENS, noisy, REF_TOKENS, REF_LOGPROBS) != 0.0
