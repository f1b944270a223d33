"""Admission cadence microbenchmark: agreements per second and latency over real NATS.

An embedded nats-server and S stage KV servers (each a ``StageKVManager`` answering
``{prefix}.stage.{r}.kv`` with ``handle_kv_request``, exactly as a stage process does; here all S
share this process's event loop, one NATS connection each). The real ``AdmissionController``
runs probe-pin / commit for ``num_requests`` prompts (half sharing a prefix), then releases.

Measured per (S, agreements in flight): agreements/s over the whole run, and the p50/p99 latency
of one ``agree`` call. Compare with the pipeline's consumption rate: a micro-batch of
``chunk_tokens`` new tokens takes t_mb seconds per stage, so the pipeline consumes about
(chunk_tokens / new tokens per request) / t_mb agreements per second.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from wavepp.api.subjects import ReplicaSubjects, replica_prefix
from wavepp.runtime.agreement import AdmissionController, handle_kv_request
from wavepp.runtime.agreement.nats_client import NatsStageClient
from wavepp.runtime.kv import BlockPool, StageKVManager
from wavepp.runtime.transport.natsio import EmbeddedNatsServer, connect

__all__ = ["format_table", "run_admission_bench"]


async def _one_setting(
    url: str,
    num_stages: int,
    num_in_flight: int,
    *,
    num_requests: int,
    num_prompt_tokens: int,
    block_size: int,
    tag: str,
) -> dict[str, Any]:
    prefix = replica_prefix(f"admbench{tag}", namespace="bench")
    num_blocks = 4 * num_requests * (num_prompt_tokens // block_size + 1)
    async with contextlib.AsyncExitStack() as stack:
        stage_conns = []
        for rank in range(num_stages):
            nc = await connect(url, name=f"admbench-stage-{rank}")
            stack.push_async_callback(nc.drain)
            manager = StageKVManager(BlockPool(num_blocks, block_size))

            async def serve(msg: Any, manager: StageKVManager = manager, rank: int = rank) -> None:
                reply = handle_kv_request(manager, rank, msg.data)
                await msg.respond(reply.model_dump_json().encode())

            await nc.subscribe(ReplicaSubjects(prefix).stage_kv(rank), cb=serve)
            await nc.flush()
            stage_conns.append(nc)
        nc = await connect(url, name="admbench-controller")
        stack.push_async_callback(nc.drain)
        controller = AdmissionController(
            [NatsStageClient(nc, prefix, r, 10.0) for r in range(num_stages)],
            block_size=block_size,
            model_id="admbench",
        )
        rng = np.random.Generator(np.random.PCG64(num_stages * 1000 + num_in_flight))
        shared = rng.integers(0, 32000, num_prompt_tokens // 2).tolist()
        from wavepp.runtime.request import PromptRequest

        prompts = [
            (shared if i % 2 else [])
            + rng.integers(0, 32000, num_prompt_tokens - (len(shared) if i % 2 else 0)).tolist()
            for i in range(num_requests)
        ]
        latencies: list[float] = []
        limiter = asyncio.Semaphore(num_in_flight)

        async def agree(index: int) -> None:
            async with limiter:
                started = time.perf_counter()
                ticket = await controller.agree(PromptRequest(f"a{tag}-{index}", prompts[index]))
                latencies.append(time.perf_counter() - started)
                assert ticket is not None, "admission bench pool too small"

        start = time.perf_counter()
        await asyncio.gather(*(agree(i) for i in range(num_requests)))
        wall_s = time.perf_counter() - start
        await controller.release([f"a{tag}-{i}" for i in range(num_requests)])
    lat = np.array(latencies)
    return {
        "stages": num_stages,
        "in_flight": num_in_flight,
        "requests": num_requests,
        "prompt_tokens": num_prompt_tokens,
        "agreements_per_s": round(num_requests / wall_s, 1),
        "latency_p50_ms": round(float(np.percentile(lat, 50)) * 1e3, 3),
        "latency_p99_ms": round(float(np.percentile(lat, 99)) * 1e3, 3),
    }


async def run_admission_bench(
    stages: Sequence[int],
    in_flight: Sequence[int] = (1, 16),
    *,
    num_requests: int = 400,
    num_prompt_tokens: int = 4096,
    block_size: int = 64,
) -> list[dict[str, Any]]:
    """Measure agreements/s and latency for each S in ``stages`` and each in-flight count.

    Returns:
        One dict per (S, in_flight): stages, in_flight, requests, prompt_tokens,
        agreements_per_s, latency_p50_ms, latency_p99_ms.

    Raises:
        ValueError: a count < 1.
    """
    if num_requests < 1 or num_prompt_tokens < 1 or block_size < 1:
        raise ValueError(
            f"num_requests={num_requests}, num_prompt_tokens={num_prompt_tokens}, "
            f"block_size={block_size}: each must be >= 1"
        )
    for value in (*stages, *in_flight):
        if value < 1:
            raise ValueError(f"stages/in_flight value {value}: must be >= 1")
    server = EmbeddedNatsServer()
    server.start()
    try:
        results = []
        for s in stages:
            for k in in_flight:
                results.append(
                    await _one_setting(
                        server.url,
                        s,
                        k,
                        num_requests=num_requests,
                        num_prompt_tokens=num_prompt_tokens,
                        block_size=block_size,
                        tag=f"{s}x{k}",
                    )
                )
        return results
    finally:
        server.stop()


def format_table(results: Sequence[dict[str, Any]]) -> str:
    """Markdown table of ``run_admission_bench`` results."""
    lines = [
        "| stages S | agreements in flight | agreements/s | p50 latency (ms) | p99 latency (ms) |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        lines.append(
            f"| {r['stages']} | {r['in_flight']} | {r['agreements_per_s']} | "
            f"{r['latency_p50_ms']} | {r['latency_p99_ms']} |"
        )
    return "\n".join(lines)
