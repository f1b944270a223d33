"""``wavepp gateway``: the prefill API over HTTP and NATS (what the gateway pod runs).

The configuration comes from ``--gateway-config F`` (a GatewayConfig JSON, ``wavepp up`` writes
it) or from ``--config SPEC --pool-file POOL_JSON`` (the operator's ``spec.json`` and ``pool.json``):
see ``wavepp.launch.gateway``. ``--host`` defaults to 127.0.0.1 with ``--gateway-config``
and to 0.0.0.0 (a pod) with ``--config``.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import os
import sys

from wavepp.cmd.common import add_nats_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--gateway-config", help="GatewayConfig JSON")
    source.add_argument(
        "--config",
        help="WavePipeline spec (YAML/JSON, e.g. /etc/wavepp/spec.json); with --pool-file",
    )
    parser.add_argument(
        "--pool-file",
        default=None,
        help="the operator's pool.json (with --config): pool name, replicas",
    )
    add_nats_args(parser)
    parser.add_argument(
        "--host",
        default=None,
        help="HTTP bind address (default 127.0.0.1; 0.0.0.0 with --config)",
    )
    parser.add_argument("--port", type=int, default=8000, help="HTTP port")
    parser.add_argument(
        "--routing",
        choices=["prefix", "round_robin", "least_loaded"],
        default=None,
        help="override the config's routing policy",
    )
    parser.add_argument(
        "--max-queued",
        type=int,
        default=None,
        help="override the config's max_queued_requests (default 1024): requests queued or "
        "running in the gateway, all tenants; past it: 429",
    )


def run(args: argparse.Namespace) -> int:
    from wavepp.runtime.serving.lifecycle import exit_with_parent

    exit_with_parent()
    from wavepp.cmd.common import config_exit_code, startup_failure
    from wavepp.gateway.http import load_tokenizer, run_gateway
    from wavepp.launch.flags import ArgError, apply_nats_tls, check_creds, describe_error
    from wavepp.launch.gateway import gateway_config_from_args, gateway_host
    from wavepp.runtime.transport.buskey import BusKeyError, load_bus_key

    # Logging first, then everything that may log (the bus key's warning included): a record
    # emitted before would reach logging's last-resort handler, without time or component.
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s gateway %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = gateway_config_from_args(args)
        check_creds(args.nats_creds)
        apply_nats_tls(args)
        load_bus_key()  # a bad WAVEPP_BUS_KEY is a one-line error here
    except (ArgError, BusKeyError) as exc:
        print(f"wavepp gateway: {exc}", file=sys.stderr)
        return config_exit_code(os.environ)
    tokenizer = None
    if config.tokenizer:
        try:
            tokenizer = load_tokenizer(config.tokenizer)
        except Exception as exc:  # noqa: BLE001 - tokenizers raises its own Exception types
            print(f"wavepp gateway: tokenizer: {describe_error(exc)}", file=sys.stderr)
            return config_exit_code(os.environ)
    if not 0 < args.port < 65536:
        print(f"wavepp gateway: --port {args.port}: must be in [1, 65535]", file=sys.stderr)
        return config_exit_code(os.environ)
    host = gateway_host(args)
    failure = startup_failure(
        args.nats_url, args.nats_connect_timeout_s, [("--port", host, args.port)]
    )
    if failure is not None:
        print(f"wavepp gateway: {failure}", file=sys.stderr)
        return 2
    if args.nats_creds:
        # NOTE: run_gateway opens its connection with natsio.connect, which reads this.
        os.environ["WAVEPP_NATS_CREDS"] = args.nats_creds
    try:
        asyncio.run(run_gateway(config, args.nats_url, host, args.port, tokenizer=tokenizer))
    except OSError as exc:
        if exc.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):
            raise
        # NOTE: the port was free at the check above and taken before the bind.
        print(f"wavepp gateway: --port {host}:{args.port}: {describe_error(exc)}", file=sys.stderr)
        return 2
    return 0
