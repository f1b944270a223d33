"""``wavepp gateway``: the prefill API over HTTP and NATS (what the gateway pod runs)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gateway-config", required=True, help="GatewayConfig JSON")
    parser.add_argument("--nats-url", required=True, help="NATS server URL (with JetStream)")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP bind address")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port")
    parser.add_argument(
        "--routing",
        choices=["prefix", "round_robin", "least_loaded"],
        default=None,
        help="override the config's routing policy",
    )


def run(args: argparse.Namespace) -> int:
    from wavepp.runtime.gateway.core import GatewayConfig
    from wavepp.runtime.gateway.http import run_gateway

    try:
        config = GatewayConfig.model_validate_json(Path(args.gateway_config).read_text())
    except (OSError, ValueError) as exc:
        print(f"wavepp gateway: --gateway-config {args.gateway_config}: {exc}", file=sys.stderr)
        return 2
    if args.routing:
        config = config.model_copy(update={"routing": args.routing})
    if not 0 < args.port < 65536:
        print(f"wavepp gateway: --port {args.port}: must be in [1, 65535]", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s gateway %(levelname)s %(name)s: %(message)s"
    )
    asyncio.run(run_gateway(config, args.nats_url, args.host, args.port))
    return 0
