"""``wavepp stage``: one pipeline stage process (what each stage pod runs).

Two ways to name the configuration:

- ``--runtime-config F``: a resolved RuntimeConfig JSON (``wavepp up`` writes one per replica);
- ``--config SPEC --replica I``: the WavePipeline spec (the operator's ``spec.json``) and the
  replica index (``wavepp.launch.replica.runtime_config_from_args``).

``--rank`` may be an integer or the unexpanded ``$(WAVEPP_RANK)``; absent or unexpanded, the
environment variable ``WAVEPP_RANK`` gives the rank. ``--health-port P`` serves, on the stage's
event loop (aiohttp):

| path        | 200 when                                                              |
| ----------- | --------------------------------------------------------------------- |
| /healthz    | the compute thread is alive (it feeds its own beat; a raise or stall ends it) |
| /startupz   | the torch.distributed group has formed and the engine is built        |
| /readyz     | serving (subscribed to its plans and KV requests, engine built), not stopping, compute alive, formed with every peer (their beats in the rendezvous bucket fresh) |

otherwise 503. With ``--tensor-parallel-size T`` (or the configuration's ``tensor_parallel_size``,
the spec's ``tensorParallelSize``) the process is the stage's TP rank 0 and starts T - 1
follower processes, one per device (``wavepp.runtime.stage.tp_launch``). A configuration the stage cannot honour (a bad flag or spec, CUDA asked for but
absent, weights not there) is one line naming the flag or field and exit 2, or
``$WAVEPP_CONFIG_EXIT_CODE`` (78 in the operator's pods: ``CONFIG_EXIT_CODE``; see
``wavepp.cmd.common.config_exit_code``). The configuration is resolved by ``wavepp.launch.replica``; this module
parses the flags and runs the stage; it imports nothing heavy at module level.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from wavepp.cmd.common import add_nats_args, add_replica_config_args
from wavepp.launch.flags import POOL_ENV, RANK_ENV


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_replica_config_args(parser, runtime_config_help="path of the resolved RuntimeConfig JSON")
    parser.add_argument(
        "--pool",
        default=None,
        help=f"pool name (with --config); default: ${POOL_ENV} (set by the operator)",
    )
    parser.add_argument(
        "--rank",
        default=None,
        help=f"stage rank r in [0, S); absent or an unexpanded $({RANK_ENV}): ${RANK_ENV}",
    )
    add_nats_args(parser, url_help="NATS server URL, e.g. nats://host:4222")
    parser.add_argument(
        "--dist-url",
        required=True,
        help="torch.distributed init method, e.g. tcp://stage-0.pipeline:29500",
    )
    parser.add_argument(
        "--health-port",
        type=int,
        default=None,
        help="serve /healthz, /startupz, /readyz on this port (none: no health server)",
    )
    parser.add_argument("--health-host", default="0.0.0.0", help="bind address of --health-port")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve the stage's Prometheus /metrics on this port (none: no metrics; "
        "wavepp.runtime.stage.metrics)",
    )
    parser.add_argument(
        "--metrics-host",
        default="0.0.0.0",
        help="bind address of --metrics-port (wavepp up passes its --host)",
    )
    parser.add_argument(
        "--cores",
        default=None,
        help="run on these CPU ids only, e.g. 0,1 (what a local launcher gives a stage with "
        "engineOptions.pinCores; wavepp.runtime.stage.placement); default: every core allowed",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=None,
        metavar="T",
        help="processes computing this stage, one per device (cuda:0..T-1, or T CPU processes "
        "over gloo); default: the configuration's (spec.tensorParallelSize)",
    )


def run(args: argparse.Namespace) -> int:
    from wavepp.runtime.serving.lifecycle import exit_with_parent

    exit_with_parent()
    from wavepp.cmd.common import config_exit_code, startup_failure
    from wavepp.launch.flags import (
        ArgError,
        apply_nats_tls,
        check_creds,
        check_port,
        describe_error,
        resolve_rank,
    )
    from wavepp.launch.replica import stage_config_from_args
    from wavepp.runtime.serving.health import start_health_server
    from wavepp.runtime.stage.build import check_environment
    from wavepp.runtime.stage.placement import parse_cores, pin_to
    from wavepp.runtime.stage.process import (
        StageReadiness,
        run_stage,
        stage_exit_code,
    )
    from wavepp.runtime.transport.buskey import BusKeyError, load_bus_key

    try:
        config = stage_config_from_args(args, os.environ)
        rank = resolve_rank(args.rank, os.environ)
        if args.nats_creds:  # the operator's per-rank file, should the kubelet not expand it
            args.nats_creds = args.nats_creds.replace("$(WAVEPP_RANK)", str(rank))
        check_creds(args.nats_creds)
        apply_nats_tls(args)
        check_port("--health-port", args.health_port)
        check_environment(config)
        load_bus_key()  # a bad WAVEPP_BUS_KEY is a one-line error here, not a traceback later
        if args.cores is not None:
            pin_to(parse_cores(args.cores))  # before torch starts its threads
    except (ArgError, ValueError, BusKeyError) as exc:
        print(f"wavepp stage: {describe_error(exc)}", file=sys.stderr)
        return config_exit_code(os.environ)
    if not 0 <= rank < config.num_stages:
        print(f"wavepp stage: --rank {rank}: must be in [0, {config.num_stages})", file=sys.stderr)
        return config_exit_code(os.environ)
    failure = startup_failure(
        args.nats_url,
        args.nats_connect_timeout_s,
        [
            ("--health-port", args.health_host, args.health_port),
            ("--metrics-port", args.metrics_host, args.metrics_port),
        ],
    )
    if failure is not None:  # not a config error: the operator restarts the pod
        print(f"wavepp stage: {failure}", file=sys.stderr)
        return 2

    async def main() -> None:
        readiness = StageReadiness()
        runner = None
        if args.health_port is not None:
            runner, port = await start_health_server(
                args.health_host,
                args.health_port,
                {
                    "/healthz": lambda: readiness.is_alive,
                    "/startupz": lambda: readiness.is_formed,
                    "/readyz": lambda: readiness.is_serving,
                },
            )
            print(f"wavepp stage {rank}: health on port {port}", file=sys.stderr, flush=True)
        try:
            await run_stage(
                config,
                rank,
                args.nats_url,
                args.dist_url,
                nats_creds=args.nats_creds,
                readiness=readiness,
                metrics_host=args.metrics_host,
            )
        finally:
            if runner is not None:
                await runner.cleanup()

    code = stage_exit_code(main())
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # The gloo process group and threads blocked in recv() or a group formation would hold the
    # interpreter at exit; everything this process owns is already drained.
    os._exit(code)
