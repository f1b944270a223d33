"""Admission cadence microbenchmark over a real nats-server (small)."""

from __future__ import annotations

from wavepp.bench.admission import format_table, run_admission_bench


async def test_admission_bench_measures_each_setting() -> None:
    results = await run_admission_bench(
        [1, 3], [1, 4], num_requests=12, num_prompt_tokens=256, block_size=16
    )
    assert [(r["stages"], r["in_flight"]) for r in results] == [(1, 1), (1, 4), (3, 1), (3, 4)]
    for r in results:
        assert r["agreements_per_s"] > 0
        assert 0 < r["latency_p50_ms"] <= r["latency_p99_ms"]
    table = format_table(results)
    assert table.count("\n") == 5 and "| 3 | 4 |" in table
