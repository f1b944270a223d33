"""What a replay measured (``ReplayReport``) and the closed-loop driver (``run_closed_loop``).

Shared by the replay over real stage processes (``wavepp.bench.replay``), the grid and the
simulator (``wavepp.sim.run``); nothing here starts a pipeline or imports NATS.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from wavepp.bench.trace import TraceError
from wavepp.bench.workloads import ideal_cached_tokens
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.planning import CostModel
from wavepp.runtime.planning.bound import RequestWork, pipeline_bound
from wavepp.runtime.request import PromptRequest, RequestOutcome
from wavepp.runtime.scheduling.scheduler import WaveScheduler
from wavepp.runtime.scheduling.stats import WaveStats


@dataclass
class ReplayReport:
    config: RuntimeConfig
    outcomes: list[RequestOutcome]
    invalid: list[TraceError]
    wall_s: float
    stats: WaveStats
    tokens_per_block: int
    concurrency: int
    extra: dict[str, Any] = field(default_factory=dict)
    # NOTE: the physical bound of this run's workload on its stages (docs/bench/bound.md),
    # prompt tokens per second; None when the stages' cost is unknown (the torch engine).
    bound_tokens_per_s: float | None = None

    def summary(self) -> dict[str, Any]:
        """The replay's JSON summary: the keys below, times in seconds (``*_s``) or ms (``*_ms``)."""
        done = [o for o in self.outcomes if o.ok]
        ttfts = np.array([o.ttft_s for o in done]) if done else np.array([0.0])
        prompt_tokens = sum(o.num_prompt_tokens for o in done)
        cached_tokens = sum(o.num_cached_tokens for o in done)
        agreement = np.array([o.agreement_s for o in done]) if done else np.array([0.0])
        busy = self.stats.busy_s_by_stage(self.config.num_stages)
        throughput = prompt_tokens / self.wall_s if self.wall_s else 0.0
        num_stages = self.config.num_stages
        # NOTE: blocks of block_size tokens, summed over completed requests: what each stage
        # held locally at agreement, and the prefix all stages agreed on (L*, what was reused).
        local_hits = [sum(o.stage_hits[r] for o in done if len(o.stage_hits) > r)
                      for r in range(num_stages)]  # fmt: skip
        agreed_blocks = sum(o.num_cached_tokens // self.config.block_size for o in done)
        # per tier: m_s, the host part of each local hit, and what of L* each stage loaded
        # from its host tier (L* - d_s where the device hit d_s = h_s - m_s falls short)
        host_hits, host_reused = [0] * num_stages, [0] * num_stages
        for o in done:
            agreed = o.num_cached_tokens // self.config.block_size
            for r, (hit, host) in enumerate(zip(o.stage_hits, o.stage_host_hits, strict=False)):
                host_hits[r] += host
                host_reused[r] += max(0, agreed - (hit - host))
        return {
            "requests": len(self.outcomes) + len(self.invalid),
            "completed": len(done),
            "failed": len(self.outcomes) - len(done) + len(self.invalid),
            "invalid_lines": len(self.invalid),
            "prompt_tokens": prompt_tokens,
            "cached_tokens": cached_tokens,
            "new_tokens": prompt_tokens - cached_tokens,
            "cache_hit_ratio": round(cached_tokens / prompt_tokens, 4) if prompt_tokens else 0.0,
            "throughput_tokens_per_s": round(prompt_tokens / self.wall_s, 2)
            if self.wall_s
            else 0.0,
            "new_tokens_per_s": round((prompt_tokens - cached_tokens) / self.wall_s, 2)
            if self.wall_s
            else 0.0,
            "bound_tokens_per_s": round(self.bound_tokens_per_s, 2)
            if self.bound_tokens_per_s
            else None,
            "efficiency": round(throughput / self.bound_tokens_per_s, 4)
            if self.bound_tokens_per_s
            else None,
            "wave_fill": round(self.stats.wave_fill(self.config.num_stages), 4),
            "stage_busy_s": [round(b, 3) for b in busy],
            "ttft_p50_s": round(float(np.percentile(ttfts, 50)), 4),
            "ttft_p99_s": round(float(np.percentile(ttfts, 99)), 4),
            "agreement_p50_s": round(float(np.percentile(agreement, 50)), 5),
            "agreement_p99_s": round(float(np.percentile(agreement, 99)), 5),
            "reservation_refusals": sum(o.num_refusals for o in self.outcomes),
            "scheduler_host_ms_mean": round(float(np.mean(self.stats.host_s)) * 1e3, 3)
            if self.stats.host_s
            else None,
            "scheduler_host_ms_p50": _ms_percentile(self.stats.host_s, 50),
            "scheduler_host_ms_p99": _ms_percentile(self.stats.host_s, 99),
            "microbatches": self.stats.num_microbatches,
            "wall_s": round(self.wall_s, 3),
            "mode": self.config.mode,
            "stages": self.config.num_stages,
            "engine": self.config.engine,
            "model": self.config.model.name,
            "concurrency": self.concurrency,
            "tokens_per_block": self.tokens_per_block,
            "block_size": self.config.block_size,
            "kv_blocks_per_stage": [
                self.config.kv_blocks_of(r) for r in range(self.config.num_stages)
            ],
            "stage_local_hit_blocks": local_hits,
            "stage_host_hit_blocks": host_hits,
            "stage_host_reused_blocks": host_reused,
            "agreed_prefix_blocks": agreed_blocks,
            "layers_per_stage": None
            if self.config.engine == "emulated"
            else [last - first for first, last in map(self.config.layers_of, range(num_stages))],
            "errors": sorted({o.error for o in self.outcomes if o.error})[:5]
            + [str(e) for e in self.invalid[:5]],
            **self.extra,
        }


def _ms_percentile(seconds: Sequence[float], q: float) -> float | None:
    return round(float(np.percentile(list(seconds), q)) * 1e3, 3) if seconds else None


def stage_cost_models_of(config: RuntimeConfig) -> list[CostModel] | None:
    """Each stage's cost as it runs (the emulated engine's model x time_scale), or None when
    the stages run real layers (the torch engine: their cost is measured, not known)."""
    if config.engine != "emulated" or config.cost_model is None:
        return None
    model = CostModel.from_dict(config.cost_model).scaled(config.time_scale)
    return [model] * config.num_stages


def bound_tokens_per_s(
    config: RuntimeConfig,
    prompts: Sequence[Sequence[int]],
    *,
    concurrency: int,
    warmup: Sequence[Sequence[int]] = (),
    stage_cost_models: Sequence[CostModel] | None = None,
) -> float | None:
    """The physical bound (``planning.bound.pipeline_bound``) of replaying ``prompts``
    closed-loop at ``concurrency`` on the config's stages, prompt tokens per second.

    Reuse is what an unbounded prefix cache gives in arrival order after ``warmup``
    (``ideal_cached_tokens``); stage costs are ``stage_cost_models`` (seconds as the stages
    run them) or the emulated engine's; None when neither is known.
    """
    models = list(stage_cost_models) if stage_cost_models else stage_cost_models_of(config)
    if not models or not prompts:
        return None
    cached = ideal_cached_tokens(prompts, config.block_size, warmup)
    bound = pipeline_bound(
        models,
        [RequestWork(len(p), c) for p, c in zip(prompts, cached, strict=True)],
        concurrency=concurrency,
        max_microbatch_tokens=config.max_microbatch_tokens,
    )
    return bound.tokens_per_s


async def run_closed_loop(
    scheduler: WaveScheduler,
    config: RuntimeConfig,
    requests: Sequence[tuple[str, list[int]]],
    *,
    concurrency: int,
    clock: Callable[[], float] = time.time,
    finished_at: Callable[[str], float | None] | None = None,
    extra: dict[str, Any] | None = None,
    warmup: Sequence[Sequence[int]] = (),
    stage_cost_models: Sequence[CostModel] | None = None,
    starts_s: Sequence[float] | None = None,
    cache_salt: str = "",
    on_outcome: Callable[[RequestOutcome], None] | None = None,
) -> ReplayReport:
    """Submit the ``warmup`` prompts one at a time (ids ``warmup-0``, ...), then the
    ``(request_id, prompt)`` pairs closed-loop at ``concurrency``, and report.

    ``starts_s`` (one per request, seconds after the measured window opens, on ``clock``): no
    request is submitted before its start (an open loop, still at most ``concurrency`` in
    flight). Every request carries ``cache_salt``; ``on_outcome`` is called with each outcome
    as it arrives.

    The measured window starts after the warm-up (the scheduler's stats are reset in place, so
    its metrics report this run); warm-up requests, here or submitted before, do not count.
    ``clock`` stamps arrivals and the wall time (a simulator passes its virtual clock);
    ``finished_at`` (if given) overrides each outcome's finish time. The report carries the
    physical bound (``bound_tokens_per_s``) when the stages' cost is known:
    ``stage_cost_models``, or the emulated engine's; ``warmup`` is what was cached before.
    """
    for index, prompt in enumerate(warmup):
        await scheduler.submit(PromptRequest(f"warmup-{index}", list(prompt), arrival_s=clock()))
    scheduler.reset_stats()
    limiter = asyncio.Semaphore(concurrency)
    outcomes: list[RequestOutcome] = []
    start = clock()

    async def one(index: int, request_id: str, prompt: list[int]) -> None:
        if starts_s is not None and (delay := start + starts_s[index] - clock()) > 0:
            await asyncio.sleep(delay)
        async with limiter:
            outcome = await scheduler.submit(
                PromptRequest(request_id, prompt, cache_salt=cache_salt, arrival_s=clock())
            )
        if finished_at is not None:
            finished = finished_at(request_id)
            outcome.finished_s = finished if finished is not None else clock()
        outcomes.append(outcome)
        if on_outcome is not None:
            on_outcome(outcome)

    await asyncio.gather(*(one(i, rid, prompt) for i, (rid, prompt) in enumerate(requests)))
    return ReplayReport(
        config=config,
        outcomes=outcomes,
        invalid=[],
        wall_s=clock() - start,
        stats=scheduler.stats.snapshot(),
        tokens_per_block=config.block_size,
        concurrency=concurrency,
        extra=dict(extra or {}),
        bound_tokens_per_s=bound_tokens_per_s(
            config,
            [prompt for _, prompt in requests],
            concurrency=concurrency,
            warmup=warmup,
            stage_cost_models=stage_cost_models,
        ),
    )
