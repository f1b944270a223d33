"""The layouts ``wavepp sim --parallel`` / ``--recommend`` compares, from its flags.

Each layout (``planning.parallel.parse_layout``: ``pp8-wave``, ``pp8-sync``, ``tp8``, ``tep8``,
``pp4xtp2`` ...) becomes the RuntimeConfig of ``launch.grid.runtime_config`` for its stage count
and mode, with, laid over it: every stage's derived cost model for the layout
(``parallel.replica_stage_cost_models``; the planner budgets with their coefficient-wise
maximum, at the time scale), each stage's KV capacity for the layout
(``parallel.replica_kv_blocks``, the same derivation ``planning.memory`` gives the pipeline
modes, or ``--kv-blocks`` on every stage), and the baseline's fidelity switches
(``--baseline-budget`` not given: ``launch.sim.LAYOUTS_BUDGET``, new tokens only). A single-stage
layout (tp/tep/ep) runs the synchronous scheduler: static chunks of ``--chunk-tokens`` (the
engine's chunked prefill), prefix caching in its one pool, no cross-stage agreement. The other
flags (latencies, baseline, concurrency, model) are checked by ``launch.sim.plan_sim``.
Every refusal is a :class:`FlagError` naming the flag.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

from wavepp.bench.grid import GridSpec, Setting
from wavepp.launch.flags import FlagError
from wavepp.launch.grid import runtime_config
from wavepp.launch.sim import LAYOUTS_BUDGET, SimPlan, plan_sim
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.planning import CostModel
from wavepp.runtime.planning.parallel import (
    H200_NVLINK,
    Layout,
    parse_layout,
    parse_layouts,
    replica_kv_blocks,
    replica_stage_cost_models,
)
from wavepp.runtime.planning.published import get_model

MAX_PIPELINE_STAGES = 8  # the simulated stages run the 8-layer tiny-llama config (emulated)


@dataclass(frozen=True)
class LayoutRun:
    """One layout resolved for one concurrency.

    Attributes:
        layout: the parsed layout.
        config: the stages' RuntimeConfig (mode, stages, KV capacity, baseline).
        planner_cost: what the scheduler's planner budgets with (scaled by the time scale).
        stage_cost_models: each stage's cost (unscaled; the simulated stage scales it).
    """

    layout: Layout
    config: RuntimeConfig
    planner_cost: CostModel
    stage_cost_models: list[CostModel]


@dataclass(frozen=True)
class LayoutsPlan:
    """What ``wavepp sim --parallel`` runs.

    Attributes:
        sim: the common flags (model, concurrencies, latencies, baseline, grid settings).
        layouts: the layouts that fit, in the order given.
        refused: (layout, reason) for those whose weights leave no KV block (``--recommend``
            only; with ``--parallel`` a layout that does not fit is an error).
        kv_blocks: per layout label, KV blocks per stage.
    """

    sim: SimPlan
    layouts: list[Layout]
    refused: list[tuple[Layout, str]]
    kv_blocks: dict[str, list[int]]

    def run(self, layout: Layout, concurrency: int) -> LayoutRun:
        """The RuntimeConfig, planner model and stage models of one layout at one concurrency.

        Raises:
            FlagError: RuntimeConfig refuses the setting (``configuration``).
        """
        sim = self.sim
        grid = sim.grid
        stage_models = replica_stage_cost_models(
            sim.model, layout, link=H200_NVLINK, microbatch_tokens=grid.chunk_tokens
        )
        slowest = CostModel(
            c=max(m.c for m in stage_models),
            g=max(m.g for m in stage_models),
            b=max(m.b for m in stage_models),
            a=max(m.a for m in stage_models),
            label="derived",
            source=f"slowest stage (coefficient-wise max) of {stage_models[0].source}",
        )
        try:
            base, _ = runtime_config(
                _grid_for(grid, layout),
                Setting(sim.model, concurrency, sim.reuse, layout.mode),
            )
            config = RuntimeConfig.model_validate(
                {
                    **base.model_dump(),
                    "cost_model": slowest.to_dict(),
                    "num_kv_blocks": self.kv_blocks[layout.label],
                    "baseline": sim.baseline_fields,
                }
            )
        except ValueError as exc:
            raise FlagError("configuration", f"{layout.label}: {exc}") from None
        return LayoutRun(layout, config, slowest.scaled(grid.time_scale), stage_models)


def _grid_for(grid: GridSpec, layout: Layout) -> GridSpec:
    # The KV capacity is laid over afterwards; a fixed one here skips the PP derivation.
    return replace(grid, num_stages=layout.num_stages, num_kv_blocks=grid.num_kv_blocks or 1)


def candidate_layouts(num_gpus: int) -> list[Layout]:
    """Every layout of ``num_gpus`` GPUs ``--recommend`` tries: pp{S}x{tp|tep}{t} with S*t = G,
    t in (1, 2, 4, 8), S <= 8, in wave and sync mode for S > 1; tp{G}, tep{G} and ep{G} when
    G fits one NVLink domain.

    Raises:
        ValueError: num_gpus < 1, or no layout of that many GPUs exists within the limits.
    """
    if num_gpus < 1:
        raise ValueError(f"--gpus={num_gpus}: must be >= 1")
    texts: list[str] = []
    if 1 < num_gpus <= H200_NVLINK.max_group_size and not num_gpus & (num_gpus - 1):
        texts += [f"tp{num_gpus}", f"tep{num_gpus}", f"ep{num_gpus}"]
    for t in (1, 2, 4, 8):
        if num_gpus % t:
            continue
        stages = num_gpus // t
        if not 2 <= stages <= MAX_PIPELINE_STAGES:
            continue
        groups = ("",) if t == 1 else (f"xtp{t}", f"xtep{t}")
        for group in groups:
            for mode in ("wave", "sync"):
                texts.append(f"pp{stages}{group}-{mode}")
    if not texts:
        raise ValueError(
            f"--gpus={num_gpus}: no layout fits (t in 1, 2, 4, 8 within one node, at most "
            f"{MAX_PIPELINE_STAGES} stages)"
        )
    return [parse_layout(text) for text in texts]


def plan_layouts(args: argparse.Namespace) -> LayoutsPlan:
    """Resolve ``--parallel`` (or ``--recommend`` with ``--gpus``) and the common flags.

    Checks, in order: ``--stages`` (the layouts set it; refused alongside them),
    ``--host-memory-gib`` (refused: the layouts run without a host tier), the common
    flags (``launch.sim.plan_sim``), ``--parallel`` (syntax, limits, at most 8 stages, one GPU
    count for all layouts), then each layout's KV capacity.

    Raises:
        FlagError: the first refusal, naming the flag.
    """
    if args.stages is not None:
        raise FlagError("--stages", "the layouts of --parallel / --recommend set the stages")
    if args.host_memory_gib:
        raise FlagError(
            "--host-memory-gib", "the layouts of --parallel / --recommend run without a host tier"
        )
    # plan_sim checks the shared flags; a fixed capacity there keeps it from deriving the
    # pipeline's (the layouts derive their own below).
    common = argparse.Namespace(
        **{
            **vars(args),
            "stages": 1,
            "kv_blocks": args.kv_blocks or 1,
            "baseline_budget": args.baseline_budget or LAYOUTS_BUDGET,
        }
    )
    sim = plan_sim(common)
    if args.recommend:
        flag = "--gpus"
        try:
            layouts = (
                parse_layouts(args.parallel) if args.parallel else candidate_layouts(args.gpus)
            )
        except ValueError as exc:
            raise FlagError("--parallel" if args.parallel else flag, str(exc)) from None
    else:
        flag = "--parallel"
        try:
            layouts = parse_layouts(args.parallel)
        except ValueError as exc:
            raise FlagError(flag, str(exc)) from None
    for layout in layouts:
        if layout.num_stages > MAX_PIPELINE_STAGES:
            raise FlagError(
                "--parallel",
                f"layout {layout.label!r}: S={layout.num_stages} stages; the simulator runs at "
                f"most {MAX_PIPELINE_STAGES}",
            )
        if layout.num_stages > get_model(sim.model).num_layers:
            raise FlagError("--parallel", f"layout {layout.label!r}: more stages than layers")
    gpus = sorted({layout.num_gpus for layout in layouts})
    if len(gpus) > 1:
        raise FlagError(
            "--parallel",
            "layouts use different GPU counts "
            + ", ".join(f"{x.label}={x.num_gpus}" for x in layouts)
            + ": compare layouts of the same GPUs",
        )
    kv_blocks: dict[str, list[int]] = {}
    fitting: list[Layout] = []
    refused: list[tuple[Layout, str]] = []
    largest = RuntimeConfig(chunk_tokens=sim.grid.chunk_tokens).largest_microbatch_tokens
    for layout in layouts:
        if args.kv_blocks is not None:
            kv_blocks[layout.label] = [args.kv_blocks] * layout.num_stages
            fitting.append(layout)
            continue
        try:
            kv_blocks[layout.label] = replica_kv_blocks(
                sim.model,
                layout,
                block_size=sim.grid.block_size,
                max_microbatch_tokens=largest,
            )
        except ValueError as exc:
            if not args.recommend:
                raise FlagError("--parallel", f"layout {layout.label!r}: {exc}") from None
            refused.append((layout, str(exc)))
            continue
        fitting.append(layout)
    if not fitting:
        reasons = "; ".join(f"refused {layout.label}: {reason}" for layout, reason in refused)
        raise FlagError(flag, f"no layout of {gpus[0]} GPUs holds {sim.model}. {reasons}")
    return LayoutsPlan(sim=sim, layouts=fitting, refused=refused, kv_blocks=kv_blocks)
