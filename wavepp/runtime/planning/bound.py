"""The physical bound on closed-loop prefill throughput of an S-stage pipeline.

Derivation: ``docs/bench/bound.md``. In short, for N requests replayed in a closed loop with C in
flight, request i having P_i prompt tokens of which L_i are cached (reused) and n_i = P_i - L_i
new, and stage s costing t_s(L, x) = c_s + g_s*L + b_s*x + a_s*(2*L*x + x^2) per micro-batch
(c_s once per micro-batch, the rest once per chunk; docs/design.md 'Cost model'):

- The loop runs R = N / C rounds; in one round every in-flight request is prefilled once. A
  round's new tokens, n_round = C * mean(n_i), travel in m micro-batches, each at most
  ``max_microbatch_tokens`` new tokens, so m >= m_min = ceil(n_round / cap).
- Chunk work per round on stage s, W_s(m) = (C / N) * sum_i w_s(i) + extra_s(m), where
  w_s(i) = b_s*n_i + a_s*(P_i^2 - L_i^2) + g_s*L_i is request i as one chunk (the attention term
  does not depend on how a prompt is cut; only c and g*L do), and extra_s(m) =
  max(0, m - C) * g_s * min_i L_i: beyond one chunk per request, each further chunk starts at
  a context of at least min_i L_i.
- Every stage runs every micro-batch: a round takes at least max_s (m*c_s + W_s(m)) (busy time
  of the busiest stage). A request's last micro-batch crosses all S stages after the round's
  other work entered the pipe, so a round also takes at least sum_s (c_s + W_s(m) / m) (one
  average micro-batch through every stage).
- Fill and drain: stage s works only after a micro-batch crossed the stages before it, and its
  last micro-batch then crosses the stages after it, at least c on each: T >= R * busy_s +
  sum_{s' != s} c_s'.
- T >= min over m >= m_min of max(max_s (R * busy_s(m) + fill/drain_s), R * crossing(m)).
  Throughput <= sum_i P_i / T.

With m = S and C*n large this is the picture of docs/design.md ('The physical bound'): S equal micro-batches that hold all
in-flight new tokens, back to back on every stage. Control costs (NATS, agreement, planning)
are not in it: they are what a scheduler loses against it.

Pure: no I/O, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from wavepp.runtime.planning.cost_model import CostModel


@dataclass(frozen=True)
class RequestWork:
    """One request as the bound sees it.

    Attributes:
        num_prompt_tokens: P, tokens (>= 1).
        num_cached_tokens: L, tokens reused from the cache (0 <= L < P).
    """

    num_prompt_tokens: int
    num_cached_tokens: int

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 1:
            raise ValueError(f"num_prompt_tokens={self.num_prompt_tokens}: must be >= 1")
        if not 0 <= self.num_cached_tokens < self.num_prompt_tokens:
            raise ValueError(
                f"num_cached_tokens={self.num_cached_tokens}: must be in "
                f"[0, num_prompt_tokens={self.num_prompt_tokens})"
            )

    @property
    def num_new_tokens(self) -> int:
        return self.num_prompt_tokens - self.num_cached_tokens


@dataclass(frozen=True)
class PipelineBound:
    """The bound and the schedule that attains it.

    Attributes:
        tokens_per_s: prompt tokens (cached and new) per second, the bound.
        round_s: seconds per round (every in-flight request prefilled once), fill and drain
            spread over the rounds (T / R).
        num_microbatches: m, micro-batches per round at the bound.
        busy_s: per stage, busy seconds per round at the bound.
    """

    tokens_per_s: float
    round_s: float
    num_microbatches: int
    busy_s: tuple[float, ...]


def _request_work_s(model: CostModel, work: RequestWork) -> float:
    """Stage seconds of one request as a single chunk, without the per-micro-batch c."""
    p, cached = work.num_prompt_tokens, work.num_cached_tokens
    return model.b * (p - cached) + model.a * (p * p - cached * cached) + model.g * cached


def pipeline_bound(
    stage_cost_models: Sequence[CostModel],
    requests: Sequence[RequestWork],
    *,
    concurrency: int,
    max_microbatch_tokens: int,
) -> PipelineBound:
    """The physical bound on closed-loop prefill throughput (module docstring; docs/bench/bound.md).

    Args:
        stage_cost_models: one cost model per stage, S >= 1 (stage seconds at the time scale the
            run uses: scale them as the stages are scaled).
        requests: the measured requests, with the cached tokens the workload allows.
        concurrency: C, requests in flight (>= 1); capped at len(requests).
        max_microbatch_tokens: the engine's largest micro-batch, new tokens (>= 1).

    Returns:
        The bound; ``tokens_per_s`` is 0.0 when there are no requests.

    Raises:
        ValueError: no stage, concurrency < 1 or max_microbatch_tokens < 1.
    """
    if not stage_cost_models:
        raise ValueError("stage_cost_models is empty: give one cost model per stage")
    if concurrency < 1:
        raise ValueError(f"concurrency={concurrency}: must be >= 1")
    if max_microbatch_tokens < 1:
        raise ValueError(f"max_microbatch_tokens={max_microbatch_tokens}: must be >= 1")
    if not requests:
        return PipelineBound(0.0, 0.0, 0, tuple(0.0 for _ in stage_cost_models))
    num_requests = len(requests)
    in_flight = min(concurrency, num_requests)
    share = in_flight / num_requests  # of the whole run's work, one round's
    num_new_round = share * sum(r.num_new_tokens for r in requests)
    min_cached = min(r.num_cached_tokens for r in requests)
    work_s = [share * sum(_request_work_s(m, r) for r in requests) for m in stage_cost_models]
    m_min = max(1, math.ceil(num_new_round / max_microbatch_tokens - 1e-9))
    num_rounds = num_requests / in_flight
    # Pipeline fill and drain: stage s starts only after some micro-batch crossed the stages
    # before it, and its last micro-batch still crosses the stages after it; each micro-batch
    # costs at least c on every stage, so the run lasts at least R x busy_s + sum of the other
    # stages' c.
    fixed = [model.c for model in stage_cost_models]
    fill_drain = [sum(fixed) - c for c in fixed]
    best: tuple[float, int, tuple[float, ...]] | None = None
    for m in range(m_min, max(m_min, len(stage_cost_models)) + 1):
        extra = max(0, m - in_flight)
        round_work = [
            w + extra * model.g * min_cached
            for w, model in zip(work_s, stage_cost_models, strict=True)
        ]
        busy = tuple(
            m * model.c + w for w, model in zip(round_work, stage_cost_models, strict=True)
        )
        crossing = sum(
            model.c + w / m for w, model in zip(round_work, stage_cost_models, strict=True)
        )
        run_s = max(
            max(num_rounds * b + f for b, f in zip(busy, fill_drain, strict=True)),
            num_rounds * crossing,
        )
        if best is None or run_s < best[0]:
            best = (run_s, m, busy)
    assert best is not None, "the range of m is never empty"
    run_s, m, busy = best
    total_tokens = sum(r.num_prompt_tokens for r in requests)
    return PipelineBound(total_tokens / run_s, run_s / num_rounds, m, busy)
