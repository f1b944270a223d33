"""``run_closed_loop``'s open-loop release (``starts_s``), cache salt and outcome callback, on a
scheduler stand-in whose every request takes 50 ms."""

from __future__ import annotations

import asyncio

from wavepp.bench.report import run_closed_loop
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.request import PromptRequest, RequestOutcome
from wavepp.runtime.scheduling.stats import WaveStats


class _Scheduler:
    def __init__(self) -> None:
        self.stats = WaveStats()
        self.submitted: list[PromptRequest] = []

    def reset_stats(self) -> None:
        self.stats.reset()

    async def submit(self, request: PromptRequest) -> RequestOutcome:
        self.submitted.append(request)
        await asyncio.sleep(0.05)
        return RequestOutcome(
            request.request_id, len(request.token_ids), arrival_s=request.arrival_s
        )


def _run(scheduler: _Scheduler, names: list[str], **kwargs) -> dict[str, float]:
    """Each request's arrival (s after the loop opened), one in flight at a time."""

    async def main() -> float:
        loop = asyncio.get_running_loop()
        opened = loop.time()
        await run_closed_loop(
            scheduler,  # type: ignore[arg-type]
            RuntimeConfig(),
            [(name, [1, 2, 3]) for name in names],
            concurrency=1,
            clock=loop.time,
            **kwargs,
        )
        return opened

    opened = asyncio.run(main())
    return {r.request_id: r.arrival_s - opened for r in scheduler.submitted}


def test_requests_wait_for_their_start_and_for_a_free_slot() -> None:
    scheduler, seen = _Scheduler(), []
    arrival = _run(
        scheduler,
        [f"r{i}" for i in range(4)],
        starts_s=[0.0, 0.0, 0.3, 0.3],
        cache_salt="tenant-a",
        on_outcome=seen.append,
    )
    assert arrival["r1"] >= 0.04  # one in flight: r1 waits for r0
    later = sorted([arrival["r2"], arrival["r3"]])
    assert later[0] >= 0.3  # not before their start
    assert later[1] >= later[0] + 0.04  # and then one at a time
    assert {r.cache_salt for r in scheduler.submitted} == {"tenant-a"}
    assert sorted(o.request_id for o in seen) == ["r0", "r1", "r2", "r3"]


def test_a_request_not_yet_due_holds_no_slot() -> None:
    """Listed first but due later: it waits outside the limiter, so the one due now runs first
    (the trace replay's ``--timed`` order is the timestamps', not the file's)."""
    scheduler = _Scheduler()
    arrival = _run(scheduler, ["late", "now"], starts_s=[0.3, 0.0])
    assert [r.request_id for r in scheduler.submitted] == ["now", "late"]
    assert arrival["late"] >= 0.3
