"""Speculative planning (wavepp/runtime/scheduling/speculation.py): the scheduler plans the next
micro-batch from predicted L*s while the agreements are under way, and publishes that plan only
when every reply matched its prediction.

- the prediction (``AgreedPrefixIndex``): the deepest block of a prompt known cached, bounded;
- a prediction that does not match is dropped: the run is the run without speculation (same
  plans, same times), and every request's L* is the agreed one;
- a request whose agreement is refused or fails leaves no speculative plan behind, and nothing
  of it is published;
- every dropped speculation counts once in ``wavepp_speculations_discarded_total`` (read with
  an ``InMemoryMetricReader``), as in the scheduler's stats.

Simulated stages on a virtual clock (``wavepp.sim``) drive the real scheduler, admission and KV
managers; the only thing replaced is the agreement's outcome in the refusal/failure test (a
wrapper around the real controller's ``agree``) and the predictor in the mismatch test.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from wavepp.bench.grid import GridSpec, Setting
from wavepp.bench.workloads import preset_workload
from wavepp.launch.grid import runtime_config
from wavepp.runtime.request import PromptRequest
from wavepp.runtime.scheduling import speculation
from wavepp.runtime.scheduling.speculation import AgreedPrefixIndex
from wavepp.sim.bus import SimLatencies
from wavepp.sim.clock import VirtualClockLoop
from wavepp.sim.pipeline import SimPipeline
from wavepp.sim.run import simulate
from wavepp.telemetry.metrics import setup_metrics, shutdown_metrics
from wavepp.telemetry.settings import TelemetrySettings

LAT = SimLatencies(
    kv_rtt_s=1e-3, bus_latency_s=5e-4, hop_s=2e-4, prepare_s=2e-4, schedule_s=1.65e-3
)


@pytest.fixture
def discarded_metric() -> Iterator[Callable[[], int | None]]:
    """This process's metrics read in memory; returns the discard counter's total (None while
    it has no series)."""
    reader = InMemoryMetricReader()
    setup_metrics(TelemetrySettings(), "wavepp-scheduler", reader=reader)

    def total() -> int | None:
        data = reader.get_metrics_data()
        points = [
            int(point.value)
            for rm in (data.resource_metrics if data else [])
            for sm in rm.scope_metrics
            for metric in sm.metrics
            if metric.name == "wavepp.speculations.discarded"
            for point in metric.data.data_points
        ]
        return sum(points) if points else None

    try:
        yield total
    finally:
        shutdown_metrics()


def test_index_predicts_the_deepest_known_block_and_stays_bounded() -> None:
    index = AgreedPrefixIndex(capacity=4)
    prompt = [b"a", b"ab", b"abc", b"abcd"]
    assert index.predict(prompt) == 0
    index.record(prompt, 2)
    assert index.predict(prompt) == 2
    assert index.predict([b"a", b"ab", b"abX"]) == 2  # a sibling shares the chained prefix
    assert index.predict([b"Z", b"Zb"]) == 0
    index.record([b"q1", b"q2", b"q3"], 3)  # 5 hashes > capacity 4: the oldest goes
    assert len(index) == 4
    assert index.predict(prompt) == 2  # b"ab" kept (b"a" evicted)
    with pytest.raises(ValueError, match="capacity"):
        AgreedPrefixIndex(capacity=0)


def _run(*, speculative: bool, num_stages: int = 4, concurrency: int = 4, rounds: int = 4):
    config, planner_cost = runtime_config(
        GridSpec(time_scale=1.0, num_stages=num_stages),
        Setting("minimax-m2.7", concurrency, "high", "wave"),
    )
    config = config.model_copy(update={"speculative_planning": speculative})
    workload = preset_workload("high", rounds * concurrency, vocab_size=config.model.vocab_size)
    return simulate(config, planner_cost, workload, concurrency=concurrency, latencies=LAT)


def test_a_matching_prediction_publishes_the_speculative_plan_sooner(
    discarded_metric: Callable[[], int | None],
) -> None:
    on, off = _run(speculative=True), _run(speculative=False)
    assert on.stats.num_speculative_plans > 0
    assert on.stats.num_speculations_discarded == 0
    assert discarded_metric() == 0  # exported from the start (a panel shows 0, not "no data")
    assert off.stats.num_speculative_plans == 0
    # The same micro-batches (plans), each round shorter by min(round trip, host time).
    assert list(on.stats.microbatch_tokens) == list(off.stats.microbatch_tokens)
    assert [o.num_cached_tokens for o in on.outcomes] == [o.num_cached_tokens for o in off.outcomes]
    assert on.wall_s < off.wall_s - 3 * min(LAT.kv_rtt_s, LAT.schedule_s)


def test_a_wrong_prediction_is_dropped_and_the_plan_built_from_the_reply(
    monkeypatch: pytest.MonkeyPatch, discarded_metric: Callable[[], int | None]
) -> None:
    right = speculation.predict_agreed_blocks

    def one_block_short(core, request):  # noqa: ANN001, ANN202 - the predictor's signature
        return max(0, right(core, request) - 1)

    monkeypatch.setattr(speculation, "predict_agreed_blocks", one_block_short)
    wrong = _run(speculative=True)
    assert discarded_metric() == wrong.stats.num_speculations_discarded > 0  # each one exported
    off = _run(speculative=False)
    assert wrong.stats.num_speculative_plans == 0
    # Dropped: the run is the run without speculation, to the virtual microsecond.
    assert wrong.wall_s == pytest.approx(off.wall_s, abs=1e-9)
    assert list(wrong.stats.microbatch_tokens) == list(off.stats.microbatch_tokens)
    cached = [o.num_cached_tokens for o in wrong.outcomes]
    assert cached == [o.num_cached_tokens for o in off.outcomes]
    assert all(c > 0 for c in cached)  # the agreed L*, not the prediction


@pytest.mark.parametrize("outcome", ["refused", "failed"])
def test_a_refused_or_failed_agreement_leaves_no_speculative_plan(
    outcome: str, discarded_metric: Callable[[], int | None]
) -> None:
    config, planner_cost = runtime_config(
        GridSpec(time_scale=1.0, num_stages=2), Setting("minimax-m2.7", 1, "high", "wave")
    )
    vocab = config.model.vocab_size
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, vocab, 2048).tolist()

    def prompt() -> list[int]:
        return prefix + rng.integers(0, vocab, 256).tolist()

    async def main() -> None:
        async with SimPipeline(config, planner_cost, latencies=LAT) as pipe:
            scheduler, controller = pipe.scheduler, pipe.controller
            assert scheduler is not None and controller is not None
            admission = scheduler.admission
            warm = await scheduler.submit(PromptRequest("warm", prompt()))
            assert warm.ok and warm.num_cached_tokens == 0
            real_agree = controller.agree
            spoiled: list[str] = []

            async def agree(request):  # noqa: ANN001, ANN202 - the controller's signature
                ticket = await real_agree(request)  # the real round trip (then released)
                if request.request_id != "doomed" or spoiled:
                    return ticket
                # While the reply was on its way the scheduler planned it from the prediction.
                assert admission.speculation is not None
                assert "doomed" in admission.speculation.predicted
                spoiled.append(request.request_id)
                await controller.release([request.request_id])
                if outcome == "refused":
                    return None
                raise RuntimeError("stage 1 lost its pool")

            controller.agree = agree  # type: ignore[method-assign]
            next_id = scheduler.next_microbatch_id
            discarded = scheduler.stats.num_speculations_discarded
            exported = discarded_metric()
            doomed = asyncio.ensure_future(scheduler.submit(PromptRequest("doomed", prompt())))
            await asyncio.sleep(0.02)  # past the reply; a refused request waits for capacity
            assert spoiled == ["doomed"]
            assert admission.speculation is None
            assert scheduler.stats.num_speculations_discarded == discarded + 1
            assert discarded_metric() == exported + 1  # the drop at the reply, exported
            assert scheduler.next_microbatch_id == next_id  # nothing of it was published
            assert not scheduler.core.is_live("doomed")
            result = await doomed
            if outcome == "failed":
                assert not result.ok and "lost its pool" in result.error
                assert scheduler.next_microbatch_id == next_id
            else:  # retried after the wait and admitted: planned from its agreed L*
                assert result.ok and result.num_cached_tokens == 2048
            plans_before = scheduler.stats.num_speculative_plans
            after = await scheduler.submit(PromptRequest("after", prompt()))
            assert after.ok and after.num_cached_tokens == 2048
            assert scheduler.stats.num_speculative_plans == plans_before + 1

    loop = VirtualClockLoop(start_s=100.0)
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()


@pytest.mark.parametrize("agreed_blocks", [32, 31, 0])
def test_a_speculation_holds_only_for_the_predicted_l_star(agreed_blocks: int) -> None:
    """The check at publish time on its own (the admission also drops a speculation as soon as
    a reply differs): a record admitted with another L* than predicted gets no speculative
    chunk, and its progress is left as the agreement set it."""
    from wavepp.runtime.agreement import Ticket
    from wavepp.runtime.scheduling.core import RequestRecord

    config, planner_cost = runtime_config(
        GridSpec(time_scale=1.0, num_stages=2), Setting("minimax-m2.7", 1, "high", "wave")
    )
    vocab = config.model.vocab_size
    rng = np.random.default_rng(1)
    prefix = rng.integers(0, vocab, 2048).tolist()  # 32 blocks of 64

    async def main() -> None:
        async with SimPipeline(config, planner_cost, latencies=LAT) as pipe:
            scheduler = pipe.scheduler
            assert scheduler is not None
            warm = await scheduler.submit(PromptRequest("warm", prefix + [1, 2, 3]))
            assert warm.ok
            core = scheduler.core
            request = PromptRequest("r", prefix + rng.integers(0, vocab, 256).tolist())
            record = RequestRecord(request=request, waiter=None)
            spec = speculation.speculate(core, [record], more_work_queued=False, started_s=0.0)
            assert spec is not None and spec.predicted == {"r": 32}
            assert spec.chunks[0].context_offset == 32 * 64
            core.admitted(record, Ticket(request, num_agreed_blocks=agreed_blocks, block_size=64))
            core.activate([record])
            assert speculation.holds(core, spec) is (agreed_blocks == 32)
            next_id = core.next_microbatch_id
            scheduled = speculation.schedule_speculated(core, spec)
            assert record.progress is not None
            if agreed_blocks == 32:
                assert scheduled is not None and scheduled.microbatch_id == next_id
                assert scheduled.planned[0].context_offset == 32 * 64
                assert record.progress.num_computed_tokens == request.num_tokens
            else:
                assert scheduled is None and core.next_microbatch_id == next_id
                assert record.progress.num_computed_tokens == agreed_blocks * 64
                assert record.progress.num_planned_chunks == 0

    loop = VirtualClockLoop(start_s=100.0)
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
