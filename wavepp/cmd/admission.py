"""``wavepp admission``: one replica's admission controller + wave scheduler, serving its
durable JetStream intake (what each replica's admission pod runs)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from importlib import resources
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runtime-config", required=True, help="the replica's RuntimeConfig JSON")
    parser.add_argument("--nats-url", required=True, help="NATS server URL (with JetStream)")
    parser.add_argument("--pool", required=True, help="pool name (results bucket and subjects)")
    parser.add_argument(
        "--ack-wait-s", type=float, default=10.0, help="redelivery delay of unacked requests"
    )
    parser.add_argument("--max-concurrent", type=int, default=64, help="requests taken at once")
    parser.add_argument("--planner-cost-model", default="", help="CostModel JSON for the planner")


def run(args: argparse.Namespace) -> int:
    from wavepp.runtime.config import RuntimeConfig
    from wavepp.runtime.natsutil import connect
    from wavepp.runtime.planner import CostModel
    from wavepp.runtime.service import AdmissionService

    try:
        config = RuntimeConfig.model_validate_json(Path(args.runtime_config).read_text())
    except (OSError, ValueError) as exc:
        print(f"wavepp admission: --runtime-config {args.runtime_config}: {exc}", file=sys.stderr)
        return 2
    if args.ack_wait_s <= 0:
        print(f"wavepp admission: --ack-wait-s {args.ack_wait_s}: must be > 0", file=sys.stderr)
        return 2
    if args.max_concurrent < 1:
        print(
            f"wavepp admission: --max-concurrent {args.max_concurrent}: must be >= 1",
            file=sys.stderr,
        )
        return 2
    if args.planner_cost_model:
        cost = CostModel.from_dict(json.loads(Path(args.planner_cost_model).read_text()))
    elif config.cost_model is not None:
        cost = CostModel.from_dict(config.cost_model)
    else:
        path = resources.files("wavepp.runtime") / "calibration" / "tiny-llama-cpu-2layers.json"
        cost = CostModel.from_dict(json.loads(path.read_text()))
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s admission[{config.pipeline}] %(levelname)s %(name)s: %(message)s",
    )

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        nc = await connect(args.nats_url, name=f"{config.pipeline}-admission")
        try:
            service = AdmissionService(
                config,
                nc,
                cost,
                pool=args.pool,
                ack_wait_s=args.ack_wait_s,
                max_concurrent=args.max_concurrent,
            )
            await service.run(stop)
        finally:
            await nc.drain()

    asyncio.run(main())
    return 0
