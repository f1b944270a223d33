"""Shared setup of the reliability tests: a small emulated pipeline with real stage processes,
a real nats-server, and the admission controller + wave scheduler in the test's process."""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Callable

from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.model_config import ModelConfig
from wavepp.runtime.planning import CostModel
from wavepp.runtime.serving.local import LocalPipeline

BLOCK_SIZE = 16
NUM_STAGES = 3
MODEL = ModelConfig(num_layers=6)
# A stage costs 1 ms + 0.1 ms per new token (time scale 1): a 320-token prompt computed from
# scratch costs ~33 ms per stage, the same prompt with 304 cached tokens ~2.6 ms.
# How long a stage process may take to start and answer a health probe (``LocalPipeline``'s
# ``startup_timeout_s``): importing torch alone took tens of seconds with both cores busy.
STARTUP_TIMEOUT_S = 90.0
COST = CostModel(c=1e-3, g=1e-7, b=1e-4, a=0.0, label="derived", source="reliability tests")


def emulated_config(num_kv_blocks: list[int], **overrides: object) -> RuntimeConfig:
    """A 3-stage emulated pipeline with ``num_kv_blocks`` blocks of 16 tokens per stage."""
    return RuntimeConfig(
        model=MODEL,
        engine="emulated",
        cost_model=COST.to_dict(),
        num_stages=NUM_STAGES,
        block_size=BLOCK_SIZE,
        num_kv_blocks=num_kv_blocks,
        **overrides,
    )


def make_pipeline(config: RuntimeConfig, log_dir: str) -> LocalPipeline:
    return LocalPipeline(config, COST, log_dir=log_dir, startup_timeout_s=STARTUP_TIMEOUT_S)


def random_tokens(seed: int, num_tokens: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(MODEL.vocab_size) for _ in range(num_tokens)]


async def stage_block_counts(pipeline: LocalPipeline) -> list[tuple[int, int]]:
    """(free blocks, blocks) of every stage, from a health probe over NATS. Free counts blocks
    with ref count 0 (uncached or cached-evictable): free < blocks means a pin or reservation."""
    assert pipeline.controller is not None
    replies = await pipeline.controller.health()
    return [(reply.num_free_blocks, reply.num_blocks) for reply in replies]


async def wait_until(
    predicate: Callable[[], object], *, timeout_s: float, interval_s: float = 0.05
) -> None:
    """Poll ``predicate()`` (sync) until true; raise TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met in {timeout_s}s")
        await asyncio.sleep(interval_s)


def stopped(pid: int) -> bool:
    """True once every thread of ``pid`` is in the stopped state (``T`` in
    ``/proc/PID/task/TID/stat``). ``kill(pid, SIGSTOP)`` returns before the signal took effect:
    a thread running on another core goes on until the kernel interrupts it."""
    tasks = os.listdir(f"/proc/{pid}/task")
    for tid in tasks:
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        if state not in ("T", "t"):
            return False
    return bool(tasks)
