"""``WaveScheduler.withdraw`` of a request while its agreement is under way, when that agreement
then fails or the release of the reservation it made then fails; and a re-form after a
withdrawn request's micro-batch was published. The real scheduler in the simulator (virtual
clock), both admission strategies.

- The agreement fails after the withdrawal (a stage found the entry invalid, a stage's error):
  the withdrawn request is answered once, with its withdrawal (``on_outcome`` called once).
- The agreement succeeds after the withdrawal and releasing its reservation fails (a stage's
  reply lost): the scheduler goes on serving; a request submitted after it is answered.
- Either way no lease of the withdrawn request is renewed and nothing of it stays pinned.
- A re-form while a withdrawn request's micro-batch is in flight (the request answered, still
  live): the re-form forgets it, and the agreement controller renews no lease of it.
- A stage silent through the agreement (retried for ``agreement_retry_s``): a request withdrawn
  after the first attempt is not agreed again.
- A refused request (new agreements held back while it waits for capacity) whose retry fails:
  the requests after it are admitted again.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from wavepp.bench.grid import GridSpec, Setting
from wavepp.launch.grid import runtime_config
from wavepp.runtime.agreement import AgreementRefused, StageUnavailableError
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.planning import Chunk
from wavepp.runtime.request import PromptRequest, RequestOutcome
from wavepp.runtime.scheduling.admission import AdmissionStrategy, AsyncAdmission, SyncAdmission
from wavepp.runtime.scheduling.core import WITHDRAWN_ERROR
from wavepp.sim.bus import SimLatencies
from wavepp.sim.clock import VirtualClockLoop
from wavepp.sim.pipeline import SimPipeline

ZERO = SimLatencies(kv_rtt_s=0.001, bus_latency_s=0.0, hop_s=0.0, prepare_s=0.0)
LONG_TOKENS = 39960  # five chunks of chunk_tokens=8192
SERVED_WITHIN_S = 30.0  # virtual seconds: a 256-token request takes milliseconds


def _prompt(index: int, num_tokens: int) -> list[int]:
    return [1 + (index * 131 + t) % 900 for t in range(num_tokens)]


def _config():  # noqa: ANN202 - a RuntimeConfig and its cost model
    spec = GridSpec(time_scale=1.0, num_stages=2, num_kv_blocks=4096)
    return runtime_config(spec, Setting("glm-5.2", 2, "low", "wave"))


@dataclass
class Served:
    answered: list[str]  # request id of every outcome delivered (on_outcome), in order
    withdrawn: RequestOutcome
    after: RequestOutcome | None  # the request submitted after it; None: never answered
    renewed: frozenset[str]  # the controller's leases renewed at the end
    held: list[set[str]]  # what each stage holds at the end


async def _withdrawn_while_agreeing(
    strategy: type[AdmissionStrategy],
    agree_error: Exception | None,
    release_error: Exception | None,
) -> Served:
    """``w`` is withdrawn while its agreement is under way; then the agreement raises
    ``agree_error``, or (None) succeeds and the first release of ``w`` raises
    ``release_error`` after the stages applied it (the reply lost). Then ``next`` is
    submitted."""
    config, cost = _config()
    async with SimPipeline(config, cost, latencies=ZERO, admission=strategy) as pipeline:
        scheduler = pipeline.scheduler
        assert scheduler is not None
        answered: list[str] = []
        scheduler.on_outcome = lambda outcome: answered.append(outcome.request_id)
        controller = scheduler.controller
        agree, release = controller.agree, controller.release
        agreeing, go_on = asyncio.Event(), asyncio.Event()
        release_failed: list[bool] = []

        async def held_agree(request: PromptRequest):  # noqa: ANN202
            if request.request_id == "w":
                agreeing.set()
                await go_on.wait()
                if agree_error is not None:
                    raise agree_error
            return await agree(request)

        async def flaky_release(request_ids) -> None:  # noqa: ANN001
            await release(request_ids)
            if "w" in request_ids and release_error is not None and not release_failed:
                release_failed.append(True)
                raise release_error

        controller.agree = held_agree  # type: ignore[method-assign]
        controller.release = flaky_release  # type: ignore[method-assign]
        pending = asyncio.create_task(scheduler.submit(PromptRequest("w", _prompt(2, 256))))
        await agreeing.wait()
        assert scheduler.withdraw("w")
        go_on.set()
        withdrawn = await pending
        if release_error is not None:
            await asyncio.sleep(0.1)
            assert release_failed, "the withdrawn request's reservation was never released"
        try:
            after: RequestOutcome | None = await asyncio.wait_for(
                scheduler.submit(PromptRequest("next", _prompt(4, 256))), SERVED_WITHIN_S
            )
        except TimeoutError:
            after = None
        await asyncio.sleep(1.0)  # the releases in the background
        return Served(
            answered=answered,
            withdrawn=withdrawn,
            after=after,
            renewed=controller.live_request_ids,
            held=[set(stage.core.manager.request_ids()) for stage in pipeline.stages],
        )


CASES = [
    pytest.param(AgreementRefused("request w: a stage found it invalid"), None, id="refused"),
    pytest.param(RuntimeError("stage 1: protocol error"), None, id="agree-error"),
    pytest.param(None, StageUnavailableError(1, "no reply to the release"), id="release-error"),
]


@pytest.mark.parametrize("strategy", [AsyncAdmission, SyncAdmission])
@pytest.mark.parametrize(("agree_error", "release_error"), CASES)
def test_a_request_withdrawn_while_agreeing_is_answered_once_and_the_scheduler_goes_on(
    strategy: type[AdmissionStrategy],
    agree_error: Exception | None,
    release_error: Exception | None,
) -> None:
    loop = VirtualClockLoop(start_s=10.0)
    try:
        served = loop.run_until_complete(
            _withdrawn_while_agreeing(strategy, agree_error, release_error)
        )
    finally:
        loop.close()
    assert served.withdrawn.error == WITHDRAWN_ERROR
    assert served.answered.count("w") == 1, served.answered  # its withdrawal, once
    assert served.after is not None, "the scheduler stopped serving after the withdrawal"
    assert served.after.ok, served.after.error
    assert served.answered == ["w", "next"]
    assert served.renewed == frozenset()
    assert served.held == [set(), set()]


async def _reformed_after_a_withdrawal() -> tuple[list[bool], RequestOutcome, frozenset[str]]:
    """``long`` is withdrawn just after its first micro-batch is published, and the replica
    re-forms (``resume_plans(readmit=True)``) while that micro-batch is in flight."""
    config, cost = _config()
    async with SimPipeline(config, cost, latencies=ZERO, admission=AsyncAdmission) as pipeline:
        scheduler = pipeline.scheduler
        assert scheduler is not None
        loop = asyncio.get_running_loop()
        seen: list[bool] = []  # at the re-form: withdrawn, and still live (in flight)
        take_planned = scheduler.core.take_planned

        def withdraw_and_reform() -> None:
            seen.append(scheduler.withdraw("long"))
            seen.append(scheduler.core.is_live("long"))
            scheduler.pause_plans()
            scheduler.resume_plans(readmit=True)

        def planned(chunks: list[Chunk], planning_started_s: float):  # noqa: ANN202
            if not seen and any(chunk.request_id == "long" for chunk in chunks):
                seen.append(True)
                loop.call_later(0.001, withdraw_and_reform)  # once the plan is out
            return take_planned(chunks, planning_started_s)

        scheduler.core.take_planned = planned  # type: ignore[method-assign]
        outcome = await scheduler.submit(PromptRequest("long", _prompt(1, LONG_TOKENS)))
        await asyncio.sleep(2.0)  # its micro-batch's done messages, from before the re-form
        return seen, outcome, scheduler.controller.live_request_ids


def test_a_reform_renews_no_lease_of_a_withdrawn_request_it_forgets() -> None:
    loop = VirtualClockLoop(start_s=10.0)
    try:
        seen, outcome, renewed = loop.run_until_complete(_reformed_after_a_withdrawal())
    finally:
        loop.close()
    assert seen == [True, True, True]  # planned, withdrawn, in flight at the re-form
    assert outcome.error == WITHDRAWN_ERROR
    assert "long" not in renewed


async def _withdrawn_during_an_outage() -> tuple[list[bool], RequestOutcome, RequestOutcome]:
    """A stage does not answer ``w``'s agreement (retried for ``agreement_retry_s``); ``w`` is
    withdrawn after the first attempt. Each attempt records whether ``w`` was withdrawn by
    then."""
    config, cost = _config()
    config = RuntimeConfig.model_validate({**config.model_dump(), "agreement_retry_s": 0.5})
    async with SimPipeline(config, cost, latencies=ZERO, admission=AsyncAdmission) as pipeline:
        scheduler = pipeline.scheduler
        assert scheduler is not None
        controller = scheduler.controller
        agree = controller.agree
        attempts: list[bool] = []
        withdrawn: list[bool] = []
        tried = asyncio.Event()

        async def unavailable(request: PromptRequest):  # noqa: ANN202
            if request.request_id != "w":
                return await agree(request)
            attempts.append(bool(withdrawn))
            tried.set()
            raise StageUnavailableError(1, "no reply within the request timeout")

        controller.agree = unavailable  # type: ignore[method-assign]
        pending = asyncio.create_task(scheduler.submit(PromptRequest("w", _prompt(2, 256))))
        await tried.wait()
        assert scheduler.withdraw("w")
        withdrawn.append(True)
        outcome = await pending
        after = await asyncio.wait_for(
            scheduler.submit(PromptRequest("next", _prompt(4, 256))), SERVED_WITHIN_S
        )
        await asyncio.sleep(3.0)  # past every retry delay
        return attempts, outcome, after


def test_a_request_withdrawn_during_an_outage_is_not_agreed_again() -> None:
    loop = VirtualClockLoop(start_s=10.0)
    try:
        attempts, outcome, after = loop.run_until_complete(_withdrawn_during_an_outage())
    finally:
        loop.close()
    assert outcome.error == WITHDRAWN_ERROR
    assert attempts == [False]  # none after the withdrawal
    assert after.ok, after.error


async def _refused_then_failed() -> tuple[RequestOutcome, RequestOutcome | None]:
    """``w`` is refused (it waits for capacity, new agreements held back), then its retry
    fails with a stage's error; ``next`` is submitted after it ended."""
    config, cost = _config()
    async with SimPipeline(config, cost, latencies=ZERO, admission=AsyncAdmission) as pipeline:
        scheduler = pipeline.scheduler
        assert scheduler is not None
        controller = scheduler.controller
        agree = controller.agree
        num_attempts: list[int] = [0]

        async def refused_then_error(request: PromptRequest):  # noqa: ANN202
            if request.request_id != "w":
                return await agree(request)
            num_attempts[0] += 1
            if num_attempts[0] == 1:
                return None  # refused: nothing held
            raise RuntimeError("stage 1: protocol error")

        controller.agree = refused_then_error  # type: ignore[method-assign]
        failed = await scheduler.submit(PromptRequest("w", _prompt(2, 256)))
        try:
            after: RequestOutcome | None = await asyncio.wait_for(
                scheduler.submit(PromptRequest("next", _prompt(4, 256))), SERVED_WITHIN_S
            )
        except TimeoutError:
            after = None
        return failed, after


def test_a_refused_request_whose_retry_fails_holds_no_admission_back() -> None:
    loop = VirtualClockLoop(start_s=10.0)
    try:
        failed, after = loop.run_until_complete(_refused_then_failed())
    finally:
        loop.close()
    assert failed.error == "agreement failed: stage 1: protocol error"
    assert after is not None, "admission stayed closed after the refused request failed"
    assert after.ok, after.error
