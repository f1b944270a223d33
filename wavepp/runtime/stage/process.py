"""The stage process's main (``wavepp stage``): form the group, build the engine, serve, drain.

``run_stage`` connects to NATS, joins the replica's rendezvous epoch, forms the process group,
starts the tensor-parallel followers (if any) and builds the engine, then runs a ``StageWorker``
(``wavepp.runtime.stage.worker``) until SIGTERM/SIGINT. ``StageReadiness`` is what the stage's
health endpoints report while it does.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
import traceback
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import torch

from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.heap import settle_heap
from wavepp.runtime.stage.build import build_engine
from wavepp.runtime.stage.engine.tensor_parallel import TensorParallelEngine
from wavepp.runtime.stage.metrics import serve_stage_metrics
from wavepp.runtime.stage.rendezvous import StageGroupFactory, open_rendezvous
from wavepp.runtime.stage.worker import StageWorker
from wavepp.runtime.transport.buskey import load_bus_key
from wavepp.runtime.transport.natsio import connect
from wavepp.telemetry import tracing

log = logging.getLogger(__name__)

# A tensor-parallel follower stopped (SIGSTOP) this long stops its stage (a restart beats
# every request waiting for the group's 120 s collective timeout).
TP_STOPPED_LIMIT_S = 5.0


class TensorParallelLost(RuntimeError):
    """The stage stopped because a tensor-parallel follower exited or its group broke."""


@dataclass
class StageReadiness:
    """What a stage's health endpoints report (``wavepp stage --health-port``).

    ``is_formed``: the torch.distributed group has formed and the engine is built (/startupz).
    ``is_serving``: subscribed to its plans and KV requests, not stopping, the compute thread
    alive, and formed with its peers: its epoch's group formed and every peer still beating in
    the rendezvous bucket (``StageWorker.is_group_complete``), so a stage whose group is gone
    answers /readyz 503 within ``rendezvous.PEER_SILENCE_S`` + 2 x ``PEER_BEAT_S`` (/readyz).
    The engine is built (weights loaded) before the worker exists.
    ``is_alive``: the compute thread has not died or stalled (/healthz; True before it starts,
    while the startup probe guards the stage, and once it stopped on request).
    """

    is_formed: bool = False
    worker: StageWorker | None = None

    @property
    def is_serving(self) -> bool:
        worker = self.worker
        return (
            worker is not None
            and worker.is_serving
            and worker.compute_alive
            and worker.is_group_complete
        )

    @property
    def is_alive(self) -> bool:
        worker = self.worker
        if worker is None or worker._thread is None:
            return True
        if worker.compute_error is not None:
            return False
        return worker.compute_alive or not worker.is_serving


async def run_stage(
    config: RuntimeConfig,
    rank: int,
    nats_url: str,
    dist_url: str,
    *,
    nats_creds: str | None = None,
    readiness: StageReadiness | None = None,
    metrics_host: str = "0.0.0.0",
) -> None:
    """Process main of ``wavepp stage``: form, serve until SIGTERM/SIGINT, drain, leave.

    Args:
        config: the replica's RuntimeConfig.
        rank: this stage's rank in [0, S).
        nats_url: NATS server URL.
        dist_url: torch.distributed init method (``tcp://host:port`` of rank 0).
        nats_creds: NATS credentials file (None: ``WAVEPP_NATS_CREDS`` or none).
        readiness: updated as the stage forms and serves (for health endpoints), if given.
        metrics_host: bind address of the stage's ``/metrics`` (``--metrics-host``).
    """
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s stage{rank} %(levelname)s %(name)s: %(message)s"
    )
    torch.set_num_threads(config.torch_threads)
    tracing.setup(config.telemetry, f"wavepp-stage-{rank}")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    bus_key = load_bus_key()
    nc = await connect(nats_url, name=f"{config.pipeline}-stage-{rank}", creds=nats_creds)
    followers = None
    watch: asyncio.Task[str] | None = None
    metrics = None
    rendezvous = None
    try:
        if config.tensor_parallel_size > 1:
            from wavepp.runtime.stage.tp_launch import start_followers

            followers = await asyncio.to_thread(start_followers, config, rank, bus_key=bus_key)
        backend = config.resolved_activation_backend
        factory = StageGroupFactory(
            dist_url, rank, config.num_stages, backend, bus_key=bus_key, pipeline=config.pipeline
        )
        rendezvous = await open_rendezvous(
            nc, config.pipeline, rank, config.num_stages, namespace=config.namespace
        )
        epoch = 0
        if rendezvous is not None:
            epoch = await rendezvous.first_epoch()
            while not await rendezvous.join(epoch):
                epoch = await rendezvous.wait_newer(epoch)
            if config.num_stages == 1:
                await rendezvous.close()  # no peers to follow: the bucket's watch ends here
        group = None
        if config.num_stages > 1:
            group = await asyncio.to_thread(factory.form, epoch)
        log.info("stage %d: group formed in epoch %d", rank, epoch)
        if followers is None:
            engine = await asyncio.to_thread(build_engine, config, rank)
        else:
            inner = await asyncio.to_thread(build_engine, config, rank, followers.tp)
            engine = TensorParallelEngine(inner, followers.tp)
            watch = asyncio.create_task(_watch_followers(followers, engine, rank, stop))
        if readiness is not None:
            readiness.is_formed = True
        worker = StageWorker(
            config,
            rank,
            nc,
            engine,
            group=group,
            group_epoch=epoch,
            rendezvous=rendezvous if config.num_stages > 1 else None,
            factory=factory,
            bus_key=bus_key,
        )
        if readiness is not None:
            readiness.worker = worker
        metrics = serve_stage_metrics(worker, config.telemetry.metrics_port, metrics_host)
        # The block pool and the engine live as long as the process: out of the collector's
        # generations, so a full collection does not walk their block objects; and young
        # collections kept short (``wavepp.runtime.heap``).
        settle_heap()
        await worker.serve(stop)
        if watch is not None and watch.done() and watch.result():
            raise TensorParallelLost(watch.result())  # `wavepp stage` exits 1: restart it
    finally:
        if metrics is not None:
            metrics.shutdown()
        if watch is not None:
            watch.cancel()
        if followers is not None:
            followers.stop()
        if rendezvous is not None:
            await rendezvous.close()
        await nc.drain()
        tracing.shutdown()


def run_leaving_threads(main: Coroutine[Any, Any, None]) -> None:
    """Run ``main`` on a new event loop, cancel the tasks it left, and close the loop without
    joining the threads of the loop's default executor (``asyncio.to_thread``).

    ``asyncio.run`` joins them, with no time limit on Python 3.11: a thread still blocked in a
    group formation or a collective whose peer died (a TP follower killed, a stage gone) would
    hold the process until that call's timeout (120 s or more) after everything the stage owns
    has drained. The caller then leaves with ``os._exit``, which does not wait for them either.

    Raises:
        Whatever ``main`` raised (after the clean-up).
    """
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(main)
    finally:
        left = asyncio.all_tasks(loop)
        for task in left:
            task.cancel()
        if left:
            loop.run_until_complete(asyncio.wait(left))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()  # shuts the default executor down without waiting for its threads


def stage_exit_code(main: Coroutine[Any, Any, None]) -> int:
    """Run ``main`` with :func:`run_leaving_threads`; return the process's exit code: 0 when
    ``main`` returned or a KeyboardInterrupt ended it; 1 when it raised
    :class:`TensorParallelLost` (its message on stderr) or any other exception (its traceback
    on stderr). Nothing but a BaseException other than KeyboardInterrupt leaves this call, so
    the caller reaches its ``os._exit``: an exception leaving through interpreter exit would
    join the threads still blocked in a call.
    """
    try:
        run_leaving_threads(main)
    except KeyboardInterrupt:
        return 0
    except TensorParallelLost as exc:
        print(f"wavepp stage: {exc}", file=sys.stderr)
        return 1
    except Exception:  # noqa: BLE001 - any failure of the stage: exit 1 with its traceback
        traceback.print_exc()
        return 1
    return 0


async def _watch_followers(
    followers,  # noqa: ANN001 - tp_launch.FollowerSet (imported only with TP)
    engine: TensorParallelEngine,
    rank: int,
    stop: asyncio.Event,
) -> str:
    """Stop the stage when a tensor-parallel follower exits (its shard is gone), stays stopped
    (SIGSTOP) for ``TP_STOPPED_LIMIT_S`` (it would hold every collective until the group's
    timeout, 120 s), or a batch left the TP group out of step (``engine.broken``): the stage
    cannot compute any more; the pod or ``wavepp up`` restarts it whole. Returns why ("" when
    the stage stopped first)."""
    stopped_since: float | None = None
    while not stop.is_set():
        exited = followers.exited()
        stopped = followers.stopped()
        now = time.monotonic()
        stopped_since = (stopped_since or now) if stopped else None
        why = ""
        if exited:
            why = f"stage {rank}: tensor-parallel follower(s) (TP rank, exit code) {exited} exited"
        elif stopped_since is not None and now - stopped_since >= TP_STOPPED_LIMIT_S:
            why = (
                f"stage {rank}: tensor-parallel follower(s) (TP rank) {stopped} stopped for "
                f"{TP_STOPPED_LIMIT_S:g} s"
            )
        elif engine.broken is not None:
            why = f"stage {rank}: tensor-parallel group broken by {engine.broken!r}"
        if why:
            log.error("%s; stopping", why)
            stop.set()
            return why
        await asyncio.sleep(0.5)
    return ""
