"""The admission strategy is a typed contract: ``AdmissionStrategy``'s abstract methods are what
the scheduler calls, its pacing methods are what the loop and the simulator ask of it, an
``AgreementMode`` selects the built-in one, and a strategy defined outside the runtime (here, in
this test) drives the real scheduler in the simulator."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from wavepp.bench.grid import GridSpec, Setting
from wavepp.launch.grid import runtime_config
from wavepp.runtime.config import AgreementMode, RuntimeConfig
from wavepp.runtime.planning import CostModel
from wavepp.runtime.request import PromptRequest, RequestOutcome, RequestStatus
from wavepp.runtime.scheduling.admission import (
    STRATEGIES,
    AdmissionHost,
    AdmissionStrategy,
    AsyncAdmission,
    SyncAdmission,
)
from wavepp.runtime.scheduling.speculation import Speculation
from wavepp.sim.bus import SimLatencies
from wavepp.sim.clock import VirtualClockLoop
from wavepp.sim.pipeline import SimPipeline

ZERO = SimLatencies(kv_rtt_s=0.001, bus_latency_s=0.0, hop_s=0.0, prepare_s=0.0)


class OneRequestAtATime(AdmissionStrategy):
    """Admits the next request only once the planning set has no unplanned token left, so every
    micro-batch holds chunks of exactly one request, in arrival order."""

    def __init__(self, scheduler: AdmissionHost) -> None:
        super().__init__(scheduler)
        self.admitted_order: list[str] = []
        self.num_released = 0

    def start(self) -> list[asyncio.Task[None]]:
        return []

    def tasks(self) -> list[asyncio.Task[None]]:
        return []

    async def gather(self) -> None:
        if any(record.num_unplanned_tokens for record in self.core.active):
            return
        record = await self.scheduler.intake.get()
        record.status = RequestStatus.AGREEING
        while True:
            generation = self._capacity_generation
            ticket = await self.controller.agree(record.request)
            if ticket is not None:
                break
            await self._wait_for_capacity(generation)
        self._admitted(record, ticket)
        self.core.activate([record])
        self.admitted_order.append(record.request_id)

    def more_work_queued(self) -> bool:
        return False

    def take_queued(self) -> list:
        return []

    def num_prepared(self) -> int:
        return 0

    def reopen(self) -> None:
        return None

    async def released(self) -> None:
        self.num_released += 1
        await self._capacity_released()

    async def microbatch_published(self) -> None:
        return None

    def take_speculation(self) -> Speculation | None:
        return None

    def take_idle_wake_s(self) -> float | None:
        return None


def _config() -> tuple[RuntimeConfig, CostModel]:
    spec = GridSpec(time_scale=1.0, num_stages=4, num_kv_blocks=65536)
    return runtime_config(spec, Setting("glm-5.2", 4, "low", "wave"))


async def _serve(
    config: RuntimeConfig,
    planner_cost: CostModel,
    prompts: list[list[int]],
    strategy_class: type[OneRequestAtATime] = OneRequestAtATime,
) -> tuple[list[RequestOutcome], list[list[str]], OneRequestAtATime]:
    microbatches: dict[int, list[str]] = {}
    async with SimPipeline(
        config, planner_cost, latencies=ZERO, admission=strategy_class
    ) as pipeline:
        scheduler = pipeline.scheduler
        assert scheduler is not None
        strategy = scheduler.admission
        assert isinstance(strategy, strategy_class)
        scheduler.on_stage_done = lambda done, owners: microbatches.setdefault(
            done.microbatch_id, sorted(set(owners))
        )
        now = asyncio.get_running_loop().time()
        outcomes = await asyncio.gather(
            *(
                scheduler.submit(PromptRequest(f"r{i}", prompt, arrival_s=now))
                for i, prompt in enumerate(prompts)
            )
        )
    return list(outcomes), [microbatches[m] for m in sorted(microbatches)], strategy


def test_a_strategy_defined_outside_the_runtime_drives_the_scheduler() -> None:
    config, planner_cost = _config()
    # Three 20,000-token prompts: each needs several micro-batches of its own.
    prompts = [[1 + (i * 7919 + t) % 1000 for t in range(20_000)] for i in range(3)]
    loop = VirtualClockLoop(start_s=10.0)
    try:
        outcomes, microbatches, strategy = loop.run_until_complete(
            _serve(config, planner_cost, prompts)
        )
    finally:
        loop.close()
    assert [o.error for o in outcomes] == [""] * 3
    assert strategy.admitted_order == ["r0", "r1", "r2"]
    # The strategy's fixed behaviour is visible in the plans: one request per micro-batch, in
    # admission order, each request spread over more than one micro-batch.
    assert all(len(owners) == 1 for owners in microbatches)
    owners = [owner for (owner,) in microbatches]
    assert owners == sorted(owners)
    assert all(owners.count(f"r{i}") > 1 for i in range(3))
    assert strategy.num_released >= 1  # the scheduler told it of released requests


def test_a_strategy_must_implement_every_call_the_scheduler_makes() -> None:
    class Incomplete(AdmissionStrategy):
        async def gather(self) -> None:
            return None

    with pytest.raises(TypeError, match="abstract"):
        Incomplete(object())  # type: ignore[abstract, arg-type]
    called = {name for name in dir(AdmissionStrategy) if not name.startswith("_")}
    assert called == AdmissionStrategy.__abstractmethods__ | PACING


# What the scheduling loop and the simulator ask of a strategy, with defaults it may override.
PACING = {"host_floor_s", "agrees_in_lockstep"}
FLOOR_S = 2.0  # seconds; longer than the whole request takes without it


class PacedOneRequestAtATime(OneRequestAtATime):
    """``OneRequestAtATime`` whose every plan takes at least ``FLOOR_S`` of host time."""

    def host_floor_s(self) -> float:
        return FLOOR_S


def _first_token_s(strategy_class: type[OneRequestAtATime]) -> tuple[float, int]:
    """Virtual seconds from the submission of one 2,048-token prompt to its first token on the
    last stage, and the number of micro-batches it took."""
    config, planner_cost = _config()
    microbatches: set[int] = set()

    async def serve() -> float:
        async with SimPipeline(
            config, planner_cost, latencies=ZERO, admission=strategy_class
        ) as pipeline:
            scheduler = pipeline.scheduler
            assert scheduler is not None and isinstance(scheduler.admission, strategy_class)
            scheduler.on_stage_done = lambda done, _: microbatches.add(done.microbatch_id)
            submitted_s = asyncio.get_running_loop().time()
            outcome = await scheduler.submit(PromptRequest("r0", list(range(1, 2049))))
            assert outcome.error == ""
            finished_s = pipeline.finished_at_s("r0")
            assert finished_s is not None
            return finished_s - submitted_s

    loop = VirtualClockLoop(start_s=10.0)
    try:
        return loop.run_until_complete(serve()), len(microbatches)
    finally:
        loop.close()


def test_the_strategys_host_floor_delays_each_plan() -> None:
    # Wave mode: the config's baseline is off, so only the strategy's override adds host time.
    assert OneRequestAtATime.host_floor_s is AdmissionStrategy.host_floor_s
    plain_s, _ = _first_token_s(OneRequestAtATime)
    paced_s, num_microbatches = _first_token_s(PacedOneRequestAtATime)
    # Each plan of the request waits the floor after the previous one went out.
    assert plain_s < FLOOR_S
    assert paced_s >= num_microbatches * FLOOR_S


class LockstepOneRequestAtATime(OneRequestAtATime):
    @classmethod
    def agrees_in_lockstep(cls, config: RuntimeConfig) -> bool:
        return True


@pytest.mark.parametrize(
    ("strategy_class", "pools"),
    [(OneRequestAtATime, [900, 700, 800, 1000]), (LockstepOneRequestAtATime, [700] * 4)],
)
def test_the_strategy_decides_whether_the_simulator_agrees_in_lockstep(
    strategy_class: type[OneRequestAtATime], pools: list[int]
) -> None:
    config, planner_cost = _config()
    config = config.model_copy(update={"num_kv_blocks": [900, 700, 800, 1000]})

    async def capacities() -> list[int]:
        async with SimPipeline(
            config, planner_cost, latencies=ZERO, admission=strategy_class
        ) as pipeline:
            return [stage.manager.pool.num_blocks for stage in pipeline.stages]

    loop = VirtualClockLoop(start_s=10.0)
    try:
        assert loop.run_until_complete(capacities()) == pools
    finally:
        loop.close()


@pytest.mark.parametrize(
    ("mode", "floor_s", "lockstep"), [("wave", 0.0, False), ("sync", 0.005, True)]
)
def test_the_built_in_pacing_is_the_baseline_as_the_config_resolves_it(
    mode: str, floor_s: float, lockstep: bool
) -> None:
    config, _ = _config()
    config = RuntimeConfig.model_validate({**config.model_dump(), "mode": mode})
    strategy = STRATEGIES[config.resolved_agreement]
    assert strategy.agrees_in_lockstep(config) is lockstep
    assert config.baseline.iteration_overhead_s == 0.005  # the default this case reads
    host = SimpleNamespace(core=None, config=config, controller=None, telemetry=None)
    assert OneRequestAtATime(host).host_floor_s() == floor_s  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("mode", "agreement", "strategy"),
    [
        ("wave", None, AsyncAdmission),
        ("sync", None, SyncAdmission),
        ("wave", "sync", SyncAdmission),
        ("sync", "async", AsyncAdmission),
    ],
)
def test_the_agreement_mode_selects_the_strategy(
    mode: str, agreement: str | None, strategy: type[AdmissionStrategy]
) -> None:
    config, _ = _config()
    config = RuntimeConfig.model_validate(
        {**config.model_dump(), "mode": mode, "agreement": agreement}
    )
    assert STRATEGIES[config.resolved_agreement] is strategy
    assert set(STRATEGIES) == set(AgreementMode)
