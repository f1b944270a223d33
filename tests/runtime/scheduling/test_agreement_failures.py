"""An agreement that fails because a stage does not answer (down, or its replica re-forming)
ends its request with a retryable error, which the admission's answer carries
(``PrefillResult.retryable``: the gateway's 503 with Retry-After); any other agreement failure
is not retryable. Both admission strategies, the real scheduler in the simulator."""

from __future__ import annotations

import asyncio

import pytest

from wavepp.api.prefill import IntakeRequest
from wavepp.bench.grid import GridSpec, Setting
from wavepp.launch.grid import runtime_config
from wavepp.runtime.agreement import StageUnavailableError
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.request import PromptRequest, RequestOutcome
from wavepp.runtime.scheduling.admission import AdmissionStrategy, AsyncAdmission, SyncAdmission
from wavepp.runtime.serving.results import result_from_outcome
from wavepp.sim.bus import SimLatencies
from wavepp.sim.clock import VirtualClockLoop
from wavepp.sim.pipeline import SimPipeline

ZERO = SimLatencies(kv_rtt_s=0.001, bus_latency_s=0.0, hop_s=0.0, prepare_s=0.0)


async def _serve(strategy: type[AdmissionStrategy]) -> dict[str, RequestOutcome]:
    spec = GridSpec(time_scale=1.0, num_stages=2, num_kv_blocks=4096)
    config, cost = runtime_config(spec, Setting("glm-5.2", 2, "low", "wave"))
    # no retry of a silent stage: the failure is the answer at once
    config = RuntimeConfig.model_validate({**config.model_dump(), "agreement_retry_s": 0.0})
    async with SimPipeline(config, cost, latencies=ZERO, admission=strategy) as pipeline:
        scheduler = pipeline.scheduler
        assert scheduler is not None
        agree = scheduler.controller.agree

        async def failing(request: PromptRequest):  # noqa: ANN202
            if request.request_id == "down":
                raise StageUnavailableError(1, "no stage listens on wavepp.local.p.stage.1.kv")
            if request.request_id == "broken":
                raise RuntimeError("a bug")
            return await agree(request)

        scheduler.controller.agree = failing  # type: ignore[method-assign]
        now = asyncio.get_running_loop().time()
        names = ["ok", "down", "broken"]
        outcomes = await asyncio.gather(
            *(
                scheduler.submit(
                    PromptRequest(n, [1 + i + t % 900 for t in range(64)], arrival_s=now)
                )
                for i, n in enumerate(names)
            )
        )
    return dict(zip(names, outcomes, strict=True))


@pytest.mark.parametrize("strategy", [AsyncAdmission, SyncAdmission])
def test_a_silent_stage_fails_the_agreement_retryably(strategy: type[AdmissionStrategy]) -> None:
    loop = VirtualClockLoop(start_s=10.0)
    try:
        outcomes = loop.run_until_complete(_serve(strategy))
    finally:
        loop.close()
    assert outcomes["ok"].ok and not outcomes["ok"].is_retryable
    down, broken = outcomes["down"], outcomes["broken"]
    assert "stage 1: no stage listens" in down.error and down.is_retryable
    assert "a bug" in broken.error and not broken.is_retryable
    intake = IntakeRequest(
        key="t.down", request_id="down", tenant="t", cache_salt="", token_ids=[1], arrival_s=0.0
    )
    assert result_from_outcome(intake, down, replica="p-r0", stages=[]).retryable
    assert not result_from_outcome(intake, broken, replica="p-r0", stages=[]).retryable
