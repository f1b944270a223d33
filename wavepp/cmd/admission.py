"""``wavepp admission``: one replica's admission controller + wave scheduler, serving its
durable JetStream intake (what each replica's admission pod runs).

The configuration comes from ``--runtime-config F`` (``wavepp up``) or ``--config SPEC --replica
I`` (the operator: the replica's RuntimeConfig from the spec, see ``wavepp stage``). The pool name
is ``--pool`` or ``$WAVEPP_PIPELINE``. ``--health-port P`` serves ``/healthz`` (NATS connected) and
``/readyz`` (every stage formed, intake open, not stopping: SIGTERM turns it 503 at once while
admitted requests finish). On SIGTERM the replica drains (``serving.service``: it leaves the
gateway's pool at once, serves what its intake holds, at most ``--drain-timeout-s``, then exits;
the operator passes the spec's ``rollout.drainTimeoutSeconds`` less a margin). Tracing (``tracing.setup``) and Prometheus metrics (``setup_metrics``)
follow the config's telemetry settings and are shut down at exit.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING

from wavepp.cmd.common import (
    add_nats_args,
    add_replica_config_args,
    finite_float,
)

if TYPE_CHECKING:
    from wavepp.runtime.serving.service import AdmissionService


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_replica_config_args(parser, runtime_config_help="the replica's RuntimeConfig JSON")
    add_nats_args(parser)
    parser.add_argument(
        "--pool",
        default=None,
        help="pool name (results bucket and subjects); default: $WAVEPP_PIPELINE",
    )
    parser.add_argument(
        "--health-port",
        type=int,
        default=None,
        help="serve /healthz and /readyz on this port (default: no health server)",
    )
    parser.add_argument("--health-host", default="0.0.0.0", help="bind address of --health-port")
    parser.add_argument(
        "--metrics-host",
        default="0.0.0.0",
        help="bind address of the config's Prometheus metrics port (wavepp up passes its --host)",
    )
    parser.add_argument(
        "--ack-wait-s", type=finite_float, default=10.0, help="redelivery delay of unacked requests"
    )
    parser.add_argument(
        "--drain-timeout-s",
        type=finite_float,
        default=30.0,
        help="on SIGTERM, serve what the intake holds for at most this long, then exit",
    )
    parser.add_argument(
        "--max-outstanding",
        type=int,
        default=64,
        help="requests of this replica taken from the intake and not yet answered",
    )
    parser.add_argument(
        "--planner-cost-model",
        default="",
        help="CostModel JSON for the planner (default: the config's, else the packaged "
        "tiny-llama CPU fit)",
    )


def _is_admitting(service: AdmissionService, stop: asyncio.Event) -> bool:
    """/readyz: every stage answered its probe, the intake is open, and no stop was asked."""
    return (
        not stop.is_set()
        and service.is_intake_open
        and service.num_stages_formed == service.config.num_stages
    )


def run(args: argparse.Namespace) -> int:
    from wavepp.runtime.serving.lifecycle import exit_with_parent

    exit_with_parent()
    from wavepp.cmd.common import config_exit_code, startup_failure
    from wavepp.launch.flags import (
        ArgError,
        apply_nats_tls,
        check_creds,
        check_flag,
        check_port,
    )
    from wavepp.launch.replica import admission_pool, planner_cost_model, runtime_config_from_args
    from wavepp.runtime.serving.health import start_health_server
    from wavepp.runtime.serving.service import AdmissionService
    from wavepp.runtime.transport.buskey import BusKeyError, load_bus_key
    from wavepp.runtime.transport.natsio import connect
    from wavepp.telemetry import tracing
    from wavepp.telemetry.metrics import setup_metrics, shutdown_metrics

    try:
        config = runtime_config_from_args(args, os.environ)
        pool = admission_pool(args, os.environ)
        check_creds(args.nats_creds)
        apply_nats_tls(args)
        check_port("--health-port", args.health_port)
        check_flag("--ack-wait-s", args.ack_wait_s, args.ack_wait_s > 0, "> 0")
        check_flag("--drain-timeout-s", args.drain_timeout_s, args.drain_timeout_s >= 0, ">= 0")
        check_flag("--max-outstanding", args.max_outstanding, args.max_outstanding >= 1, ">= 1")
    except ArgError as exc:
        print(f"wavepp admission: {exc}", file=sys.stderr)
        return config_exit_code(os.environ)
    # Logging first, then everything that may log (the bus key's warning included): a record
    # emitted before would reach logging's last-resort handler, without time or component.
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s admission[{config.pipeline}] %(levelname)s %(name)s: %(message)s",
    )
    try:
        bus_key = load_bus_key()  # a bad WAVEPP_BUS_KEY: one line, before anything connects
    except BusKeyError as exc:
        print(f"wavepp admission: {exc}", file=sys.stderr)
        return 2
    failure = startup_failure(
        args.nats_url,
        args.nats_connect_timeout_s,
        [("--health-port", args.health_host, args.health_port)],
    )
    if failure is not None:
        print(f"wavepp admission: {failure}", file=sys.stderr)
        return 2
    cost = planner_cost_model(config, args.planner_cost_model)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        tracing.setup(config.telemetry, "wavepp-admission")
        setup_metrics(config.telemetry, "wavepp-admission", host=args.metrics_host)
        runner = None
        nc = None
        try:
            nc = await connect(
                args.nats_url, name=f"{config.pipeline}-admission", creds=args.nats_creds
            )
            service = AdmissionService(
                config,
                nc,
                cost,
                pool=pool,
                ack_wait_s=args.ack_wait_s,
                max_concurrent=args.max_outstanding,
                bus_key=bus_key,
                drain_timeout_s=args.drain_timeout_s,
            )
            if args.health_port is not None:
                runner, port = await start_health_server(
                    args.health_host,
                    args.health_port,
                    {
                        "/healthz": lambda: nc is not None and nc.is_connected,
                        "/readyz": lambda: _is_admitting(service, stop),
                    },
                )
                logging.getLogger(__name__).info("health on port %d", port)
            await service.run(stop)
        finally:
            if runner is not None:
                await runner.cleanup()
            if nc is not None:
                # A drain that does not finish (seen when the JetStream pull subscription's
                # fetch was cancelled at stop) must not hold SIGTERM for the kill timeout.
                try:
                    await asyncio.wait_for(nc.drain(), timeout=3.0)
                except (TimeoutError, Exception):  # noqa: BLE001 - closing anyway
                    await nc.close()
            shutdown_metrics()
            tracing.shutdown()

    asyncio.run(main())
    return 0
