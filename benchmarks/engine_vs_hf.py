"""WavePP's stage engine and stage pipeline against one monolithic transformers forward.

Same model, same prompts, same cores, measured side by side in one run: the random-weight Llama
of ``vs_vllm.CHECKPOINT_SHAPE`` (hidden 512, 8 layers, 8 heads, 2 KV heads, float32; seeded
weights, ``TorchStageEngine``), loaded into transformers' ``LlamaForCausalLM`` (SDPA attention)
as well. Prompts: the first ``--requests`` records of the in-repo Mooncake trace, 16 tokens per
trace block (``vs_vllm_stats.trace_prompts``), the tokens drawn anew for every repeat (and the
warm-up) so that no pass finds an earlier one's prompts in a cache: what a pipeline reuses is the
trace's own prefix sharing within the pass. Each side runs ``--repeats`` times, sides
alternated; a side's figure is the median of its repeats (prompt tokens per second of wall
time). Ratios are of medians taken in this run.

- ``hf``: ``model(ids, logits_to_keep=1)`` one prompt at a time, no cache, ``--threads`` torch
  threads (the cores the engine or the pipeline uses).
- ``engine``: one in-process engine holding every layer: ``prepare`` + ``execute`` of
  micro-batches of ``--batch`` prompts, each prompt split in chunks of ``--chunk-tokens``
  (later chunks read their earlier chunks from the paged cache), same threads. With ``--pack
  on,off`` an ``engine-unpacked`` twin runs beside it, the two interleaved micro-batch by
  micro-batch (``run_engines_interleaved``).
- ``pipeline-S`` (``--stages 1,2``): ``LocalPipeline`` (real stage processes, NATS, gloo; the
  scheduler in this process), ``--concurrency`` requests out at a time (closed loop; a list such
  as ``8,32`` runs a pass per concurrency on the same servers, alternated: sides are named
  ``NAME@C``), each
  stage with ``--threads / S`` (at least 1) torch threads; the ``hf`` side runs with
  ``--threads``.
- ``up-S`` (``--path local,up``): the same pipeline behind ``wavepp up`` (HTTP gateway,
  JetStream intake, admission service, stage processes), driven by ``vs_vllm.drive``'s HTTP
  client at the same concurrency. Both paths serve one WavePipeline spec (``bench_spec``;
  ``local`` builds its RuntimeConfig from it as ``wavepp up`` does), so they differ only in
  the control path; ``up-S / pipeline-S`` is printed. Each pass also records the CPU seconds
  of every process of the side by role (stages, admission, gateway, nats-server, this
  process), from ``/proc`` (Linux), and, for ``up`` sides, what the planner and the stages did
  in the pass from their Prometheus counters (``pass_summary``: micro-batches, tokens and
  chunks per micro-batch, chunks over a cached context, each stage's busy fraction and CPU
  seconds per 1,000 prompt tokens); for ``local`` sides, the stages' timeline from their done
  messages (``timeline_summary``: micro-batches, tokens per micro-batch, each stage's busy
  fraction, its idle seconds inside the pass and at its fill or drain). The ``hf`` side runs
  off the event loop, which the pipelines' schedulers share.
- ``--source seeded,checkpoint``: the seeded model, and the same shape as a random-weight
  Hugging Face checkpoint directory served as ``--model DIR`` serves it (checkpoint engine,
  layers split by cost: ``-ckpt`` sides). ``--engine emulated`` (``--emulate``,
  ``--time-scale``) replaces the layers by the cost model's sleeps: what is left is the
  control path. ``--no-hf`` leaves the ``hf`` side out; ``--max-inflight`` sets the
  micro-batches in flight (default: the runtime's); ``--pack on,off`` adds ``-unpacked``
  sides (the engine's projections as plain ``F.linear``, ``engineOptions.packWeights:
  false``) to the packed ones (the default) and prints each side over its unpacked twin;
  ``--return-microbatches 0,1`` makes a side per value of ``engineOptions.returnMicrobatches``
  (suffix ``-rN``; 0 is the closed-loop target without a way back, S micro-batches a round);
  ``--pin off,on`` adds ``-pinned`` sides (``engineOptions.pinCores``: each stage process on its
  share of the cores) and prints each over its floating twin.

``--profile`` adds one profiled engine pass (``torch.profiler``, the engine's named regions,
``wavepp/runtime/stage/engine/profile.py``) and prints its per-part table; with ``--stages``
it prints each stage's loop profile over the side's passes instead (receive, prepare, engine
pass, results, send, the rest; plan handling: ``wavepp/runtime/stage/loop_profile.py``).
``--device cuda --dtype bfloat16`` runs the engine, hf and ``pipeline-S`` sides on a GPU (a
local pipeline's stages share it; activations between them go through host memory). Last line with ``--json``: one JSON
object of every figure. This is a benchmark: it measures and prints; it asserts nothing.

    python benchmarks/engine_vs_hf.py --requests 40 --profile
    python benchmarks/engine_vs_hf.py --requests 60 --stages 1,2 --threads 2 --json
    python benchmarks/engine_vs_hf.py --requests 24 --stages 2 --threads 2 --path local,up \
        --source seeded,checkpoint --no-hf --json
    python benchmarks/engine_vs_hf.py --engine emulated --stages 2 --path local,up --json
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vs_vllm import CHECKPOINT_SHAPE  # noqa: E402
from vs_vllm_stats import trace_prompts  # noqa: E402

from wavepp.bench.vllm_args import DEFAULT_TRACE  # noqa: E402
from wavepp.runtime.model_config import ModelConfig  # noqa: E402
from wavepp.runtime.stage.engine.base import ChunkSpec  # noqa: E402
from wavepp.runtime.stage.engine.profile import part_table, region_totals_us  # noqa: E402
from wavepp.runtime.stage.engine.torch_engine import (  # noqa: E402
    TorchStageEngine,
    build_full_state_dict,
)
from wavepp.runtime.stage.loop_profile import loop_table, read_profiles  # noqa: E402

BLOCK_SIZE = 32


def model_config(dtype: str) -> ModelConfig:
    """The ``CHECKPOINT_SHAPE`` Llama as a ModelConfig (seeded weights)."""
    s = CHECKPOINT_SHAPE
    return ModelConfig(
        name="bench-llama",
        vocab_size=s["vocab_size"],
        hidden_size=s["hidden_size"],
        intermediate_size=s["intermediate_size"],
        num_layers=s["num_hidden_layers"],
        num_heads=s["num_attention_heads"],
        num_kv_heads=s["num_key_value_heads"],
        head_dim=s["hidden_size"] // s["num_attention_heads"],
        max_position=s["max_position_embeddings"],
        dtype=dtype,
        seed=0,
    )


def hf_model(config: ModelConfig, device: str) -> Any:
    import transformers

    hf_config = transformers.LlamaConfig(**config.to_hf_llama_kwargs())
    hf_config._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(hf_config).eval()
    model.load_state_dict(build_full_state_dict(config), strict=True)
    return model.to(device=device, dtype=getattr(torch, config.dtype))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_hf(model: Any, prompts: list[list[int]], device: str) -> float:
    """Wall seconds of one forward per prompt (last-token logits only)."""
    began = time.perf_counter()
    with torch.inference_mode():
        for p in prompts:
            model(torch.tensor([p], device=device), logits_to_keep=1, use_cache=False)
    _sync(device)
    return time.perf_counter() - began


def microbatches(prompts: list[list[int]], batch: int, chunk_tokens: int) -> list[list[ChunkSpec]]:
    """Micro-batches of ``batch`` prompts; prompt i owns blocks ``[i * n, (i + 1) * n)`` of a
    batch's cache, n = blocks of the longest prompt; a prompt longer than ``chunk_tokens``
    runs as consecutive chunks in consecutive micro-batches of its group."""
    longest = max(len(p) for p in prompts)
    per_prompt = -(-longest // BLOCK_SIZE)
    out: list[list[ChunkSpec]] = []
    for g in range(0, len(prompts), batch):
        group = prompts[g : g + batch]
        rounds = max(-(-len(p) // chunk_tokens) for p in group)
        for r in range(rounds):
            mb = []
            for i, p in enumerate(group):
                lo = r * chunk_tokens
                if lo >= len(p):
                    continue
                hi = min(len(p), lo + chunk_tokens)
                blocks = tuple(range(i * per_prompt, (i + 1) * per_prompt))
                mb.append(
                    ChunkSpec(
                        request_id=f"r{g + i}",
                        context_offset=lo,
                        num_tokens=hi - lo,
                        block_ids=blocks,
                        token_ids=tuple(p[lo:hi]),
                        is_last=hi == len(p),
                    )
                )
            out.append(mb)
    return out


def run_engines_interleaved(
    engines: dict[str, TorchStageEngine], batches: list[list[ChunkSpec]], device: str, rep: int
) -> dict[str, float]:
    """One pass of ``batches`` through every engine, interleaved micro-batch by micro-batch
    (the engines' order rotated per micro-batch and per ``rep``), so that a change of load
    during the pass falls on every engine alike. Returns engine -> seconds of its calls."""
    names = list(engines)
    spent = dict.fromkeys(names, 0.0)
    for i, mb in enumerate(batches):
        shift = (i + rep) % len(names)
        for name in names[shift:] + names[:shift]:
            began = time.perf_counter()
            engines[name].execute(engines[name].prepare(mb), None)
            _sync(device)
            spent[name] += time.perf_counter() - began
    return spent


def run_engine(engine: TorchStageEngine, batches: list[list[ChunkSpec]], device: str) -> float:
    began = time.perf_counter()
    for mb in batches:
        engine.execute(engine.prepare(mb), None)
    _sync(device)
    return time.perf_counter() - began


def profile_engine(
    engine: TorchStageEngine, batches: list[list[ChunkSpec]], device: str
) -> list[str]:
    """One profiled engine pass: its per-part table (on CUDA: GPU kernel time per part)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        began = time.perf_counter()
        for mb in batches:
            engine.execute(engine.prepare(mb), None)
        _sync(device)
        wall_us = (time.perf_counter() - began) * 1e6
    field = "device_time_total" if cuda else "cpu_time_total"
    return part_table(region_totals_us(prof.key_averages(), field), wall_us, len(batches))


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
            _progress(f"{side.name}: layers per stage {side.config.partition or 'even'}")
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
                    _progress(f"{key(side.name, c)} repeat {rep}: {side.timelines[-1]}")
                if isinstance(side, UpSide) and side.metrics_urls:
                    summary = pass_summary(
                        side.counters[-1], side.cpu_s[-1], side.walls[-1], side.stages
                    )
                    summaries.setdefault(key(side.name, c), []).append(summary)
                    _progress(f"{key(side.name, c)} repeat {rep}: {summary}")
            _progress(f"repeat {rep}: {times}")
    finally:
        for side in sides:
            await side.stop()
    for side in sides:
        for cpu in side.cpu_s[1:]:  # the first pass is the warm-up's
            _progress(f"{side.name} CPU s by process: {cpu}")
    cpu_s = {side.name: side.cpu_s[1:] for side in sides}
    return {
        "tokens_per_s": {name: tokens / _median(t) for name, t in times.items()},
        "cpu_s": cpu_s,
        "passes": summaries,
        "loop_profiles": {
            side.name: side.loop_profiles for side in sides if isinstance(side, PipelineSide)
        },
    }


def _progress(message: str) -> None:
    print(f"[engine_vs_hf] {message}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    config = model_config(args.dtype)
    if args.engine == "emulated":
        args.longest = BLOCK_SIZE  # the pool's size does not change the model's vocabulary
        vocab = runtime_config_of(bench_spec(args, config, 1)).model.vocab_size
    else:
        vocab = config.vocab_size
    prompt_sets = [
        trace_prompts(args.trace, args.requests, tokens_per_block=16, vocab_size=vocab, seed=s)
        for s in range(1 + args.repeats * (len(args.concurrency) if args.stages else 1))
    ]
    prompts = prompt_sets[1]
    args.longest = max(len(p) for p in prompts)
    tokens = sum(len(p) for p in prompts)
    if "checkpoint" in args.source and args.engine == "torch":
        from vs_vllm import make_checkpoint

        args.model_dir = make_checkpoint(Path(tempfile.mkdtemp(prefix="wavepp-bench-ckpt-")))
    hf = hf_model(config, args.device) if args.engine == "torch" and not args.no_hf else None

    def hf_pass(ps: list[list[int]]) -> float:
        torch.set_num_threads(args.threads)
        return run_hf(hf, ps, args.device)

    result: dict[str, Any] = {
        "requests": len(prompts),
        "prompt_tokens": tokens,
        "threads": args.threads,
        "device": args.device,
        "dtype": args.dtype,
        "batch": args.batch,
        "chunk_tokens": args.chunk_tokens,
        "compile": args.compile,
        "pack": args.pack,
        "load_avg_1m": os.getloadavg()[0],
    }
    lines: list[str] = []
    if args.stages:
        result |= {
            "engine": args.engine,
            "paths": args.path,
            "sources": args.source,
            "max_inflight": args.max_inflight,
        }
        measured = asyncio.run(
            pipeline_sides(args, config, prompt_sets, hf_pass if hf else None, tokens)
        )
        tps = measured["tokens_per_s"]
        result["cpu_s"] = measured["cpu_s"]
        result["passes"] = measured["passes"]
        result["concurrency"] = args.concurrency
        result["tokens_per_s"] = tps
        for name, value in tps.items():
            versus = f"  {value / tps['hf']:.3f}x hf" if "hf" in tps else ""
            lines.append(f"{name:<12} {value:>10.0f} tokens/s{versus}")
        if {"pipeline-1", "pipeline-2"} <= tps.keys():
            r = tps["pipeline-2"] / tps["pipeline-1"]
            result["pipeline2_over_pipeline1"] = r
            lines.append(f"pipeline-2 / pipeline-1: {r:.3f}")
        if {"pipeline-1-unpacked", "pipeline-2-unpacked"} <= tps.keys():
            r = tps["pipeline-2-unpacked"] / tps["pipeline-1-unpacked"]
            result["pipeline2_over_pipeline1_unpacked"] = r
            lines.append(f"pipeline-2-unpacked / pipeline-1-unpacked: {r:.3f}")
        for name in list(tps):
            base, at_c, c_text = name.partition("@")
            pinned = f"{base}-pinned{at_c}{c_text}"
            if not base.endswith("-pinned") and pinned in tps:
                r = tps[pinned] / tps[name]
                result[f"{pinned}/{name}"] = r
                lines.append(f"{pinned} / {name}: {r:.3f}")
            if f"{name}-unpacked" in tps:
                r = tps[name] / tps[f"{name}-unpacked"]
                result[f"{name}/{name}-unpacked"] = r
                lines.append(f"{name} / {name}-unpacked: {r:.3f}")
        cs = args.concurrency
        at = [""] if len(cs) == 1 else [f"@{c}" for c in cs]
        pairs = []
        for s in args.stages:
            for c in at:
                for suffix in ("", "-ckpt"):
                    pairs.append((f"up-{s}{suffix}{c}", f"pipeline-{s}{suffix}{c}"))
                for path in ("pipeline", "up"):
                    pairs.append((f"{path}-{s}-ckpt{c}", f"{path}-{s}{c}"))
            for path in ("pipeline", "up"):
                for suffix in ("", "-ckpt"):
                    for c in at[1:]:
                        pairs.append((f"{path}-{s}{suffix}{c}", f"{path}-{s}{suffix}{at[0]}"))
        for name in list(tps):
            for r in args.return_microbatches:
                if "-r0" in name and r:
                    pairs.append((name.replace("-r0", f"-r{r}"), name))
        for top, bottom in pairs:
            if {top, bottom} <= tps.keys():
                result[f"{top}/{bottom}"] = tps[top] / tps[bottom]
                lines.append(f"{top} / {bottom}: {tps[top] / tps[bottom]:.3f}")
        for name, passes in measured["passes"].items():
            for i, summary in enumerate(passes):
                lines.append(f"{name} pass {i}: {json.dumps(summary)}")
        profiled = {k: v for k, v in measured["loop_profiles"].items() if v}
        if profiled:
            result["loop_profiles"] = profiled
        for name, profiles in profiled.items():
            for profile in profiles:
                lines.append(
                    f"{name} stage {profile['rank']} loop profile, every pass "
                    f"({profile['microbatches']} micro-batches; other = wall - parts):"
                )
                if profile["microbatches"]:
                    lines.extend(loop_table(profile))
    else:
        state = build_full_state_dict(config)
        engines = {
            "engine" + ("-unpacked" if pack == "off" else ""): TorchStageEngine(
                model=config,
                first_layer=0,
                last_layer=config.num_layers,
                num_layers_total=config.num_layers,
                device=args.device,
                state_dict=state,
                pack_weights=pack == "on",
                **({"compile": True} if args.compile else {}),
            )
            for pack in args.pack
        }
        batches = microbatches(prompts, args.batch, args.chunk_tokens)
        per_prompt = -(-args.longest // BLOCK_SIZE)
        for engine in engines.values():
            engine.allocate_kv(per_prompt * args.batch, BLOCK_SIZE)
            run_engine(engine, batches[:2], args.device)  # warm-up (and compile), not timed
        hf_pass(prompts[:2])
        names = ["hf", *engines]
        times: dict[str, list[float]] = {name: [] for name in names}
        for rep in range(args.repeats):
            for side in ["hf", "engines"] if rep % 2 == 0 else ["engines", "hf"]:
                if side == "hf":
                    times["hf"].append(hf_pass(prompts))
                else:
                    spent = run_engines_interleaved(engines, batches, args.device, rep)
                    for name, seconds in spent.items():
                        times[name].append(seconds)
            _progress(f"repeat {rep}: {times}")
        tps = {name: tokens / _median(t) for name, t in times.items()}
        result["tokens_per_s"] = tps
        result["microbatches"] = len(batches)
        lines.append(f"hf      {tps['hf']:>10.0f} tokens/s")
        for name in engines:
            result[f"{name}_over_hf"] = tps[name] / tps["hf"]
            lines.append(f"{name:<7} {tps[name]:>10.0f} tokens/s  {tps[name] / tps['hf']:.3f}x hf")
        if {"engine", "engine-unpacked"} <= tps.keys():
            result["engine/engine-unpacked"] = tps["engine"] / tps["engine-unpacked"]
            lines.append(f"engine / engine-unpacked: {result['engine/engine-unpacked']:.3f}")
        engine = next(iter(engines.values()))
        if args.profile:
            table = profile_engine(engine, batches, args.device)
            result["profile"] = table
            lines.append("per-part profile of one engine pass:")
            lines.extend(table)
    result["load_avg_1m_end"] = os.getloadavg()[0]
    head = (
        f"{len(prompts)} prompts, {tokens} tokens, {args.threads} threads, {args.device} "
        f"{args.dtype}, {args.engine} engine, load avg {result['load_avg_1m']:.1f} -> {result['load_avg_1m_end']:.1f}"
    )
    print(head)
    print("\n".join(lines))
    if args.json:
        print(json.dumps(result))
    return 0


def _positive_ints(flag: str) -> Callable[[str], list[int]]:
    def parse(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            values = []
        if not values or any(v < 1 for v in values):
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: comma-separated integers >= 1")
        return values

    return parse


_stages = _positive_ints("--stages")


def _counts(flag: str) -> Callable[[str], list[int]]:
    def parse(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            values = []
        if not values or any(v < 0 for v in values):
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: comma-separated integers >= 0")
        return values

    return parse


def _paths(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values or any(v not in ("local", "up") for v in values):
        raise argparse.ArgumentTypeError(f"--path {text!r}: comma-separated local and/or up")
    return values


def _packs(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values or any(v not in ("on", "off") for v in values) or len(set(values)) < len(values):
        raise argparse.ArgumentTypeError(f"--pack {text!r}: on and/or off")
    return values


def _pins(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values or any(v not in ("on", "off") for v in values) or len(set(values)) < len(values):
        raise argparse.ArgumentTypeError(f"--pin {text!r}: on and/or off")
    return values


def _sources(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values or any(v not in ("seeded", "checkpoint") for v in values):
        raise argparse.ArgumentTypeError(f"--source {text!r}: seeded and/or checkpoint")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=4, help="prompts per engine micro-batch")
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--stages", type=_stages, default=[], help="e.g. 1,2: pipeline mode")
    parser.add_argument(
        "--concurrency",
        type=_positive_ints("--concurrency"),
        default=[8],
        help="e.g. 8,32: a pass per concurrency",
    )
    parser.add_argument(
        "--path", type=_paths, default=["local"], help="pipeline mode: local,up (see docstring)"
    )
    parser.add_argument("--engine", default="torch", choices=["torch", "emulated"])
    parser.add_argument("--emulate", default="tiny-llama", help="emulated engine's cost model")
    parser.add_argument("--time-scale", type=float, default=1.0, help="emulated engine's")
    parser.add_argument("--no-hf", action="store_true", help="pipeline mode: no hf side")
    parser.add_argument(
        "--source", type=_sources, default=["seeded"], help="torch: seeded,checkpoint"
    )
    parser.add_argument(
        "--max-inflight", type=int, default=0, help="micro-batches in flight (0: the default)"
    )
    parser.add_argument(
        "--max-outstanding", type=int, default=0, help="up: gateway's (0: --concurrency)"
    )
    parser.add_argument(
        "--return-microbatches",
        type=_counts("--return-microbatches"),
        default=[],
        help="e.g. 0,1: a side per value of engineOptions.returnMicrobatches (suffix -rN)",
    )
    parser.add_argument("--request-timeout-s", type=float, default=1800.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile switch: the engine's; with --stages, engineOptions.torchCompile",
    )
    parser.add_argument(
        "--pin",
        type=_pins,
        default=["off"],
        help="off,on: pipeline sides with each stage on its share of the cores "
        "(engineOptions.pinCores; suffix -pinned) and not",
    )
    parser.add_argument(
        "--pack",
        type=_packs,
        default=["on"],
        help="on,off: sides with the engine's weights packed and (-unpacked) not",
    )
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", action="store_true")
    return parser


def _refused_flags(args: argparse.Namespace) -> str:
    """Why flags given together cannot all be honoured ("" when they can): pipeline mode
    (``--stages``) runs the torch engine's stages on ``--device`` through ``LocalPipeline``
    only (any other engine or path on the CPU), its planner choosing micro-batches and chunks
    (no ``--batch``, ``--chunk-tokens``); engine mode runs the torch engine in this process,
    with none of the pipeline's flags."""
    if args.stages:
        if args.device != "cpu" and args.engine != "torch":
            return f"--device {args.device}: only with --engine torch"
        if args.device != "cpu" and args.path != ["local"]:
            return f"--device {args.device}: only with --path local (LocalPipeline)"
        if args.profile and args.path != ["local"]:
            return "--profile: with --stages, only --path local (the stages' loop profiles)"
        if args.compile and args.engine != "torch":
            return "--compile: only with --engine torch"
        defaults = build_parser().parse_args([])
        for flag in ("batch", "chunk_tokens"):  # the pipeline's planner cuts and batches
            if getattr(args, flag) != getattr(defaults, flag):
                return f"--{flag.replace('_', '-')}: only without --stages (engine mode)"
        return ""
    defaults = build_parser().parse_args([])
    for flag in (
        "engine",
        "pin",
        "path",
        "source",
        "concurrency",
        "max_inflight",
        "max_outstanding",
        "return_microbatches",
    ):
        if getattr(args, flag) != getattr(defaults, flag):
            return f"--{flag.replace('_', '-')}: only with --stages (pipeline mode)"
    return ""


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.no_hf and not args.stages:
        print("--no-hf: only with --stages (the engine mode compares with hf)", file=sys.stderr)
        return 2
    refused = _refused_flags(args)
    if refused:
        print(refused, file=sys.stderr)
        return 2
    for name in ("requests", "repeats", "threads", "batch", "chunk_tokens"):
        if getattr(args, name) < 1:
            parser_error = f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1"
            print(parser_error, file=sys.stderr)
            return 2
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
