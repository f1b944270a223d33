"""The settings ``wavepp sim`` simulates, from its flags: the model's derived H200 cost model,
the concurrencies, the simulated latencies, the KV capacity (``--kv-blocks``, else derived per
stage, and ``--host-memory-gib``: ``launch.grid.setting_capacity``), the baseline's fidelity
switches, and each (concurrency, mode)'s RuntimeConfig (``launch.grid.runtime_config`` with
the baseline laid over it). Every refusal is a :class:`FlagError` naming the flag.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wavepp.bench.grid import GridSpec, Setting
from wavepp.launch.capacity import Capacity, CapacityError
from wavepp.launch.flags import FlagError, positive_ints
from wavepp.launch.grid import runtime_config, setting_capacity
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.planning import CostModel
from wavepp.runtime.planning.catalogue import list_models
from wavepp.sim.bus import SimLatencies

# ``--baseline-budget`` when not given (RuntimeConfig.baseline.budget_accounting). The wave vs
# sync pipeline comparison keeps the paper's baseline, TensorRT-LLM's PP executor before its
# PR 11637 (a first chunk charged its whole prompt). The layout comparison (``--parallel`` /
# ``--recommend``, ``launch.sim_layouts``) charges new tokens only, as vLLM's and SGLang's
# schedulers do: charged its cached tokens too, a single-stage engine at high reuse fits one
# request per chunk (docs/bench/layouts.md).
PIPELINE_BUDGET = "none"
LAYOUTS_BUDGET = "exact"


@dataclass(frozen=True)
class SimPlan:
    """What ``wavepp sim`` runs.

    Attributes:
        model: the emulated model (``catalogue.list_models()``).
        reuse: the workload preset (``bench.workloads.REUSE_PRESETS``).
        concurrencies: closed-loop concurrencies, each >= 1.
        grid: the grid's fixed settings (stages, time scale, block size, ``--kv-blocks``,
            chunk budget).
        latencies: the simulated bus, KV and scheduler latencies (seconds).
        baseline_fields: the baseline's (``--mode sync``) ``RuntimeConfig.baseline`` section.
        host_memory_gib: the host tier per GPU, GiB (0: none).
        capacity: the KV capacity every setting runs with (``launch.grid.setting_capacity``).
        trace: a Mooncake trace to replay instead of the reuse preset, or None.
        modes: the modes run per concurrency ("wave", "sync").
    """

    model: str
    reuse: str
    concurrencies: list[int]
    grid: GridSpec
    latencies: SimLatencies
    baseline_fields: dict[str, Any]
    host_memory_gib: float
    capacity: Capacity
    trace: str | None
    modes: tuple[str, ...]

    def config(self, concurrency: int, mode: str) -> tuple[RuntimeConfig, CostModel]:
        """The RuntimeConfig and planner cost model of one setting (``mode`` wave or sync).

        Raises:
            FlagError: RuntimeConfig refuses the setting (``configuration``).
        """
        try:
            config, planner_cost = runtime_config(self.grid, self._setting(concurrency, mode))
            config = RuntimeConfig.model_validate(
                config.model_dump() | {"baseline": self.baseline_fields}
            )
        except ValueError as exc:
            raise FlagError("configuration", str(exc)) from None
        return config, planner_cost

    def _setting(self, concurrency: int, mode: str) -> Setting:
        return Setting(
            self.model, concurrency, self.reuse, mode, host_memory_gib=self.host_memory_gib
        )


def plan_sim(args: argparse.Namespace) -> SimPlan:
    """Resolve ``wavepp sim``'s flags (``cmd.sim.add_arguments``) into a :class:`SimPlan`,
    checking ``--model``, ``--concurrency``, ``--time-scale``, ``--kv-blocks``, the latencies,
    ``--baseline-overhead-ms`` (``--baseline-budget`` None: :data:`PIPELINE_BUDGET`), the
    configuration, the KV capacity (derived, ``--kv-blocks``; ``--host-memory-gib``),
    ``--trace`` and ``--modes``, in that order.

    Raises:
        FlagError: the first refusal, naming the flag.
    """
    if args.model not in list_models():
        raise FlagError("--model", f"{args.model!r}: choose from {list_models()}")
    concurrencies = list(positive_ints("--concurrency", args.concurrency))
    if args.time_scale <= 0:
        raise FlagError("--time-scale", f"{args.time_scale}: must be > 0")
    if args.kv_blocks is not None and args.kv_blocks < 1:
        raise FlagError("--kv-blocks", f"{args.kv_blocks}: must be >= 1")
    try:
        latencies = SimLatencies(
            kv_rtt_s=args.kv_rtt_ms / 1e3,
            bus_latency_s=args.bus_ms / 1e3,
            hop_s=args.hop_ms / 1e3,
            schedule_s=args.schedule_ms / 1e3,
        )
        grid = GridSpec(
            models=(args.model,),
            num_stages=4 if args.stages is None else args.stages,
            time_scale=args.time_scale,
            block_size=args.block_size,
            num_kv_blocks=args.kv_blocks,
            chunk_tokens=args.chunk_tokens,
        )
    except ValueError as exc:
        raise FlagError("--kv-rtt-ms/--bus-ms/--hop-ms/--schedule-ms", str(exc)) from None
    if not 0 <= args.baseline_overhead_ms <= 1000:
        raise FlagError(
            "--baseline-overhead-ms", f"{args.baseline_overhead_ms}: must be in [0, 1000]"
        )
    baseline_fields = {
        "budget_accounting": args.baseline_budget or PIPELINE_BUDGET,
        "iteration_overhead_s": args.baseline_overhead_ms / 1e3,
        "one_chunk_inflight": args.baseline_one_chunk,
        "lockstep_admission": args.baseline_lockstep,
        "prefix_reuse": args.baseline_prefix_reuse,
    }
    setting = Setting(args.model, 1, args.reuse, "wave", host_memory_gib=args.host_memory_gib)
    try:
        config, _ = runtime_config(grid, setting)
    except CapacityError as exc:
        raise FlagError(exc.field, exc.message) from None
    except ValueError as exc:
        raise FlagError("configuration", str(exc)) from None
    if args.trace is not None and not Path(args.trace).is_file():
        raise FlagError("--trace", f"{args.trace!r}: no such file")
    modes = tuple(m for m in args.modes.split(",") if m)
    if not modes or not set(modes) <= {"wave", "sync"}:
        raise FlagError("--modes", f"{args.modes!r}: a comma-separated list of wave, sync")
    return SimPlan(
        model=args.model,
        reuse=args.reuse,
        concurrencies=concurrencies,
        grid=grid,
        latencies=latencies,
        baseline_fields=baseline_fields,
        host_memory_gib=args.host_memory_gib,
        capacity=setting_capacity(grid, setting, config),
        trace=args.trace,
        modes=modes,
    )
