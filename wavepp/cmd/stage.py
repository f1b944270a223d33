"""``wavepp stage``: one pipeline stage process (what each stage pod runs)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--runtime-config", required=True, help="path of the resolved RuntimeConfig JSON"
    )
    parser.add_argument("--rank", type=int, required=True, help="stage rank r in [0, S)")
    parser.add_argument("--nats-url", required=True, help="NATS server URL, e.g. nats://host:4222")
    parser.add_argument(
        "--dist-url",
        required=True,
        help="torch.distributed init method, e.g. tcp://stage-0.pipeline:29500",
    )


def run(args: argparse.Namespace) -> int:
    from wavepp.runtime.config import RuntimeConfig
    from wavepp.runtime.stage import run_stage

    try:
        config = RuntimeConfig.model_validate_json(Path(args.runtime_config).read_text())
    except (OSError, ValueError) as exc:
        print(f"wavepp stage: --runtime-config {args.runtime_config}: {exc}", file=sys.stderr)
        return 2
    if not 0 <= args.rank < config.num_stages:
        print(
            f"wavepp stage: --rank {args.rank}: must be in [0, {config.num_stages})",
            file=sys.stderr,
        )
        return 2
    try:
        asyncio.run(run_stage(config, args.rank, args.nats_url, args.dist_url))
    except KeyboardInterrupt:
        pass
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # The gloo process group and a compute thread blocked in recv() would hold the interpreter
    # at exit; everything this process owns is already drained.
    os._exit(0)
