"""The closed-loop target of a population larger than the micro-batches in flight sizes W from
the mean work of the requests admitted last (``SchedulerCore.closed_loop_target_s``,
``recent_work_window``: ``WORK_TURNOVERS`` x the open requests) when the replica counts a way
back (``return_microbatches`` >= 1, a served replica): one long prompt entering the population
does not raise the target of every micro-batch of its round, so consecutive micro-batches cost
about the same.

- unit: the target with 8 open requests is c + 8 x (mean work of the last admitted) / m, and
  stays there when a long prompt is admitted; with no more open requests than micro-batches in
  flight, or without a way back, it is the open requests' own work (c + W / m), as before;
  after a shift from short prompts to long ones the target is the population's own again
  within ``WORK_TURNOVERS`` x the open requests' admissions (a few rounds, at any
  concurrency); a request admitted again after a re-form counts once in the window;
- simulated (the runtime's scheduler, planner and admission on a virtual clock): a served
  two-stage replica (S + 1 micro-batches in flight) in a closed loop at C = 8 over the first 100
  records of the in-repo Mooncake trace plans no micro-batch, past the ramp-up and before the
  drain, costing more than twice the median one.
"""

from __future__ import annotations

import statistics

import pytest

from wavepp.api.spec import WavePipelineSpec
from wavepp.bench.grid import GridSpec, Setting
from wavepp.bench.vllm_args import DEFAULT_TRACE
from wavepp.bench.workloads import mooncake_workload
from wavepp.launch.grid import runtime_config
from wavepp.launch.runtime_config import runtime_configs_from_spec
from wavepp.runtime.agreement import Ticket
from wavepp.runtime.planning import Chunk, CostModel, planner_for
from wavepp.runtime.request import PromptRequest
from wavepp.runtime.scheduling.core import RequestRecord, SchedulerCore
from wavepp.runtime.scheduling.scheduler import WaveScheduler
from wavepp.runtime.scheduling.sizing import WORK_TURNOVERS, WORK_WINDOW_FLOOR
from wavepp.sim.bus import SimLatencies
from wavepp.sim.run import simulate

SHORT, LONG = 512, 8192
LAT = SimLatencies(kv_rtt_s=1e-3, bus_latency_s=5e-4, hop_s=2e-4, schedule_s=1.65e-3)


def _core(concurrency: int, return_microbatches: int = 1) -> SchedulerCore:
    config, planner_cost = runtime_config(
        GridSpec(time_scale=1.0, num_stages=2), Setting("minimax-m2.7", concurrency, "low", "wave")
    )
    config = config.model_copy(update={"return_microbatches": return_microbatches})
    return SchedulerCore(config, planner_for(config, planner_cost), block_hashes=lambda _: [])


def _admit(core: SchedulerCore, name: str, num_tokens: int) -> RequestRecord:
    record = core.add_request(PromptRequest(name, [1] * num_tokens), waiter=None)
    core.admitted(record, Ticket(record.request, num_agreed_blocks=0, block_size=64))
    core.activate([record])
    return record


def _finish(core: SchedulerCore, record: RequestRecord) -> None:
    core.live.pop(record.request_id)
    core.fail(record, "done")  # the way a request leaves the open population
    core.take_finished()


def _target_of(core: SchedulerCore, total_s: float) -> float:
    """c + W / m with m the count closed_loop_target_s picks (the config's way back)."""
    c = core.planner.fixed_cost_s
    way_back = core.num_stages - 1 + core.config.resolved_return_microbatches
    m = min(
        range(1, core.config.resolved_max_inflight + 1),
        key=lambda m: (
            max(m * c + total_s, (way_back + max(1.0, m / core.num_open)) * (c + total_s / m)),
            -m,
        ),
    )
    return c + total_s / m


def test_a_long_prompt_moves_the_target_by_its_share_of_the_recent_mean() -> None:
    core = _core(8)
    assert core.config.resolved_max_inflight < 8
    open_records = [_admit(core, f"s{i}", SHORT) for i in range(8)]
    for i in range(100):  # the closed loop: a finished request is replaced by a new one
        _finish(core, open_records.pop(0))
        open_records.append(_admit(core, f"t{i}", SHORT))
    short_s = open_records[0].work_s
    before = core.closed_loop_target_s()
    assert before == pytest.approx(_target_of(core, 8 * short_s))
    _finish(core, open_records.pop(0))
    long = _admit(core, "long", LONG)
    works = [short_s] * (8 + 100) + [long.work_s]
    assert core.recent_work_window() == WORK_TURNOVERS * 8 < len(works)
    mean_s = statistics.fmean(works[-core.recent_work_window() :])
    after = core.closed_loop_target_s()
    assert after == pytest.approx(_target_of(core, 8 * mean_s))
    # the population's own sum would make every micro-batch of the round carry the long prompt
    own_s = sum(r.work_s for r in open_records) + long.work_s
    assert long.work_s > 10 * short_s
    assert after < 0.6 * _target_of(core, own_s)


@pytest.mark.parametrize(("num_open", "return_microbatches"), [(2, 1), (3, 1), (8, 0)])
def test_few_open_requests_or_no_way_back_keep_their_own_work(
    num_open: int, return_microbatches: int
) -> None:
    core = _core(num_open, return_microbatches)
    assert core.config.resolved_max_inflight == 2 + return_microbatches
    for i in range(20):
        _finish(core, _admit(core, f"s{i}", SHORT))
    records = [_admit(core, f"a{i}", SHORT) for i in range(num_open - 1)]
    records.append(_admit(core, "long", LONG))
    total_s = sum(r.work_s for r in records)
    assert core.closed_loop_target_s() == pytest.approx(_target_of(core, total_s))


def test_a_served_closed_loop_on_the_trace_plans_even_microbatches() -> None:
    spec = WavePipelineSpec.model_validate(
        {"model": {"name": "tiny-llama"}, "stages": 2, "engine": "emulated"}
    )
    config = runtime_configs_from_spec(spec, pool="p")[0]
    assert config.resolved_max_inflight == 3  # a served replica: S + 1
    planner_cost = CostModel.from_dict(config.cost_model)
    workload = mooncake_workload(DEFAULT_TRACE, 100, tokens_per_block=16, vocab_size=32000, seed=1)
    costs: list[float] = []
    original = WaveScheduler.on_done

    async def on_done(self: WaveScheduler, done) -> None:  # noqa: ANN001 - MicroBatchDone
        if done.rank == 0 and done.microbatch_id in self.core.ledger:
            plan = self.core.ledger.plan(done.microbatch_id)
            assert plan is not None
            costs.append(
                self.core.planner.microbatch_cost_s(
                    [
                        Chunk(
                            c.request_id,
                            c.chunk_index,
                            c.context_offset,
                            len(c.token_ids),
                            c.is_last,
                        )
                        for c in plan.chunks
                    ]
                )
            )
        await original(self, done)

    WaveScheduler.on_done = on_done  # type: ignore[method-assign]
    try:
        simulate(config, planner_cost, workload, concurrency=8, latencies=LAT)
    finally:
        WaveScheduler.on_done = original  # type: ignore[method-assign]
    steady = costs[4:-6]  # neither the ramp-up nor the drain
    assert len(steady) > 20
    median = statistics.median(steady)
    assert max(steady) <= 2.0 * median, [round(c / median, 2) for c in steady]


def test_a_population_lighter_than_the_recent_mean_keeps_its_own_work() -> None:
    # short prompts after long ones: the recent mean caps W, it does not replace it
    core = _core(8)
    long_works = []
    for i in range(40):
        record = _admit(core, f"l{i}", LONG)
        long_works.append(record.work_s)
        _finish(core, record)
    records = [_admit(core, f"s{i}", SHORT) for i in range(8)]
    own_s = sum(r.work_s for r in records)
    recent_mean_s = statistics.fmean(long_works + [r.work_s for r in records])
    assert 8 * recent_mean_s > 5 * own_s  # the recent mean alone would size W far above
    assert core.closed_loop_target_s() == pytest.approx(_target_of(core, own_s))


@pytest.mark.parametrize("num_open", [8, 16])
def test_after_a_shift_to_long_prompts_the_target_is_their_own_within_a_few_turnovers(
    num_open: int,
) -> None:
    # the closed loop at C = num_open: 300 short prompts, then long ones
    core = _core(num_open)
    assert core.config.resolved_max_inflight < num_open
    open_records = [_admit(core, f"s{i}", SHORT) for i in range(num_open)]
    for i in range(300):
        _finish(core, open_records.pop(0))
        open_records.append(_admit(core, f"t{i}", SHORT))
    bound = WORK_TURNOVERS * num_open  # admissions of the new workload: WORK_TURNOVERS rounds
    assert core.recent_work_window() == bound
    ratios = []
    for i in range(bound):
        _finish(core, open_records.pop(0))
        open_records.append(_admit(core, f"long{i}", LONG))
        own = _target_of(core, sum(r.work_s for r in open_records))
        ratios.append(core.closed_loop_target_s() / own)
    assert ratios[num_open - 1] < 0.9  # the cap still lags after one turnover
    assert ratios[-1] == pytest.approx(1.0)  # the window holds long prompts only
    assert ratios[-1] >= 0.9, [round(r, 2) for r in ratios[::num_open]]


def test_a_request_admitted_again_after_a_re_form_counts_once_in_the_window() -> None:
    core = _core(8)
    open_records = [_admit(core, f"s{i}", SHORT) for i in range(8)]
    for i in range(100):  # the closed loop at 8 open requests, then 8 long prompts
        _finish(core, open_records.pop(0))
        open_records.append(_admit(core, f"t{i}", SHORT))
    for record in open_records:
        _finish(core, record)
    records = [_admit(core, f"l{i}", LONG) for i in range(8)]
    before = core.closed_loop_target_s()
    readmit = core.reform(queued=[])
    assert [r.request_id for r in readmit] == [r.request_id for r in records]
    for record in readmit:  # the driver admits each again
        core.admitted(record, Ticket(record.request, num_agreed_blocks=0, block_size=64))
        core.activate([record])
    assert core.closed_loop_target_s() == pytest.approx(before)
    # the window: the last shorts and the 8 long prompts, each once
    window = core.recent_work_window()
    works = [r.work_s for r in records]
    short_s = core.planner.request_work_s(0, SHORT)
    expected = _target_of(core, 8 * statistics.fmean([short_s] * (window - 8) + works))
    assert expected < _target_of(core, sum(works))  # the recent mean caps W
    assert before == pytest.approx(expected)


def test_few_open_requests_over_few_microbatches_average_at_least_the_floor() -> None:
    # 3 open requests over 2 micro-batches in flight: 8 x 3 = 24 < WORK_WINDOW_FLOOR
    core = _core(3)
    core.config = core.config.model_copy(update={"max_inflight": 2})
    assert core.config.resolved_max_inflight == 2
    open_records = [_admit(core, f"s{i}", SHORT) for i in range(3)]
    for i in range(100):
        _finish(core, open_records.pop(0))
        open_records.append(_admit(core, f"t{i}", SHORT))
    for i in range(4):
        _finish(core, open_records.pop(0))
        open_records.append(_admit(core, f"long{i}", LONG))
    assert core.recent_work_window() == WORK_WINDOW_FLOOR > WORK_TURNOVERS * 3
    short_s, long_s = (core.planner.request_work_s(0, n) for n in (SHORT, LONG))
    mean_s = statistics.fmean([short_s] * (WORK_WINDOW_FLOOR - 4) + [long_s] * 4)
    assert core.closed_loop_target_s() == pytest.approx(_target_of(core, 3 * mean_s))


def test_a_speculations_works_are_the_newest_in_the_window() -> None:
    core = _core(8)
    open_records = [_admit(core, f"s{i}", SHORT) for i in range(8)]
    for i in range(100):
        _finish(core, open_records.pop(0))
        open_records.append(_admit(core, f"t{i}", SHORT))
    _finish(core, open_records.pop(0))
    core.add_request(PromptRequest("agreeing", [1] * LONG), waiter=None)  # open, not admitted
    short_s, long_s = open_records[0].work_s, core.planner.request_work_s(0, LONG)
    window = core.recent_work_window()
    mean_s = statistics.fmean([short_s] * (window - 1) + [long_s])
    assert 8 * mean_s < 7 * short_s + long_s  # the recent mean caps W
    assert core.closed_loop_target_s([long_s]) == pytest.approx(_target_of(core, 8 * mean_s))


def test_the_window_is_at_most_the_works_kept_and_they_are_the_newest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("wavepp.runtime.scheduling.sizing._WORKS_KEPT", 40)
    core = _core(8)
    open_records = [_admit(core, f"s{i}", SHORT) for i in range(8)]
    assert core.recent_work_window() > 40
    for i in range(100):
        _finish(core, open_records.pop(0))
        open_records.append(_admit(core, f"t{i}", SHORT))
    for i in range(40):  # 40 long prompts: every work kept is a long one
        _finish(core, open_records.pop(0))
        open_records.append(_admit(core, f"long{i}", LONG))
    own_s = sum(r.work_s for r in open_records)
    assert core.closed_loop_target_s() == pytest.approx(_target_of(core, own_s))
