"""A short replay for the telemetry tests: 4 emulated stages, a tiny cost model, real NATS."""

from __future__ import annotations

from wavepp.bench.replay import ReplayReport, replay_records
from wavepp.bench.trace import TokenMapper, TraceRecord
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.model_config import ModelConfig
from wavepp.runtime.planning import CostModel
from wavepp.telemetry.settings import TelemetrySettings

NUM_STAGES = 4
# A stage costs ~2 ms + 20 us per new token: a 100-token chunk takes ~4 ms.
COST = CostModel(c=2e-3, g=1e-6, b=2e-5, a=1e-9, label="derived", source="telemetry test")
MODEL = ModelConfig(num_layers=8)


def short_records(num_requests: int) -> list[TraceRecord]:
    """Requests sharing a 3-block system prompt (prefix reuse), each with 2..5 own blocks."""
    records = []
    for i in range(num_requests):
        num_own = 2 + i % 4
        hash_ids = (0, 1, 2, *(1000 + 10 * i + j for j in range(num_own)))
        records.append(TraceRecord(i + 1, 100 * i, 512 * len(hash_ids), 1, hash_ids))
    return records


def short_config(telemetry: TelemetrySettings, **overrides: object) -> RuntimeConfig:
    return RuntimeConfig(
        model=MODEL,
        engine="emulated",
        cost_model=COST.to_dict(),
        num_stages=NUM_STAGES,
        block_size=16,
        num_kv_blocks=[512],
        telemetry=telemetry,
        **overrides,
    )


async def short_replay(
    telemetry: TelemetrySettings, num_requests: int = 24, concurrency: int = 8
) -> ReplayReport:
    config = short_config(telemetry)
    mapper = TokenMapper(16, MODEL.vocab_size, seed=0)
    return await replay_records(
        short_records(num_requests), mapper, config, COST, concurrency=concurrency
    )
