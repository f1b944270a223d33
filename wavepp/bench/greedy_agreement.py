"""Tie-aware comparison of two greedy decodes of the same prompt by two implementations
(a decode from handed-over KV and the reference's own prefill + decode); pure, no I/O.

Each run is its tokens and, per decoded step, the log-probabilities the engine reported for its
top k tokens and the sampled one (``{token: logprob}``, natural log of the softmax). Two float32
implementations differ by rounding; greedy decoding then parts where the top two tokens are
nearly tied. Following the rule of vLLM's model tests (``check_logprobs_close``: at the first
differing step each run's token must be among the other run's top-k logprobs; later steps are
not compared, the runs condition on different tokens), with one more condition: the
reference's logprob gap between its token and the other run's is at most ``margin``.

The margin comes from measured noise: ``noise`` is the largest |logprob difference| of one
token at one step between the runs, over every matched step (a step before the runs' first
differing token) of every request, for the tokens both runs report there. If each logprob of
either run is within ``noise`` of the other's, a flip of two tokens needs the reference's gap
between them to be at most ``2 * noise`` (its gap ``g`` and the other run's reversed gap ``g'``
sum to the difference of the two tokens' logprob differences, each at most ``noise``):
``TIE_MARGIN_FACTOR`` is that 2.

A margin measured this way grows with any difference between the runs, a wrong cache included,
so it is only granted while the noise looks like float32 rounding: above ``NOISE_CEILING`` the
margin is 0 and every divergence is a mismatch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

TIE_MARGIN_FACTOR = 2.0
"""``margin = TIE_MARGIN_FACTOR * noise`` (module docstring: the two tokens' logprobs may each
move by the noise)."""

NOISE_CEILING = 1e-3
"""Nats: the largest matched-step noise still taken for float32 rounding between two
implementations of one model. Rounding of the benchmark's float32 checkpoints stays some 50
times below it (docs/bench/pd_handoff.md); a reference that computes a different cache does not
(a mis-rotated RoPE there: hundreds of times above)."""

Logprobs = Sequence[Mapping[int, float]]
"""Per decoded step, ``{token: logprob}`` of the top k and the sampled token."""


@dataclass(frozen=True)
class Verdict:
    """One request: ``kind`` is ``equal`` (same tokens), ``near_tie`` (parted at ``step`` on a
    near-tie) or ``mismatch`` (``reason`` names why). ``gap``: the reference's logprob of its
    token minus that of the other run's token at ``step`` (None where not both reported)."""

    kind: Literal["equal", "near_tie", "mismatch"]
    step: int | None = None
    gap: float | None = None
    reason: str = ""


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first step where ``a`` and ``b`` differ (a length difference counts at the shorter's
    end); None when equal."""
    for step, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return step
    return None if len(a) == len(b) else min(len(a), len(b))


def matched_logprob_noise(
    tokens: Sequence[int],
    logprobs: Logprobs,
    ref_tokens: Sequence[int],
    ref_logprobs: Logprobs,
) -> float:
    """The largest |logprob difference| of one token at one step between the two runs over the
    steps before their first divergence, for the tokens both report at that step (0.0 where
    none; infinite where a difference is not a number: a NaN logprob is no float32 rounding)."""
    end = first_divergence(tokens, ref_tokens)
    end = min(len(tokens), len(ref_tokens)) if end is None else end
    end = min(end, len(logprobs), len(ref_logprobs))
    worst = 0.0
    for step in range(end):
        mine, theirs = logprobs[step], ref_logprobs[step]
        for token in mine.keys() & theirs.keys():
            diff = abs(mine[token] - theirs[token])
            worst = math.inf if math.isnan(diff) else max(worst, diff)
    return worst


def compare_greedy(
    tokens: Sequence[int],
    logprobs: Logprobs,
    ref_tokens: Sequence[int],
    ref_logprobs: Logprobs,
    margin: float,
) -> Verdict:
    """The verdict on one request (module docstring). A divergence is a near-tie when each run's
    token is among the other's reported tokens at that step and the reference's gap between the
    two is at most ``margin`` (a gap that is not a number is not); anything else that differs
    is a mismatch, and so are two runs that both decoded no token.

    Raises:
        ValueError: ``margin`` is negative or not finite.
    """
    if not 0.0 <= margin < float("inf"):
        raise ValueError(f"margin={margin}: must be a finite logprob gap >= 0")
    step = first_divergence(tokens, ref_tokens)
    if not tokens and not ref_tokens:
        return Verdict("mismatch", 0, reason="neither run decoded a token")
    if step is None:
        return Verdict("equal")
    if step >= min(len(tokens), len(ref_tokens)):
        return Verdict(
            "mismatch", step, reason=f"lengths differ ({len(tokens)} vs {len(ref_tokens)})"
        )
    if step >= len(logprobs) or step >= len(ref_logprobs):
        return Verdict("mismatch", step, reason="no logprobs at the differing step")
    mine, theirs = logprobs[step], ref_logprobs[step]
    token, ref_token = tokens[step], ref_tokens[step]
    if token not in theirs:
        return Verdict("mismatch", step, reason=f"token {token} not in the reference's top-k")
    if ref_token not in mine:
        return Verdict("mismatch", step, reason=f"reference token {ref_token} not in the top-k")
    gap = theirs[ref_token] - theirs[token]
    if not gap <= margin:
        return Verdict(
            "mismatch", step, gap, reason=f"reference gap {gap:.3g} > margin {margin:.3g}"
        )
    return Verdict("near_tie", step, gap)


@dataclass(frozen=True)
class Agreement:
    """Over all requests: ``noise`` (largest matched-step |logprob difference|), ``margin``
    (``factor * noise``, or 0 where ``noise`` exceeds ``ceiling``) and each request's
    verdict."""

    noise: float
    margin: float
    ceiling: float
    verdicts: Mapping[str, Verdict]

    @property
    def strict_mismatches(self) -> int:
        """Requests whose tokens differ at all."""
        return sum(1 for v in self.verdicts.values() if v.kind != "equal")

    @property
    def mismatches(self) -> int:
        """Requests that differ other than by a near-tie."""
        return sum(1 for v in self.verdicts.values() if v.kind == "mismatch")

    @property
    def near_ties(self) -> int:
        """Requests that part on a near-tie."""
        return sum(1 for v in self.verdicts.values() if v.kind == "near_tie")


def agreement(
    runs: Mapping[str, tuple[Sequence[int], Logprobs]],
    reference: Mapping[str, tuple[Sequence[int], Logprobs]],
    factor: float = TIE_MARGIN_FACTOR,
    ceiling: float = NOISE_CEILING,
) -> Agreement:
    """Compare every request of ``reference`` or ``runs`` (id -> (tokens, logprobs)) with its
    counterpart (a request missing on one side counts as an empty run there: a mismatch). The
    noise is measured over all requests' matched steps, then each request is judged with
    ``margin = factor * noise``, or 0 where the noise exceeds ``ceiling``.

    Raises:
        ValueError: ``factor`` or ``ceiling`` is negative or not finite.
    """
    if not 0.0 <= factor < float("inf"):
        raise ValueError(f"factor={factor}: must be finite and >= 0")
    if not 0.0 <= ceiling < float("inf"):
        raise ValueError(f"ceiling={ceiling}: must be finite and >= 0")
    empty: tuple[Sequence[int], Logprobs] = ((), ())
    ids = [*reference, *(rid for rid in runs if rid not in reference)]
    pairs = {rid: (*runs.get(rid, empty), *reference.get(rid, empty)) for rid in ids}
    noise = max((matched_logprob_noise(*pair) for pair in pairs.values()), default=0.0)
    margin = factor * noise if noise <= ceiling else 0.0
    verdicts = {rid: compare_greedy(*pair, margin) for rid, pair in pairs.items()}
    return Agreement(noise, margin, ceiling, verdicts)
