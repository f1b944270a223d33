"""Replay a Mooncake trace through a local pipeline and summarise what was measured.

Closed loop at ``concurrency`` C (C requests in flight; the next starts when one ends), or open
loop at the trace's own timestamps (``timed``, optionally sped up). Throughput counts prompt
tokens (cached and new) per second of wall time, from the first arrival to the last result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from wavepp.bench.report import ReplayReport, run_closed_loop
from wavepp.bench.trace import TokenMapper, TraceError, TraceRecord
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.planning import CostModel
from wavepp.runtime.request import RequestOutcome
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
        report = await run_closed_loop(
            scheduler,
            config,
            [(f"trace-{r.line_no}", p) for r, p in zip(records, prompts, strict=True)],
            concurrency=concurrency,
            starts_s=[r.timestamp_ms / 1000.0 / speedup for r in records] if timed else None,
            cache_salt=cache_salt,
            on_outcome=on_outcome,
        )
    return replace(report, invalid=list(invalid), tokens_per_block=mapper.tokens_per_block)
