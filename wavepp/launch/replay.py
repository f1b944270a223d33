"""The replica ``wavepp replay`` runs (``LocalPipeline``), from its flags: the model (a preset
with random torch weights, or a checkpoint directory split by cost), the engine (torch, or
emulated with the cost model of ``--emulate``), the KV capacity (``--kv-blocks`` and
``--host-memory-gib``, ``launch.capacity.replica_capacity``), the planner's cost model, the
telemetry and the trace's token mapping (:func:`plan_replay`; every refusal a
:class:`FlagError` naming the flag).
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass
from pathlib import Path

from wavepp.bench.trace import TokenMapper
from wavepp.launch.capacity import Capacity, CapacityError, replica_capacity
from wavepp.launch.flags import FlagError, describe_error
from wavepp.launch.replica import planner_cost_model
from wavepp.launch.runtime_config import ServedCheckpoint
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.families import model_shape_from_hf
from wavepp.runtime.hf_config import load_model_dir, normalize_hf_config, read_hf_config
from wavepp.runtime.model_config import get_preset
from wavepp.runtime.planning import CostModel
from wavepp.runtime.planning.catalogue import ModelShape, derived_cost_model, list_models
from wavepp.runtime.planning.memory import FIXED_KV_BLOCKS
from wavepp.telemetry.settings import TelemetrySettings

_MAX_DERIVED_KV_BLOCKS = 1 << 22


def _telemetry_settings(args: argparse.Namespace) -> TelemetrySettings:
    """Telemetry flags -> settings; --timeline needs the spans in a JSON-lines file (a fresh
    one unless ``--trace-out`` names it; an existing ``--trace-out`` file is removed: one run
    per file)."""
    exporter = args.trace_exporter
    path = args.trace_out
    if exporter is None:
        exporter = "jsonl" if (path or args.timeline) else "none"
    if args.timeline and exporter != "jsonl":
        raise ValueError(
            f"--timeline reads a JSON-lines span file; got --trace-exporter {exporter}"
        )
    if exporter == "jsonl" and not path:
        path = str(Path(tempfile.mkdtemp(prefix="wavepp-trace-")) / "spans.jsonl")
    if path and Path(path).exists():
        Path(path).unlink()  # one run per file: the timeline and trace-view read all of it
    return TelemetrySettings(
        exporter=exporter,
        endpoint=args.otlp_endpoint,
        sampling_ratio=args.trace_sampling,
        jsonl_path=path,
        metrics_port=args.metrics_port,
    )


@dataclass(frozen=True)
class ReplayPlan:
    """What ``wavepp replay`` runs.

    Attributes:
        config: the replica's RuntimeConfig (its telemetry from the flags).
        planner_cost_model: what the planner budgets with (``--cost-model``, else the emulated
            model's, else the packaged tiny-llama CPU fit).
        mapper: trace hash ids -> token ids (``--tokens-per-block``, the model's vocabulary,
            ``--seed``).
        capacity: the KV capacity and where it came from (``launch.capacity``).
    """

    config: RuntimeConfig
    planner_cost_model: CostModel
    mapper: TokenMapper
    capacity: Capacity


def plan_replay(args: argparse.Namespace) -> ReplayPlan:
    """Resolve ``wavepp replay``'s flags (``cmd.replay.add_arguments``) into a
    :class:`ReplayPlan`, checking the telemetry flags, TRACE, ``--limit``, ``--concurrency``,
    the model, ``--emulate`` and the configuration, in that order.

    Raises:
        FlagError: the first refusal, naming the flag.
    """
    try:
        telemetry = _telemetry_settings(args)
    except ValueError as exc:
        raise FlagError("--trace-exporter/--trace-out/--timeline", str(exc)) from None
    if not Path(args.trace).is_file():
        raise FlagError("TRACE", f"{args.trace}: no such file")
    if args.limit is not None and args.limit < 1:
        raise FlagError("--limit", f"{args.limit}: must be >= 1")
    if args.concurrency < 1:
        raise FlagError("--concurrency", f"{args.concurrency}: must be >= 1")
    checkpoint: ServedCheckpoint | None = None
    if Path(args.model).is_dir() and args.engine != "torch":
        raise FlagError("--model", f"{args.model}: a checkpoint directory needs --engine torch")
    try:
        if Path(args.model).is_dir():
            checkpoint = ServedCheckpoint.read(args.model)
            model = checkpoint.model.model_copy(update={"seed": args.seed})
        else:
            model = get_preset(args.model).model_copy(update={"seed": args.seed})
        kv_blocks = (
            [int(v) for v in str(args.kv_blocks).split(",")] if args.kv_blocks is not None else None
        )
    except ValueError as exc:
        raise FlagError("--model/--kv-blocks", str(exc)) from None
    if kv_blocks is not None and len(kv_blocks) not in (1, args.stages):
        raise FlagError(
            "--kv-blocks",
            f"{args.kv_blocks}: {len(kv_blocks)} entries; give one (every stage) or one per "
            f"stage ({args.stages}, --stages)",
        )
    stage_cost: CostModel | None = None
    emulate: str | ModelShape = args.emulate
    if args.engine == "emulated":
        if Path(args.emulate).is_dir():
            try:
                emulate = model_shape_from_hf(
                    normalize_hf_config(read_hf_config(args.emulate)),
                    name=load_model_dir(args.emulate).name,
                )
            except (ValueError, KeyError) as exc:
                raise FlagError("--emulate", f"{args.emulate}: {exc}") from None
        elif args.emulate not in list_models():
            raise FlagError(
                "--emulate", f"{args.emulate!r}: choose one of {list_models()} or a checkpoint DIR"
            )
        try:
            stage_cost = derived_cost_model(emulate, num_stages=args.stages)
        except ValueError as exc:
            raise FlagError("--stages", str(exc)) from None
    try:
        config = RuntimeConfig(
            model=model,
            model_dir=checkpoint.model_dir if checkpoint else None,
            partition=checkpoint.partition(args.stages) if checkpoint else None,
            state_interval_blocks=args.state_interval_blocks,
            engine=args.engine,
            cost_model=stage_cost.to_dict() if stage_cost else None,
            time_scale=args.time_scale,
            num_stages=args.stages,
            block_size=args.block_size,
            num_kv_blocks=kv_blocks or [FIXED_KV_BLOCKS],  # the capacity's below
            mode=args.mode,
            chunk_tokens=args.chunk_tokens,
            chunk_policy=args.chunk_policy,
            agreement=args.agreement,
            local_prepare=None if args.local_prepare is None else args.local_prepare == "on",
            max_inflight=args.max_inflight,
            telemetry=telemetry,
        )
        mapper = TokenMapper(args.tokens_per_block, model.vocab_size, seed=args.seed)
    except ValueError as exc:
        raise FlagError("configuration", describe_error(exc)) from None
    try:
        capacity = replica_capacity(
            config,
            emulate=emulate if args.engine == "emulated" else None,
            kv_blocks=kv_blocks,
            host_memory_gib=args.host_memory_gib,
        )
    except CapacityError as exc:
        raise FlagError(exc.field, exc.message) from None
    if kv_blocks is None and max(capacity.num_kv_blocks) > _MAX_DERIVED_KV_BLOCKS:
        # NOTE: a tiny checkpoint emulated at H200 derives tens of millions of blocks; a
        # block pool that size takes minutes to build.
        raise FlagError(
            "--kv-blocks",
            f"unset, and its default derives {max(capacity.num_kv_blocks)} blocks per stage "
            f"({capacity.kv_blocks_source}); above {_MAX_DERIVED_KV_BLOCKS}: give --kv-blocks",
        )
    config = capacity.apply(config)
    planner_model = planner_cost_model(config, args.cost_model)
    return ReplayPlan(
        config=config,
        planner_cost_model=planner_model,
        mapper=mapper,
        capacity=capacity,
    )
