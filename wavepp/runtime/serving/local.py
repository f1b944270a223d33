"""A whole pipeline on this machine: an embedded nats-server, S stage processes, and the
agreement controller + wave scheduler in the calling process.

    async with LocalPipeline(config) as pipeline:
        outcome = await pipeline.scheduler.submit(PromptRequest("r1", token_ids))

Stage processes are ``wavepp stage`` commands (the same ones pods run), started and stopped
by ``processes.Supervisor`` (logs ``LOG_DIR/stage<rank>.log``). Startup waits for every
stage to answer a health probe, with a deadline, and fails fast (with the stage's log tail) if a
stage process dies. Shutdown stops the scheduler, then SIGTERMs the stages, waits, kills.

The bus is secured as under ``wavepp up``: the embedded nats-server trusts only fresh keys
(``transport.auth.write_pool_auth``, written to ``LOG_DIR/nats-auth/``, mode 0700) and refuses
anonymous clients; each stage connects as its own stage user and the scheduler as the replica's
admission user (``wavepp.api.permissions``); every round, plan and done is signed with the bus
key (the environment's ``WAVEPP_BUS_KEY``, else a new one), handed to the stages through their
environment. With ``nats_url`` (an external server) no credentials are made: the processes use
``WAVEPP_NATS_CREDS`` if set.

Every stage computes on ``config.device``; on ``cuda`` they all share cuda:0, so activations
move through host memory (gloo) unless ``config.activation_backend`` asks for nccl.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NATS

from wavepp.api.cli_args import NatsArgs
from wavepp.api.messages import Health
from wavepp.runtime.agreement import AgreementController, StageUnavailableError
from wavepp.runtime.agreement.coordinator import check_stage_versions
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.planning import CostModel, planner_for
from wavepp.runtime.request import RequestOutcome
from wavepp.runtime.scheduling.nats_transport import NatsPlanTransport
from wavepp.runtime.scheduling.scheduler import WaveScheduler
from wavepp.runtime.serving.controller import replica_controller
from wavepp.runtime.serving.handoff import kv_transfer_params, stage_endpoints
from wavepp.runtime.serving.processes import Supervisor, pool_nats_server, stage_command
from wavepp.runtime.transport.auth import PoolAuth
from wavepp.runtime.transport.buskey import BUS_KEY_ENV, bus_key_or_new
from wavepp.runtime.transport.natsio import EmbeddedNatsServer, connect, free_port
from wavepp.telemetry import tracing
from wavepp.telemetry.metrics import get_metrics, setup_metrics, shutdown_metrics

log = logging.getLogger(__name__)

# The pool name of a local pipeline's NATS users (``wavepp up``'s default ``--pool``).
LOCAL_POOL = "default"


def _stage_name(rank: int) -> str:
    """The supervisor's name (and log file stem) of stage ``rank``."""
    return f"stage{rank}"


class LocalPipeline:
    """Starts and stops a local pipeline. See the module docstring."""

    def __init__(
        self,
        config: RuntimeConfig,
        planner_cost_model: CostModel,
        *,
        nats_url: str | None = None,
        startup_timeout_s: float = 120.0,
        log_dir: str | None = None,
    ) -> None:
        if (
            config.device.startswith("cuda")
            and config.num_stages > 1
            and config.activation_backend is None
        ):
            # every stage of a local pipeline computes on the same GPU (cuda:0), where NCCL
            # refuses a second rank: activations go through host memory
            config = config.model_copy(update={"activation_backend": "gloo"})
        self.config = config
        self.planner_cost_model = planner_cost_model
        self.external_nats_url = nats_url
        self.startup_timeout_s = startup_timeout_s
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="wavepp-stages-"))
        self.server: EmbeddedNatsServer | None = None
        self.supervisor = Supervisor(self.log_dir, prog="wavepp")
        self._stage_names: list[str] = []
        self.nc: NATS | None = None
        self.controller: AgreementController | None = None
        self.scheduler: WaveScheduler | None = None
        self._config_path = self.log_dir / "runtime-config.json"
        # The bus key the stages and this scheduler sign with: the environment's, else a new one.
        self.bus_key = bus_key_or_new()
        # The embedded server's trust root and each component's credentials (after start).
        self.auth: PoolAuth | None = None
        # Telemetry of this (scheduler) process, unless the caller set it up already (tests).
        self._owns_tracing = False
        self._owns_metrics = False
        # Each stage's KV transfer server, by rank (from its health reply; "" none).
        self.handoff_addrs: list[str] = []

    @property
    def nats_url(self) -> str:
        if self.external_nats_url:
            return self.external_nats_url
        assert self.server is not None, "pipeline not started"
        return self.server.url

    @property
    def procs(self) -> list[subprocess.Popen[bytes]]:
        """The stage processes, by rank (empty before start and after stop)."""
        return [self.supervisor.procs[_stage_name(r)] for r in range(len(self._stage_names))]

    def start_stages(self, dist_url: str) -> None:
        """Start the S stage processes (``api.cli_args.stage_args``), rendezvous ``dist_url``."""
        env = dict(
            os.environ,
            OMP_NUM_THREADS=str(self.config.torch_threads),
            **{BUS_KEY_ENV: self.bus_key.hex()},
        )
        self._stage_names = [_stage_name(rank) for rank in range(self.config.num_stages)]
        for rank, name in enumerate(self._stage_names):
            self.supervisor.start(name, self.stage_command(rank, dist_url), env)

    def stage_command(self, rank: int, dist_url: str) -> list[str]:
        """Stage ``rank``'s ``wavepp stage`` command (``processes.stage_command``); with
        ``pin_cores`` it runs on its share of this process's cores.

        Raises:
            ValueError: naming ``engineOptions.pinCores``: fewer cores than stages."""
        creds = None if self.auth is None else self.auth.stage(self.config.pipeline, rank)
        return stage_command(
            self.config, str(self._config_path), rank, dist_url, NatsArgs(self.nats_url, creds)
        )

    def stage_log_tail(self, rank: int, num_lines: int = 20) -> str:
        return self.supervisor.log_tail(_stage_name(rank), num_lines)

    async def __aenter__(self) -> LocalPipeline:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._config_path.write_text(self.config.model_dump_json())
        if not tracing.is_enabled():
            self._owns_tracing = tracing.setup(self.config.telemetry, "wavepp-scheduler")
        if get_metrics() is None:
            self._owns_metrics = (
                setup_metrics(self.config.telemetry, "wavepp-scheduler") is not None
            )
        if not self.external_nats_url:
            self.auth, self.server = pool_nats_server(
                self.log_dir / "nats-auth",
                self.log_dir,
                pool=LOCAL_POOL,
                replicas={self.config.pipeline: self.config.num_stages},
                namespace=self.config.namespace,
            )
            self.server.start()
        self.start_stages(f"tcp://127.0.0.1:{free_port()}")
        self.nc = await connect(
            self.nats_url,
            name=f"{self.config.pipeline}-scheduler",
            creds=None if self.auth is None else self.auth.admission(self.config.pipeline),
        )
        self.controller = replica_controller(
            self.nc,
            self.config,
            self.planner_cost_model,
            self.bus_key.for_replica(self.config.pipeline),
        )
        await self.wait_formed()
        planner = planner_for(self.config, self.planner_cost_model)
        self.scheduler = WaveScheduler(
            self.config,
            NatsPlanTransport(self.nc, self.config.subjects),
            self.controller,
            planner,
        )
        await self.scheduler.start()

    async def wait_formed(self) -> None:
        """Wait until every stage answers a health probe; fail fast if one died.

        Raises:
            RuntimeError: a stage process exited.
            TimeoutError: a stage did not answer within ``startup_timeout_s``.
            StageVersionError: a stage speaks another agreement protocol version.
        """
        assert self.controller is not None
        deadline = time.monotonic() + self.startup_timeout_s
        self.handoff_addrs = ["" for _ in self.controller.stages]
        for stage in self.controller.stages:
            while True:
                proc = self.procs[stage.rank]
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"stage {stage.rank} exited with code {proc.returncode} during startup:\n"
                        + self.stage_log_tail(stage.rank)
                    )
                try:
                    with contextlib.suppress(asyncio.TimeoutError):
                        reply = await asyncio.wait_for(stage.call(Health()), 2.0)
                        check_stage_versions([reply])  # StageVersionError: another build
                        if reply.ok:
                            self.handoff_addrs[stage.rank] = reply.handoff_addr
                            break
                except StageUnavailableError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"stage {stage.rank} not formed in {self.startup_timeout_s}s:\n"
                        + self.stage_log_tail(stage.rank)
                    )
                await asyncio.sleep(0.1)

    def kv_transfer_params(self, outcome: RequestOutcome) -> dict[str, Any]:
        """The ``kv_transfer_params`` that hand ``outcome``'s KV to a decode engine
        (``serving.handoff``).

        Raises:
            ValueError: the request did not ask for a handoff, failed, or a stage has no
                transfer server.
        """
        if not outcome.ok or not outcome.handoff_expires:
            raise ValueError(
                f"request {outcome.request_id!r}: no KV to hand off "
                f"({outcome.error or 'PromptRequest.handoff was not set'})"
            )
        endpoints = stage_endpoints(
            self.handoff_addrs, [self.config.layers_of(r) for r in range(self.config.num_stages)]
        )
        return kv_transfer_params(
            self.bus_key.for_replica(self.config.pipeline),
            outcome.request_id,
            outcome.num_prompt_tokens,
            outcome.handoff_expires,
            endpoints,
        )

    async def restart_stages(self) -> None:
        """Re-form the replica: kill every stage process, start all S again with a new dist url.

        A torch.distributed group cannot be rejoined once a member died, so every stage restarts
        (empty KV caches) and forms a new group. The scheduler and the agreement controller stay;
        the scheduler publishes no plan meanwhile (``pause_plans``). Returns once every new
        stage answers a health probe (``wait_formed``), i.e. has subscribed to the plans.

        Raises:
            RuntimeError: a new stage process exited during startup.
            TimeoutError: a new stage did not answer within ``startup_timeout_s``.
        """
        if self.scheduler is not None:
            self.scheduler.pause_plans()  # a plan must reach all new stages or none
        try:
            await asyncio.to_thread(self.supervisor.kill, self._stage_names)
            self.start_stages(f"tcp://127.0.0.1:{free_port()}")
            await self.wait_formed()
        finally:
            if self.scheduler is not None:
                self.scheduler.resume_plans()

    async def stop(self) -> None:
        if self.scheduler is not None:
            await self.scheduler.stop()
            self.scheduler = None
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.drain()
            self.nc = None
        await asyncio.to_thread(self.supervisor.stop, self._stage_names)
        self._stage_names = []
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self._owns_tracing:
            tracing.shutdown()
            self._owns_tracing = False
        if self._owns_metrics:
            shutdown_metrics()
            self._owns_metrics = False
