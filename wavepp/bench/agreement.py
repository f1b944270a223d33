"""Prefix agreement microbenchmark: agreements per second and latency over real NATS.

An embedded nats-server, R replicas of S stage KV servers (each a ``StageKVManager`` answering
the stage's agreement subjects with the stage process's own handlers, ``serve_stage_kv``; the
stages of one process share its NATS connection, or each has its own with
``connection_per_stage``) and R real ``AgreementController``s, one per replica, running
probe-reserve (one round trip per round) in batched rounds of at most ``batch_limit`` requests.
Each replica runs ``in_flight`` closed-loop clients (agree, then the next request) and holds
the latest ``held_requests`` admitted requests (as the requests in prefill hold their pins and
reservations); older ones are released in one batch per round, as the scheduler releases a
finished micro-batch's requests. So the run is a steady state: every agreement is released
again, and the stages hold a bounded number of requests (CPU per agreement includes the
release).

Where the stage KV servers run (``AgreementSetting``): all in this process's event loop (the
controller's, the default), or in stage host processes: ``stage_processes`` one per stage (as
in production), or ``stage_hosts`` processes sharing the ranks from ``stages_in_process`` on
(ranks below it stay in this process). On a 2-core machine the layout decides how much of the
work runs at once: all in one process leaves the second core to the nats-server alone; S + 1
processes cost more CPU per agreement than they take off the controller (docs/bench/cadence.md);
half the ranks beside the controller and half in one stage host puts about the same work on
each core. In production every stage is its own host, and none of the stage work is on the
controller's core.

Workloads (``num_prompt_tokens`` per prompt):

* ``mixed``: half the prompts share a prefix of half the prompt, nothing cached beforehand
  (every probe misses: the reservation covers the whole prompt).
* ``short-suffix``: agentic / chat reuse: 8 long shared prefixes, each cached on every stage
  before the run, and a new suffix of ``suffix_tokens`` per prompt (95 % reuse at 4,096 tokens
  with the default 192-token suffix).

Load: closed loop (``in_flight`` clients per replica, each agreeing on its next prompt as soon
as the last is answered: the saturated rate, where latency is in_flight / rate by Little's law)
or open loop (``rate``: Poisson arrivals, each agreed at once: the latency at a given
throughput, as requests arriving at a serving pool see it).

Measured per setting: agreements/s over the run (all replicas), p50/p99 latency of one ``agree``
call (prompt hashing included; open loop: from the request's arrival), each replica's p99,
rounds and mean batch size, and the CPU time per agreement of this process, the stage processes and the nats-server (on a shared machine, CPU
per agreement is the figure that contention does not distort), and that CPU split: controller
(this process), stages (the stage processes, or in-process the stages' round handlers,
``handle_kv_batch``: decode, pool work, reply), nats-server. Compare with the pipeline's consumption rate: a
micro-batch of ``chunk_tokens`` new tokens takes t_mb seconds per stage, so the pipeline consumes
about (chunk_tokens / new tokens per request) / t_mb agreements per second.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import multiprocessing
import os
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from wavepp.api.subjects import replica_prefix
from wavepp.runtime.agreement import AgreementController
from wavepp.runtime.agreement.nats_client import NatsStageClient, serve_stage_kv
from wavepp.runtime.heap import settle_heap
from wavepp.runtime.kv import BlockPool, StageKVManager, hash_prompt_blocks
from wavepp.runtime.request import PromptRequest
from wavepp.runtime.transport.natsio import EmbeddedNatsServer, connect, flush_in_order

WORKLOADS = ("mixed", "short-suffix")
_NUM_SHARED_PREFIXES = 8
_MODEL_ID = "admbench"


@dataclass(frozen=True)
class AgreementSetting:
    """One row: S stages x R replicas, ``in_flight`` agreements outstanding per replica.

    ``stage_processes``: one process per stage KV server; else ``stage_hosts`` processes (0:
    none) serve ranks ``stages_in_process`` (None: S // 2) .. S - 1 round robin, the rest run in the
    controller's process. ``held_requests``: admitted requests a replica holds before
    releasing the oldest (0: each released in the round after its agreement). ``rate``: open
    loop instead of ``in_flight`` closed-loop clients: requests arrive at each replica as a
    Poisson process of ``rate`` per second (seeded), each agreed as soon as it arrives, with
    no cap on how many are outstanding; latency counts from the arrival's scheduled time, so
    a late start (a busy loop, the timer's 1 ms granularity) counts against the system.
    ``rounds_in_flight``: the controller's ``max_rounds_in_flight`` (rounds under way at once
    before arrivals wait and share the next). ``connection_per_stage``: each stage KV server on
    a NATS connection of its own (a stage process has one anyway), not one per process for the
    ranks it serves (the default: a process then reads a round's S copies from one socket and
    writes the replies in one flush). ``prefix_refs``: the controller's (a prefix the stages
    remember goes by reference)."""

    stages: int
    in_flight: int
    batch_limit: int = 512
    replicas: int = 1
    workload: str = "mixed"
    stage_processes: bool = False
    stage_hosts: int = 0
    stages_in_process: int | None = None
    held_requests: int = 256
    rate: float | None = None
    rounds_in_flight: int = 1
    connection_per_stage: bool = False
    prefix_refs: bool = True


def _warm_stage(num_blocks: int, block_size: int, cached: list[list[bytes]]) -> StageKVManager:
    """A stage's KV manager with each of the ``cached`` prefixes (full-block hashes) admitted
    once, computed and released: cached, as after a first request served it."""
    manager = StageKVManager(BlockPool(num_blocks, block_size))
    for index, hashes in enumerate(cached):
        request_id = f"warm-{index}"
        manager.probe_pin(request_id, hashes, 30.0)
        manager.reserve(request_id, len(hashes) + 1, 30.0)
        manager.mark_computed(request_id, len(hashes) * block_size, hashes)
        manager.release(request_id)
    return manager


def _stage_process(
    url: str,
    prefix: str,
    ranks: list[int],
    num_blocks: int,
    block_size: int,
    cached: list[list[bytes]],
    conn: Any,
    connection_per_stage: bool = False,
) -> None:
    """A stage host: the KV servers of ``ranks`` in a process of its own (the target of a
    spawned process), each with its own ``StageKVManager``, on one NATS connection (or one
    each: ``connection_per_stage``); the ``cached`` prefixes (full-block hashes) warmed on
    each, then ``serve_stage_kv`` until the parent sends anything (or goes away) on
    ``conn``."""
    managers = [_warm_stage(num_blocks, block_size, cached) for _ in ranks]

    async def serve() -> None:
        connections: list[Any] = []
        for rank, manager in zip(ranks, managers, strict=True):
            if not connections or connection_per_stage:
                name = f"admbench-stage-{rank}" if connection_per_stage else "admbench-stages"
                connections.append(await connect(url, name=name, anonymous_ok=True))
            await serve_stage_kv(connections[-1], prefix, rank, manager)
        for nc in connections:
            await flush_in_order(nc)
        settle_heap()  # the warmed pools, as a stage process does after loading
        conn.send(os.getpid())
        with contextlib.suppress(EOFError, OSError):
            await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        for nc in connections:
            await nc.drain()

    asyncio.run(serve())


async def _start_stage_processes(
    stack: contextlib.AsyncExitStack,
    url: str,
    prefix: str,
    host_ranks: list[list[int]],
    num_blocks: int,
    block_size: int,
    cached: list[list[bytes]],
    connection_per_stage: bool = False,
) -> list[int]:
    """Spawn one stage host process per entry of ``host_ranks`` (the ranks it serves); their
    pids once all of them serve."""
    context = multiprocessing.get_context("spawn")
    pipes = []
    for ranks in host_ranks:
        parent, child = context.Pipe()
        process = context.Process(
            target=_stage_process,
            args=(url, prefix, ranks, num_blocks, block_size, cached, child, connection_per_stage),
            daemon=True,
        )
        process.start()
        child.close()
        pipes.append(parent)

        def stop(parent: Any = parent, process: Any = process) -> None:
            with contextlib.suppress(OSError):
                parent.send("stop")
            process.join(10)
            if process.is_alive():
                process.kill()

        stack.callback(stop)
    loop = asyncio.get_running_loop()
    return [await loop.run_in_executor(None, parent.recv) for parent in pipes]


def _prompts(
    workload: str, num_requests: int, num_prompt_tokens: int, suffix_tokens: int, seed: int
) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, prefixes to cache on every stage first)."""
    rng = np.random.Generator(np.random.PCG64(seed))
    if workload == "mixed":
        shared = rng.integers(0, 32000, num_prompt_tokens // 2).tolist()
        prompts = [
            (shared if i % 2 else [])
            + rng.integers(0, 32000, num_prompt_tokens - (len(shared) if i % 2 else 0)).tolist()
            for i in range(num_requests)
        ]
        return prompts, []
    prefix_tokens = max(0, num_prompt_tokens - suffix_tokens)
    prefixes = [rng.integers(0, 32000, prefix_tokens).tolist() for _ in range(_NUM_SHARED_PREFIXES)]
    prompts = [
        prefixes[i % len(prefixes)] + rng.integers(0, 32000, suffix_tokens).tolist()
        for i in range(num_requests)
    ]
    return prompts, prefixes


def _proc_cpu_s(pid: int | None) -> float | None:
    """CPU seconds (user + system) process ``pid`` used so far; None off Linux."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _one_setting(
    server: EmbeddedNatsServer,
    setting: AgreementSetting,
    *,
    num_requests: int,
    num_prompt_tokens: int,
    suffix_tokens: int,
    block_size: int,
    tag: str,
) -> dict[str, Any]:
    prompts, prefixes = _prompts(
        setting.workload,
        num_requests,
        num_prompt_tokens,
        suffix_tokens,
        seed=setting.stages * 1000 + setting.in_flight,
    )
    blocks_per_prompt = num_prompt_tokens // block_size + 1
    num_blocks = (num_requests + len(prefixes)) * blocks_per_prompt + 64
    controllers: list[AgreementController] = []
    stage_pids: list[int] = []
    handler_cpu_s = [0.0]  # in-process stage handlers' share of this process's CPU
    in_process: list[StageKVManager] = []  # the stage KV servers in this process
    cached = [hash_prompt_blocks(list(p) + [0], block_size, _MODEL_ID) for p in prefixes]
    async with contextlib.AsyncExitStack() as stack:
        for replica in range(setting.replicas):
            prefix = replica_prefix(f"admbench{tag}r{replica}", namespace="bench")
            host_ranks = _stage_layout(setting)
            if host_ranks:
                stage_pids += await _start_stage_processes(
                    stack,
                    server.url,
                    prefix,
                    host_ranks,
                    num_blocks,
                    block_size,
                    cached,
                    setting.connection_per_stage,
                )
            hosted = {rank for ranks in host_ranks for rank in ranks}
            stage_nc = None  # the in-process stages' connection (one, or one each)
            for rank in sorted(set(range(setting.stages)) - hosted):
                if stage_nc is None or setting.connection_per_stage:
                    stage_nc = await connect(
                        server.url, name=f"admbench-r{replica}-stage-{rank}", anonymous_ok=True
                    )
                    stack.push_async_callback(stage_nc.drain)
                manager = _warm_stage(num_blocks, block_size, cached)
                in_process.append(manager)
                await serve_stage_kv(stage_nc, prefix, rank, manager, handler_cpu_s=handler_cpu_s)
                await flush_in_order(stage_nc)
            nc = await connect(
                server.url, name=f"admbench-r{replica}-controller", anonymous_ok=True
            )
            stack.push_async_callback(nc.drain)
            controller = AgreementController(
                NatsStageClient.for_replica(nc, prefix, setting.stages, 10.0),
                block_size=block_size,
                model_id=_MODEL_ID,
                max_batch=setting.batch_limit,
                max_rounds_in_flight=setting.rounds_in_flight,
                prefix_refs=setting.prefix_refs,
            )
            controllers.append(controller)

        latencies: list[list[float]] = [[] for _ in controllers]
        agreed_blocks: list[int] = []
        per_replica = [range(r, num_requests, setting.replicas) for r in range(len(controllers))]
        held: list[deque[str]] = [deque() for _ in controllers]  # admitted, not yet released
        releases: set[asyncio.Task[None]] = set()

        release_due = [False for _ in controllers]
        outstanding = [0 for _ in controllers]  # agreements started, not answered
        start_lags: list[float] = []  # arrival to the agreement's start (open loop: > 0)
        most_outstanding = [0]  # the most outstanding at one replica at once

        def release_oldest(replica: int) -> None:
            """Release what was admitted more than ``held_requests`` agreements ago, in one
            batch (as the scheduler releases a finished micro-batch's requests)."""
            release_due[replica] = False
            num_done = len(held[replica]) - setting.held_requests
            if num_done > 0:
                ids = [held[replica].popleft() for _ in range(num_done)]
                task = asyncio.create_task(controllers[replica].release(ids))
                releases.add(task)
                task.add_done_callback(releases.discard)

        async def agree_one(replica: int, index: int, arrived: float) -> None:
            """Agree on prompt ``index`` (arrived at ``arrived``, perf_counter seconds), record
            its latency and hold it; release the oldest held once the round has resumed."""
            start_lags.append(time.perf_counter() - arrived)
            request = PromptRequest(f"a{tag}-{replica}-{index}", prompts[index])
            outstanding[replica] += 1
            most_outstanding[0] = max(most_outstanding[0], outstanding[replica])
            ticket = await controllers[replica].agree(request)
            outstanding[replica] -= 1
            latencies[replica].append(time.perf_counter() - arrived)
            if ticket is None:
                raise RuntimeError("agreement bench pool too small: a reservation was refused")
            agreed_blocks.append(ticket.num_agreed_blocks)
            held[replica].append(request.request_id)
            if not release_due[replica] and len(held[replica]) > setting.held_requests:
                release_due[replica] = True  # once the round's callers have all resumed
                asyncio.get_running_loop().call_soon(release_oldest, replica)

        async def worker(replica: int, indices: Iterator[int]) -> None:
            """One of ``in_flight`` closed-loop clients of a replica: agree, then the next."""
            for index in indices:
                await agree_one(replica, index, time.perf_counter())

        async def arrivals(replica: int, indices: Sequence[int], rate: float) -> None:
            """Open loop: prompt ``indices`` arrive as a Poisson process of ``rate`` per
            second from now; each is agreed at once (a task of its own, no cap). The loop's
            timer wakes up to 1 ms late (epoll's granularity; a thread that sleeps precisely
            was worse: it waits for the GIL), and that lateness counts in the latency."""
            rng = np.random.Generator(np.random.PCG64(7919 * (replica + 1)))
            due = time.perf_counter() + np.cumsum(rng.exponential(1.0 / rate, len(indices)))
            tasks = []
            for index, arrival in zip(indices, due.tolist(), strict=True):
                delay = arrival - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(agree_one(replica, index, arrival)))
            await asyncio.gather(*tasks)

        rounds_before = [c.num_rounds for c in controllers]
        bytes_before = [c.num_probe_reserve_bytes for c in controllers]
        unresolved_before = [c.num_unresolved for c in controllers]
        pids = {"stages": stage_pids, "nats": [server.pid]}
        cpu_before = {name: _cpu_of(group) for name, group in pids.items()}
        settle_heap()  # the pools and controllers, as the stage and admission processes do
        handler_before = handler_cpu_s[0]
        controller_before = time.process_time()
        start = time.perf_counter()
        if setting.rate is not None:
            await asyncio.gather(
                *(
                    arrivals(replica, indices, setting.rate)
                    for replica, indices in enumerate(per_replica)
                )
            )
        else:
            queues = [iter(indices) for indices in per_replica]  # shared by a replica's workers
            await asyncio.gather(
                *(
                    worker(replica, queue)
                    for replica, queue in enumerate(queues)
                    for _ in range(setting.in_flight)
                )
            )
        while releases:
            await asyncio.gather(*releases)
        wall_s = time.perf_counter() - start
        cpu_split = {"controller": time.process_time() - controller_before}
        gc.unfreeze()
        in_process_stages_s = handler_cpu_s[0] - handler_before  # 0 with stage processes
        cpu_split["controller"] -= in_process_stages_s
        for name, group in pids.items():
            cpu_split[name] = _cpu_of(group) - cpu_before[name]
        cpu_split["stages"] += in_process_stages_s
        cpu_s = sum(cpu_split.values())
        num_rounds = sum(c.num_rounds - b for c, b in zip(controllers, rounds_before, strict=True))
        round_bytes = sum(
            c.num_probe_reserve_bytes - b for c, b in zip(controllers, bytes_before, strict=True)
        )
        unresolved = sum(
            c.num_unresolved - b for c, b in zip(controllers, unresolved_before, strict=True)
        )
        held_at_end = max((m.num_requests for m in in_process), default=None)
        for replica, controller in enumerate(controllers):
            await controller.release(list(held[replica]))
    everything = np.array([x for replica in latencies for x in replica])
    return {
        "stages": setting.stages,
        "in_flight": None if setting.rate is not None else setting.in_flight,
        "offered_per_s": None if setting.rate is None else setting.rate * setting.replicas,
        "max_outstanding": most_outstanding[0],
        "batch_limit": setting.batch_limit,
        "rounds_in_flight": setting.rounds_in_flight,
        "replicas": setting.replicas,
        "workload": setting.workload,
        "requests": num_requests,
        "prompt_tokens": num_prompt_tokens,
        "agreements_per_s": round(num_requests / wall_s, 1),
        "latency_p50_ms": round(float(np.percentile(everything, 50)) * 1e3, 3),
        "latency_p99_ms": round(float(np.percentile(everything, 99)) * 1e3, 3),
        "start_lag_p99_ms": round(float(np.percentile(start_lags, 99)) * 1e3, 3),
        "replica_p99_ms": [round(float(np.percentile(x, 99)) * 1e3, 3) for x in latencies],
        "rounds": num_rounds,
        "mean_batch": round(num_requests / max(1, num_rounds), 1),
        "prefix_refs": setting.prefix_refs,
        "mean_round_bytes": round(round_bytes / max(1, num_rounds)),
        "unresolved": unresolved,
        "mean_agreed_blocks": round(sum(agreed_blocks) / len(agreed_blocks), 1),
        "cpu_us_per_agreement": round(cpu_s / num_requests * 1e6, 1),
        "cpu_us_split": {k: round(v / num_requests * 1e6, 1) for k, v in cpu_split.items()},
        "stage_processes": setting.stage_processes,
        "stage_hosts": _stage_layout(setting),
        "connection_per_stage": setting.connection_per_stage,
        "held_requests": setting.held_requests,
        "held_at_end": held_at_end,
        "load_average": round(os.getloadavg()[0], 2),
    }


def _stage_layout(setting: AgreementSetting) -> list[list[int]]:
    """The ranks each stage host process serves (the other ranks run in the controller's
    process): with ``stage_processes`` one process per rank; else ``stage_hosts`` processes
    sharing the ranks from ``stages_in_process`` on, round robin."""
    if setting.stage_processes:
        return [[rank] for rank in range(setting.stages)]
    if setting.stage_hosts < 1:
        return []
    first = setting.stages // 2 if setting.stages_in_process is None else setting.stages_in_process
    ranks = list(range(min(first, setting.stages), setting.stages))
    hosts = min(setting.stage_hosts, len(ranks))
    return [ranks[host::hosts] for host in range(hosts)]


def _cpu_of(pids: Sequence[int | None]) -> float:
    """CPU seconds the processes used so far (0 for one that cannot be read)."""
    return sum(_proc_cpu_s(pid) or 0.0 for pid in pids)


async def run_agreement_bench(
    settings: Sequence[AgreementSetting],
    *,
    num_requests: int = 400,
    num_prompt_tokens: int = 4096,
    suffix_tokens: int = 192,
    block_size: int = 64,
) -> list[dict[str, Any]]:
    """Measure agreements/s, latency and CPU per agreement for each setting.

    Returns:
        One dict per setting: stages, in_flight (None in open loop), offered_per_s (open loop:
        the arrival rate over all replicas; else None), max_outstanding (the most agreements
        outstanding at one replica at once), batch_limit, rounds_in_flight, replicas,
        workload, requests, prompt_tokens, agreements_per_s, latency_p50_ms, latency_p99_ms,
        start_lag_p99_ms (from the arrival to the start of its ``agree``: the event loop's
        lateness, counted in the latency), replica_p99_ms (one per replica), rounds,
        mean_batch, prefix_refs, mean_round_bytes (a probe-reserve message to one stage, mean
        over the rounds), unresolved (entries a stage did not resolve, sent again in full),
        mean_agreed_blocks (L*: the cached prefix agreed), cpu_us_per_agreement, cpu_us_split (controller: this
        process less the in-process stages; stages: the stage processes, or without them
        the CPU of the stages' round handlers in this process; nats: the nats-server),
        stage_processes, stage_hosts (the ranks each stage host process served),
        connection_per_stage,
        held_requests, held_at_end (the most requests a stage in this process held when the
        last release had answered; None without one), load_average (the 1-minute load when the
        setting ended).

    Raises:
        ValueError: a count < 1, a suffix longer than the prompt, a rate <= 0, or an unknown
            workload.
    """
    if num_requests < 1 or num_prompt_tokens < 1 or block_size < 1:
        raise ValueError(
            f"num_requests={num_requests}, num_prompt_tokens={num_prompt_tokens}, "
            f"block_size={block_size}: each must be >= 1"
        )
    if not 1 <= suffix_tokens <= num_prompt_tokens:
        raise ValueError(f"suffix_tokens={suffix_tokens}: must be in [1, {num_prompt_tokens}]")
    for setting in settings:
        if setting.rate is not None and not setting.rate > 0:
            raise ValueError(f"rate={setting.rate}: must be > 0 agreements/s (or None)")
        for name in ("stages", "in_flight", "batch_limit", "replicas", "rounds_in_flight"):
            if getattr(setting, name) < 1:
                raise ValueError(f"{name}={getattr(setting, name)}: must be >= 1")
        for name in ("stage_hosts", "stages_in_process", "held_requests"):
            if (getattr(setting, name) or 0) < 0:
                raise ValueError(f"{name}={getattr(setting, name)}: must be >= 0")
        if setting.workload not in WORKLOADS:
            raise ValueError(f"workload={setting.workload!r}: choose from {list(WORKLOADS)}")
    server = EmbeddedNatsServer()
    server.start()
    try:
        results = []
        for index, setting in enumerate(settings):
            results.append(
                await _one_setting(
                    server,
                    setting,
                    num_requests=num_requests,
                    num_prompt_tokens=num_prompt_tokens,
                    suffix_tokens=suffix_tokens,
                    block_size=block_size,
                    tag=str(index),
                )
            )
        return results
    finally:
        server.stop()


def format_table(results: Sequence[dict[str, Any]]) -> str:
    """Markdown table of ``run_agreement_bench`` results."""
    lines = [
        "| workload | S | R | in flight / replica (or offered rate) | batch limit | rounds in "
        "flight | stage hosts | held | "
        "agreements/s | p50 ms | p99 ms | replica p99 ms | mean batch | CPU us / agreement "
        "(controller, stages, nats) | load |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- | ---: "
        "| ---: | ---: |",
    ]
    for r in results:
        split = r["cpu_us_split"]
        lines.append(
            f"| {r['workload']} | {r['stages']} | {r['replicas']} | {_load_label(r)} | "
            f"{r['batch_limit']} | {r['rounds_in_flight']} | {_hosts_label(r['stage_hosts'])} | "
            f"{r['held_requests']} | "
            f"{r['agreements_per_s']} | {r['latency_p50_ms']} | "
            f"{r['latency_p99_ms']} | {' '.join(str(x) for x in r['replica_p99_ms'])} | "
            f"{r['mean_batch']} | {r['cpu_us_per_agreement']} ({split['controller']}, "
            f"{split['stages']}, {split['nats']}) | {r['load_average']} |"
        )
    return "\n".join(lines)


def _load_label(row: dict[str, Any]) -> str:
    """Closed loop: the clients per replica ("24"); open loop: "open 5000/s (max 19)"."""
    if row["offered_per_s"] is None:
        return str(row["in_flight"])
    return f"open {row['offered_per_s']:g}/s (max {row['max_outstanding']})"


def _hosts_label(hosts: Sequence[Sequence[int]]) -> str:
    """The ranks of each stage host process, e.g. "4-7" or "0 / 1"; "none" (all in-process)."""
    if not hosts:
        return "none"
    return " / ".join(
        f"{ranks[0]}-{ranks[-1]}"
        if len(ranks) > 1 and list(ranks) == list(range(ranks[0], ranks[-1] + 1))
        else ",".join(map(str, ranks))
        for ranks in hosts
    )
