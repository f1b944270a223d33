"""The served-pipeline sides of ``engine_vs_hf.py``: the WavePipeline spec a side serves, the
sides themselves (``PipelineSide``: ``LocalPipeline`` with the scheduler in this process;
``UpSide``: ``wavepp up`` driven over HTTP), what a side measures of one pass besides its wall time
(CPU seconds by process role from ``/proc``, Prometheus counter deltas, the stages' timeline from
their done messages), and ``pipeline_sides``, which runs every side's passes alternated.

Units: seconds of wall or CPU time; tokens are prompt tokens. This module measures and records;
it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from wavepp.runtime.model_config import ModelConfig
from wavepp.runtime.stage.loop_profile import read_profiles

BLOCK_SIZE = 32  # tokens per KV block of every side


async def _closed_loop(scheduler: Any, prompts: list[list[int]], concurrency: int) -> None:
    from wavepp.runtime.request import PromptRequest

    queue = list(enumerate(prompts))
    queue.reverse()

    async def worker() -> None:
        while queue:
            i, p = queue.pop()
            outcome = await scheduler.submit(PromptRequest(f"q{i}", p))
            if not outcome.ok:
                raise RuntimeError(f"request q{i} failed: {outcome.error}")

    await asyncio.gather(*(worker() for _ in range(concurrency)))


def bench_spec(
    args: Any,
    config: ModelConfig,
    stages: int,
    source: str = "seeded",
    pack: bool = True,
    return_microbatches: int | None = None,
    pin: bool = False,
) -> dict[str, Any]:
    """The WavePipeline spec both pipeline paths serve (``local`` builds its RuntimeConfig from
    it as ``wavepp up`` does; ``up`` is given it as ``--config``): ``stages`` stages of the
    seeded ``config`` (torch; ``source`` ``checkpoint``: the same shape as a random-weight
    Hugging Face checkpoint directory ``args.model_dir``, served as ``--model DIR`` serves it:
    checkpoint engine, layers split by cost) or of ``--emulate``'s cost model (emulated, ``--time-scale``),
    blocks of ``BLOCK_SIZE``, ``--threads / stages`` (at least 1) torch threads per stage,
    ``--max-inflight`` micro-batches in flight (0: the runtime's default); ``pack`` False:
    the torch engine's projections unpacked (``engineOptions.packWeights``);
    ``return_microbatches`` the closed-loop target's way back (None: the runtime's default);
    ``pin``: each stage pinned to its share of the cores (``engineOptions.pinCores``);
    ``--compile``: the stages' ``engineOptions.torchCompile``; torch engine: one GPU per stage
    with ``--device cuda`` (``resources.gpusPerStage``; a local pipeline's stages share
    cuda:0), else none."""
    longest = args.longest
    blocks = max(64, max(args.concurrency) * 2 * (-(-longest // BLOCK_SIZE)))
    options: dict[str, Any] = {
        "kvBlocks": blocks,
        "torchThreads": max(1, args.threads // stages),
    }
    if args.max_inflight:
        options["maxInflight"] = args.max_inflight
    if not pack and args.engine == "torch":
        options["packWeights"] = False
    if return_microbatches is not None:
        options["returnMicrobatches"] = return_microbatches
    if pin:
        options["pinCores"] = True
    if args.compile:
        options["torchCompile"] = True
    spec: dict[str, Any] = {
        "stages": stages,
        "replicas": 1,
        "engine": args.engine,
        "cache": {"blockSize": BLOCK_SIZE},
        "engineOptions": options,
    }
    if args.engine == "torch":  # the stages compute on --device, whatever this host has
        spec["resources"] = {"gpusPerStage": 1 if args.device.startswith("cuda") else 0}
    if args.engine == "emulated":
        spec["model"] = {"name": args.emulate}
        options |= {"emulate": args.emulate, "timeScale": args.time_scale}
    elif source == "checkpoint":
        spec["model"] = {"name": config.name, "path": str(args.model_dir), "dtype": config.dtype}
    else:
        shape = {
            "numLayers": config.num_layers,
            "hiddenSize": config.hidden_size,
            "intermediateSize": config.intermediate_size,
            "numHeads": config.num_heads,
            "numKvHeads": config.num_kv_heads,
            "headDim": config.head_dim,
            "vocabSize": config.vocab_size,
            "maxPosition": config.max_position,
        }
        spec["model"] = {"name": config.name, "config": shape, "dtype": config.dtype}
        options["seed"] = config.seed
    return spec


def runtime_config_of(spec: dict[str, Any]) -> Any:
    """The replica's RuntimeConfig ``wavepp up --config`` builds from ``spec`` (pool
    ``default``), without its telemetry."""
    from wavepp.api.spec import check_spec
    from wavepp.launch.runtime_config import runtime_configs_from_spec, with_checkpoint_layers
    from wavepp.launch.up import local_resources

    checked, issues = check_spec(
        local_resources(with_checkpoint_layers(spec)),
        default_image="local",
        default_nats_url="nats://embedded",
    )
    if checked is None:
        raise ValueError("bench spec refused: " + "; ".join(str(i) for i in issues))
    return runtime_configs_from_spec(checked, pool="default")[0]


def _proc_stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, user + system CPU seconds) of ``pid`` from ``/proc`` (Linux); None: gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / ticks


def _role(pid: int, root: int) -> str:
    """What process ``pid`` is, from its command line: ``stage-R``, ``admission``,
    ``gateway``, ``nats-server``, ``up`` (the parent), or ``bench`` (this process: under
    ``local`` the scheduler and the client)."""
    if pid == os.getpid():
        return "bench"
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return "?"
    if any("nats-server" in a for a in argv):
        return "nats-server"
    for role in ("stage", "admission", "gateway", "up"):
        if role in argv:
            if role == "stage" and "--rank" in argv:
                return f"stage-{argv[argv.index('--rank') + 1]}"
            return role
    return "other" if pid != root else "root"


def process_cpu_s(root: int, exclude: Collection[int] = ()) -> dict[str, float]:
    """CPU seconds (user + system) used so far by ``root`` and every process below it but
    ``exclude`` and theirs, summed by role (``_role``); a side takes two around a pass."""
    stats = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _proc_stat(int(entry.name))
            if stat is not None:
                stats[int(entry.name)] = stat
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, _) in stats.items():
            if ppid == parent and pid not in tree and pid not in exclude:
                tree.add(pid)
                frontier.append(pid)
    out: dict[str, float] = {}
    for pid in tree:
        if pid in stats:
            role = _role(pid, root)
            out[role] = out.get(role, 0.0) + stats[pid][1]
    return out


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: round(v - before.get(k, 0.0), 2) for k, v in sorted(after.items())}


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive local ports free now (``wavepp up``'s metrics
    ports: the admission's, then each stage's)."""
    import socket

    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = int(probe.getsockname()[1])
        if first + count > 65535:
            continue
        try:
            for port in range(first, first + count):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return first
    raise RuntimeError(f"no {count} consecutive free ports found")


def scrape_counters(url: str) -> dict[str, float]:
    """Every sample of a Prometheus endpoint, ``name{label=value,...}`` -> value (labels
    sorted, ``pipeline`` left out); {} when it does not answer."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(url, timeout=10) as resp:  # noqa: S310 (local URL)
            text = resp.read().decode()
    except OSError:
        return {}
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(
                f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "pipeline"
            )
            out[f"{sample.name}{{{labels}}}"] = float(sample.value)
    return out


def pass_summary(
    counters: dict[str, float], cpu_s: dict[str, float], wall_s: float, stages: int
) -> dict[str, Any]:
    """What the planner and the stages did in one ``up`` pass, from the deltas of their
    Prometheus counters (``UpSide``: ``role:series`` -> increase over the pass) and the CPU
    seconds by process role: micro-batches the admission published, new tokens and chunks per
    micro-batch, the fraction of chunks over a cached context and the mean context such a chunk
    attended (tokens), per stage the fraction of the pass's wall time it executed and its CPU
    seconds per 1,000 new tokens."""

    def get(role: str, series: str) -> float:
        return counters.get(f"{role}:{series}", 0.0)

    first = "stage-0"
    mbs = get(first, "wavepp_stage_microbatches_run_total{stage_rank=0}")
    new = get(first, "wavepp_stage_tokens_total{kind=new,stage_rank=0}")
    context = get(first, "wavepp_stage_tokens_total{kind=context,stage_rank=0}")
    cached = get(first, "wavepp_stage_chunks_total{context=cached,stage_rank=0}")
    chunks = cached + get(first, "wavepp_stage_chunks_total{context=none,stage_rank=0}")
    out: dict[str, Any] = {
        "microbatches": int(mbs),
        "tokens_per_microbatch": round(new / mbs, 1) if mbs else 0.0,
        "chunks_per_microbatch": round(chunks / mbs, 2) if mbs else 0.0,
        "cached_context_chunk_fraction": round(cached / chunks, 3) if chunks else 0.0,
        "context_per_cached_chunk": round(context / cached, 1) if cached else 0.0,
        "busy_fraction": [],
        "cpu_s_per_1k_tokens": [],
    }
    for rank in range(stages):
        role = f"stage-{rank}"
        busy = get(role, f"wavepp_stage_execute_seconds_total{{stage_rank={rank}}}")
        out["busy_fraction"].append(round(busy / wall_s, 3) if wall_s > 0 else 0.0)
        cpu = cpu_s.get(role, 0.0)
        out["cpu_s_per_1k_tokens"].append(round(1000 * cpu / new, 3) if new else 0.0)
    return out


def timeline_summary(dones: list[Any], wall_s: float, stages: int) -> dict[str, Any]:
    """What the stages of one ``local`` pass did, from their done messages (``MicroBatchDone``:
    execute start and end, wall-clock seconds): micro-batches and new tokens per micro-batch
    (stage 0's; mean, least and most, and the spread of stage 0's micro-batches as coefficients of
    variation, population standard deviation / mean: ``tokens_cv`` of their new tokens,
    ``execute_cv`` of their execute seconds), per stage the fraction of the pass's wall time it executed, its idle seconds
    between its first execute and its last (``gap_s``: waiting for work inside the pass, not
    fill or drain) and before its first and after its last (``edge_s``: fill and drain, with
    the pass's start and end taken as stage 0's first start and the last stage's last end)."""
    by_rank: dict[int, list[tuple[float, float, int]]] = {r: [] for r in range(stages)}
    for done in dones:
        by_rank.setdefault(done.rank, []).append(
            (done.execute_start_s, done.execute_end_s, done.num_tokens)
        )
    spans = [sorted(by_rank[r]) for r in range(stages)]
    if not all(spans):
        return {}
    first_s = spans[0][0][0]
    last_s = spans[-1][-1][1]
    out: dict[str, Any] = {
        "microbatches": len(spans[0]),
        "tokens_per_microbatch": round(sum(n for *_, n in spans[0]) / len(spans[0]), 1),
        "tokens_min_max": [min(n for *_, n in spans[0]), max(n for *_, n in spans[0])],
        "tokens_cv": _cv([n for *_, n in spans[0]]),
        "execute_cv": _cv([end - start for start, end, _ in spans[0]]),
        "busy_fraction": [],
        "gap_s": [],
        "edge_s": [],
    }
    for span in spans:
        busy = sum(end - start for start, end, _ in span)
        out["busy_fraction"].append(round(busy / wall_s, 3) if wall_s > 0 else 0.0)
        out["gap_s"].append(round(span[-1][1] - span[0][0] - busy, 3))
        out["edge_s"].append(round(span[0][0] - first_s + last_s - span[-1][1], 3))
    return out


def _cv(values: list[float]) -> float:
    """Population standard deviation / mean of ``values``, 3 decimals (0.0 for a zero mean)."""
    mean = statistics.fmean(values)
    return round(statistics.pstdev(values) / mean, 3) if mean else 0.0


class PipelineSide:
    """``LocalPipeline`` (the scheduler in this process) of ``spec``; ``run`` times one pass."""

    path = "local"

    def __init__(self, spec: dict[str, Any], args: Any, suffix: str = "") -> None:
        self.spec = spec
        self.config = runtime_config_of(spec)
        self.stages = int(spec["stages"])
        self.name = f"pipeline-{self.stages}{suffix}"
        self.pipeline: Any = None
        self.cpu_s: list[dict[str, float]] = []  # per timed pass: CPU seconds by role
        self.others: set[int] = set()  # the ``up`` sides' processes: not this side's
        self.log_dir = tempfile.mkdtemp(prefix=f"wavepp-bench-s{self.stages}-")
        self.dones: list[Any] = []  # this pass's done messages (timeline_summary)
        self.timelines: list[dict[str, Any]] = []  # per pass (the warm-up's first)
        self.profile_dir = ""
        if args.profile:  # each stage's loop profile over every pass (warm-up included)
            self.profile_dir = tempfile.mkdtemp(prefix=f"wavepp-bench-s{self.stages}-profile-")
            self.config = self.config.model_copy(update={"profile_dir": self.profile_dir})
        self.loop_profiles: list[dict[str, Any]] = []  # by rank, after stop

    async def start(self) -> None:
        from wavepp.launch.replica import planner_cost_model
        from wavepp.runtime.serving.local import LocalPipeline

        cost = planner_cost_model(self.config)
        self.pipeline = LocalPipeline(self.config, cost, log_dir=self.log_dir)
        await self.pipeline.start()
        self.pipeline.scheduler.on_stage_done = lambda done, _: self.dones.append(done)

    async def run(self, prompts: list[list[int]], concurrency: int) -> float:
        cpu = process_cpu_s(os.getpid(), self.others)
        self.dones = []
        began = time.perf_counter()
        await _closed_loop(self.pipeline.scheduler, prompts, concurrency)
        wall_s = time.perf_counter() - began
        self.cpu_s.append(cpu_delta(cpu, process_cpu_s(os.getpid(), self.others)))
        self.timelines.append(timeline_summary(self.dones, wall_s, self.stages))
        return wall_s

    async def stop(self) -> None:
        if self.pipeline is not None:
            await self.pipeline.stop()
        if self.profile_dir:
            self.loop_profiles = read_profiles(self.profile_dir)


class UpSide:
    """``wavepp up --config spec`` (gateway, JetStream intake, admission service, stages as
    processes), driven over HTTP by ``vs_vllm.drive`` (``/v1/completions``, ``max_tokens``
    1); ``run`` times one pass and raises on any failed request."""

    path = "up"

    def __init__(self, spec: dict[str, Any], args: Any, suffix: str = "") -> None:
        from vs_vllm import Server, free_port

        self.stages = int(spec["stages"])
        self.name = f"up-{self.stages}{suffix}"
        work = Path(tempfile.mkdtemp(prefix=f"wavepp-bench-up-s{self.stages}-"))
        spec_path = work / "spec.json"
        spec = spec | {"telemetry": {"metricsPort": free_ports(1 + self.stages)}}
        spec_path.write_text(json.dumps(spec, indent=2))
        port = free_port()
        argv = [
            *(sys.executable, "-m", "wavepp.cli", "up", "--config", str(spec_path)),
            *("--port", str(port), "--state-dir", str(work / "state")),
            *("--max-outstanding", str(args.max_outstanding or max(args.concurrency))),
        ]
        self.state_dir = work / "state"
        self.metrics_urls: dict[str, str] = {}  # role (admission, stage-R) -> /metrics URL
        self.server = Server("wavepp", argv, dict(os.environ), port, work / "up.log", "/readyz")
        self.timeout_s = args.request_timeout_s
        self.cpu_s: list[dict[str, float]] = []  # per timed pass: CPU seconds by role
        self.counters: list[dict[str, float]] = []  # per timed pass: Prometheus counter deltas
        self.walls: list[float] = []

    async def start(self) -> None:
        await asyncio.to_thread(self.server.start, 300.0)
        info = json.loads((self.state_dir / "processes.json").read_text())
        for url in (info.get("metrics") or {}).values():
            self.metrics_urls["admission"] = url
        for name, url in (info.get("stage_metrics") or {}).items():
            self.metrics_urls[f"stage-{name.rsplit('-', 1)[1]}"] = url

    def _scrape(self) -> dict[str, float]:
        return {
            f"{role}:{key}": value
            for role, url in self.metrics_urls.items()
            for key, value in scrape_counters(url).items()
        }

    async def run(self, prompts: list[list[int]], concurrency: int) -> float:
        from vs_vllm import drive

        assert self.server.proc is not None, "started"
        cpu = process_cpu_s(self.server.proc.pid)
        counters = await asyncio.to_thread(self._scrape)
        result = await drive(self.server, prompts, concurrency, 0, self.timeout_s)
        self.cpu_s.append(cpu_delta(cpu, process_cpu_s(self.server.proc.pid)))
        after = await asyncio.to_thread(self._scrape)
        self.counters.append({k: v - counters.get(k, 0.0) for k, v in after.items()})
        self.walls.append(result.wall_s)
        if result.errors:
            raise RuntimeError(f"{self.name}: {result.errors} failed: {result.first_error}")
        return result.wall_s

    async def stop(self) -> None:
        await asyncio.to_thread(self.server.stop)


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


async def pipeline_sides(
    args: argparse.Namespace,
    config: ModelConfig,
    prompt_sets: list[list[list[int]]],
    hf_pass: Callable[[list[list[int]]], float] | None,
    tokens: int,
) -> dict[str, Any]:
    """``prompt_sets[0]``: the warm-up's; ``prompt_sets[1 + r * len(C) + i]``: repeat r's at
    the i-th concurrency C (same lengths and prefix sharing, other tokens, so no pass finds an
    earlier pass's prompts cached; the ``hf`` side runs each repeat's first). One side
    per source, stage count and path (``local``: ``pipeline-S``; ``up``: ``up-S``; suffix
    ``-ckpt`` for the checkpoint source), all started before the first timed pass; ``hf_pass``
    None: no ``hf`` side. Returns ``tokens_per_s`` (side -> median prompt tokens/s),
    ``cpu_s`` (side -> per timed pass, CPU seconds by process role) and ``loop_profiles``
    (``local`` side -> its stages' loop profiles with ``--profile``, else [])."""
    kinds = {"local": PipelineSide, "up": UpSide}
    sources = args.source if args.engine == "torch" else ["seeded"]
    packs = args.pack if args.engine == "torch" else ["on"]
    returns = args.return_microbatches or [None]
    sides = [
        kinds[path](
            bench_spec(args, config, s, source, pack == "on", r, pin == "on"),
            args,
            ("-ckpt" if source == "checkpoint" else "")
            + ("-unpacked" if pack == "off" else "")
            + ("" if r is None else f"-r{r}")
            + ("-pinned" if pin == "on" else ""),
        )
        for source in sources
        for s in args.stages
        for path in args.path
        for pack in packs
        for r in returns
        for pin in args.pin
    ]
    for side in sides:
        if isinstance(side, PipelineSide):
            progress(f"{side.name}: layers per stage {side.config.partition or 'even'}")
    cs = args.concurrency

    def key(name: str, c: int) -> str:
        return name if len(cs) == 1 else f"{name}@{c}"

    times: dict[str, list[float]] = ({"hf": []} if hf_pass else {}) | {
        key(s.name, c): [] for s in sides for c in cs
    }
    summaries: dict[str, list[dict[str, Any]]] = {}
    try:
        for side in sides:
            await side.start()
        others = {s.server.proc.pid for s in sides if isinstance(s, UpSide) and s.server.proc}
        for side in sides:
            if isinstance(side, PipelineSide):
                side.others = others
            await side.run(prompt_sets[0][: min(4, len(prompt_sets[0]))], 2)  # not timed
        for rep in range(args.repeats):
            order: list[Any] = (["hf"] if hf_pass else []) + [(s, c) for c in cs for s in sides]
            if rep % 2:
                order.reverse()
            for item in order:
                if item == "hf":
                    assert hf_pass is not None
                    # off the event loop: the pipelines' schedulers share it, and their
                    # rounds in flight (the releases after the last pass) wait for replies
                    hf_prompts = prompt_sets[1 + rep * len(cs)]
                    times["hf"].append(await asyncio.to_thread(hf_pass, hf_prompts))
                    continue
                side, c = item
                prompts = prompt_sets[1 + rep * len(cs) + cs.index(c)]
                times[key(side.name, c)].append(await side.run(prompts, c))
                if isinstance(side, PipelineSide):
                    summaries.setdefault(key(side.name, c), []).append(side.timelines[-1])
                    progress(f"{key(side.name, c)} repeat {rep}: {side.timelines[-1]}")
                if isinstance(side, UpSide) and side.metrics_urls:
                    summary = pass_summary(
                        side.counters[-1], side.cpu_s[-1], side.walls[-1], side.stages
                    )
                    summaries.setdefault(key(side.name, c), []).append(summary)
                    progress(f"{key(side.name, c)} repeat {rep}: {summary}")
            progress(f"repeat {rep}: {times}")
    finally:
        for side in sides:
            await side.stop()
    for side in sides:
        for cpu in side.cpu_s[1:]:  # the first pass is the warm-up's
            progress(f"{side.name} CPU s by process: {cpu}")
    cpu_s = {side.name: side.cpu_s[1:] for side in sides}
    return {
        "tokens_per_s": {name: tokens / _median(t) for name, t in times.items()},
        "cpu_s": cpu_s,
        "passes": summaries,
        "loop_profiles": {
            side.name: side.loop_profiles for side in sides if isinstance(side, PipelineSide)
        },
    }


def progress(message: str) -> None:
    print(f"[engine_vs_hf] {message}", file=sys.stderr, flush=True)
