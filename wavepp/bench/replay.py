"""Replay a Mooncake trace through a local pipeline and summarise what was measured.

Closed loop at ``concurrency`` C (C requests in flight; the next starts when one ends), or open
loop at the trace's own timestamps (``timed``, optionally sped up). Throughput counts prompt
tokens (cached and new) per second of wall time, from the first arrival to the last result.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from wavepp.bench.report import ReplayReport, bound_tokens_per_s
from wavepp.bench.trace import TokenMapper, TraceError, TraceRecord
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.planning import CostModel
from wavepp.runtime.request import PromptRequest, RequestOutcome
from wavepp.runtime.serving.local import LocalPipeline


async def replay_records(
    records: Sequence[TraceRecord],
    mapper: TokenMapper,
    config: RuntimeConfig,
    planner_cost_model: CostModel,
    *,
    concurrency: int = 32,
    timed: bool = False,
    speedup: float = 1.0,
    invalid: Sequence[TraceError] = (),
    on_outcome: Callable[[RequestOutcome], None] | None = None,
    cache_salt: str = "",
) -> ReplayReport:
    """Run ``records`` through a fresh local pipeline and return the report.

    Raises:
        ValueError: concurrency < 1 or speedup <= 0.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency={concurrency}: must be >= 1")
    if speedup <= 0:
        raise ValueError(f"speedup={speedup}: must be > 0")
    prompts = [mapper.prompt(record) for record in records]
    async with LocalPipeline(config, planner_cost_model) as pipeline:
        scheduler = pipeline.scheduler
        assert scheduler is not None
        limiter = asyncio.Semaphore(concurrency)
        outcomes: list[RequestOutcome] = []
        start = time.time()

        async def one(record: TraceRecord, prompt: list[int]) -> None:
            if timed:
                delay = start + record.timestamp_ms / 1000.0 / speedup - time.time()
                if delay > 0:
                    await asyncio.sleep(delay)
            async with limiter:
                request = PromptRequest(
                    request_id=f"trace-{record.line_no}",
                    token_ids=prompt,
                    cache_salt=cache_salt,
                    arrival_s=time.time(),
                )
                outcome = await scheduler.submit(request)
            outcomes.append(outcome)
            if on_outcome is not None:
                on_outcome(outcome)

        await asyncio.gather(*(one(r, p) for r, p in zip(records, prompts, strict=True)))
        wall_s = time.time() - start
        stats = scheduler.stats.snapshot()
    return ReplayReport(
        config=config,
        outcomes=outcomes,
        invalid=list(invalid),
        wall_s=wall_s,
        stats=stats,
        tokens_per_block=mapper.tokens_per_block,
        concurrency=concurrency,
        bound_tokens_per_s=bound_tokens_per_s(config, prompts, concurrency=concurrency),
    )
