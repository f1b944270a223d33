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
from wavepp.runtime.config import RuntimeConfig
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

    def summary(self) -> dict[str, Any]:
        """The replay contract's JSON object (see issue 'Runtime core': Contract)."""
        done = [o for o in self.outcomes if o.ok]
        ttfts = np.array([o.ttft_s for o in done]) if done else np.array([0.0])
        prompt_tokens = sum(o.num_prompt_tokens for o in done)
        cached_tokens = sum(o.num_cached_tokens for o in done)
        agreement = np.array([o.agreement_s for o in done]) if done else np.array([0.0])
        busy = self.stats.busy_s_by_stage(self.config.num_stages)
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
            "wave_fill": round(self.stats.wave_fill(self.config.num_stages), 4),
            "stage_busy_s": [round(b, 3) for b in busy],
            "ttft_p50_s": round(float(np.percentile(ttfts, 50)), 4),
            "ttft_p99_s": round(float(np.percentile(ttfts, 99)), 4),
            "agreement_p50_s": round(float(np.percentile(agreement, 50)), 5),
            "agreement_p99_s": round(float(np.percentile(agreement, 99)), 5),
            "reservation_refusals": sum(o.num_refusals for o in self.outcomes),
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
            "errors": sorted({o.error for o in self.outcomes if o.error})[:5]
            + [str(e) for e in self.invalid[:5]],
            **self.extra,
        }


async def run_closed_loop(
    scheduler: WaveScheduler,
    config: RuntimeConfig,
    requests: Sequence[tuple[str, list[int]]],
    *,
    concurrency: int,
    clock: Callable[[], float] = time.time,
    finished_at: Callable[[str], float | None] | None = None,
    extra: dict[str, Any] | None = None,
) -> ReplayReport:
    """Submit ``(request_id, prompt)`` pairs closed-loop at ``concurrency`` and report.

    The measured window starts here (the scheduler's stats are reset in place, so its metrics
    report this run), and warm-up requests submitted before do not count. ``clock`` stamps arrivals and the wall time (a simulator
    passes its virtual clock); ``finished_at`` (if given) overrides each outcome's finish time.
    """
    scheduler.reset_stats()
    limiter = asyncio.Semaphore(concurrency)
    outcomes: list[RequestOutcome] = []
    start = clock()

    async def one(request_id: str, prompt: list[int]) -> None:
        async with limiter:
            outcome = await scheduler.submit(PromptRequest(request_id, prompt, arrival_s=clock()))
        if finished_at is not None:
            finished = finished_at(request_id)
            outcome.finished_s = finished if finished is not None else clock()
        outcomes.append(outcome)

    await asyncio.gather(*(one(rid, prompt) for rid, prompt in requests))
    return ReplayReport(
        config=config,
        outcomes=outcomes,
        invalid=[],
        wall_s=clock() - start,
        stats=scheduler.stats.snapshot(),
        tokens_per_block=config.block_size,
        concurrency=concurrency,
        extra=dict(extra or {}),
    )
