"""The runs ``wavepp bench grid`` makes, from its flags (:func:`plan_grid`; every refusal a
:class:`FlagError` naming the flag), and the RuntimeConfig of one grid setting
(:func:`runtime_config`, which ``wavepp sim`` shares): the emulated engine on the model's
derived H200 cost model of its slowest stage, its ablation, and its KV capacity
(:func:`setting_capacity`: ``GridSpec.num_kv_blocks`` on every stage, else derived per stage,
and the setting's host tier; ``launch.capacity.replica_capacity``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from wavepp.bench.grid import ABLATIONS, GridSpec, Setting, grid_settings
from wavepp.bench.workloads import REUSE_PRESETS
from wavepp.launch.capacity import Capacity, CapacityError, check_host_memory_gib, replica_capacity
from wavepp.launch.flags import FlagError, describe_error, positive_ints
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.model_config import get_preset
from wavepp.runtime.planning import CostModel
from wavepp.runtime.planning.catalogue import derived_cost_model, list_models
from wavepp.runtime.planning.memory import FIXED_KV_BLOCKS


def runtime_config(spec: GridSpec, setting: Setting) -> tuple[RuntimeConfig, CostModel]:
    """The stages' RuntimeConfig of one setting and the planner's cost model (the stages' own
    cost, scaled by ``spec.time_scale``).

    Raises:
        ValueError: RuntimeConfig refuses the setting; a CapacityError when no KV capacity can
            be derived or the setting's host tier is refused (:func:`setting_capacity`).
    """
    stage_cost = derived_cost_model(setting.model, num_stages=spec.num_stages)
    overrides = ABLATIONS.get(setting.ablation, {})
    config = RuntimeConfig(
        model=get_preset("tiny-llama"),
        engine="emulated",
        cost_model=stage_cost.to_dict(),
        time_scale=spec.time_scale,
        num_stages=spec.num_stages,
        block_size=spec.block_size,
        num_kv_blocks=[FIXED_KV_BLOCKS],  # setting_capacity's below
        mode=setting.mode,  # type: ignore[arg-type]
        chunk_tokens=spec.chunk_tokens,
        **overrides,
    )
    config = setting_capacity(spec, setting, config).apply(config)
    # The planner budgets with the stages' own cost, at the stages' time scale.
    return config, stage_cost.scaled(spec.time_scale)


def setting_capacity(spec: GridSpec, setting: Setting, config: RuntimeConfig) -> Capacity:
    """The KV capacity of one setting whose stages' config is ``config``: ``spec.num_kv_blocks``
    on every stage (None: derived from ``setting.model``), the host tier of
    ``setting.host_memory_gib`` (``launch.capacity.replica_capacity``; flags' names).

    Raises:
        CapacityError: as ``replica_capacity``.
    """
    given = spec.num_kv_blocks
    return replica_capacity(
        config,
        emulate=setting.model,
        kv_blocks=None if given is None else [given] * spec.num_stages,
        host_memory_gib=setting.host_memory_gib,
    )


@dataclass(frozen=True)
class GridPlan:
    """What ``wavepp bench grid`` runs.

    Attributes:
        spec: the grid (models x concurrencies x reuses, ablations, repeats, fixed settings).
        settings: every run in order (``bench.grid.grid_settings``).
    """

    spec: GridSpec
    settings: list[Setting]

    def config(self, setting: Setting) -> tuple[RuntimeConfig, CostModel]:
        """The RuntimeConfig and planner cost model of one of :attr:`settings`
        (:func:`runtime_config`)."""
        return runtime_config(self.spec, setting)


def plan_grid(args: argparse.Namespace) -> GridPlan:
    """Resolve ``wavepp bench grid``'s flags (``cmd.bench.add_arguments``) into a
    :class:`GridPlan`, checking ``--host-memory-gib`` (a comma-separated list of host tiers per
    GPU, each one a grid dimension's value), ``--concurrency``, the grid (``--repeats``,
    ``--trace``), then ``--models``, ``--trace``, ``--trace-requests``, ``--reuse``,
    ``--ablations``, ``--time-scale`` and each model's capacity at each host tier (its derived
    KV blocks, ``--kv-blocks``; a host tier that holds a block of every stage), in that order.

    Raises:
        FlagError: the first refusal, naming the flag.
    """
    host_tiers = _host_tiers(args.host_memory_gib)
    concurrencies = positive_ints("--concurrency", args.concurrency)
    try:
        spec = GridSpec(
            models=tuple(m for m in args.models.split(",") if m),
            concurrencies=concurrencies,
            reuses=tuple(r for r in args.reuse.split(",") if r),
            ablations=tuple(a for a in args.ablations.split(",") if a),
            ablation_concurrency=args.ablation_concurrency,
            ablation_reuse=args.ablation_reuse,
            num_stages=args.stages,
            time_scale=args.time_scale,
            block_size=args.block_size,
            num_kv_blocks=args.kv_blocks,
            chunk_tokens=args.chunk_tokens,
            min_requests=args.min_requests,
            requests_per_concurrency=args.requests_per_concurrency,
            repeats=args.repeats,
            trace=args.trace,
            trace_requests=args.trace_requests,
            host_memory_gib=host_tiers,
        )
    except ValueError as exc:  # GridSpec refuses repeats < 1 and mooncake without a trace
        raise FlagError("--repeats" if "repeats" in str(exc) else "--trace", str(exc)) from None
    for model in spec.models:
        if model not in list_models():
            raise FlagError("--models", f"{model!r}: choose from {list_models()}")
    if spec.trace and not Path(spec.trace).is_file():
        raise FlagError("--trace", f"{spec.trace}: no such file")
    if spec.trace_requests < 1:
        raise FlagError("--trace-requests", f"{spec.trace_requests}: must be >= 1")
    for reuse in (*spec.reuses, spec.ablation_reuse):
        if reuse not in REUSE_PRESETS and reuse != "mooncake":
            choices = [*sorted(REUSE_PRESETS), "mooncake (with --trace)"]
            raise FlagError("--reuse", f"{reuse!r}: choose from {choices}")
    for name in spec.ablations:
        if name not in ABLATIONS:
            raise FlagError("--ablations", f"{name!r}: choose from {sorted(ABLATIONS)}")
    if args.time_scale <= 0:
        raise FlagError("--time-scale", f"{args.time_scale}: must be > 0")
    for model in spec.models:
        for gib in spec.host_memory_gib:
            try:
                runtime_config(spec, Setting(model, 1, spec.reuses[0], "wave", host_memory_gib=gib))
            except CapacityError as exc:
                raise FlagError(exc.field, exc.message) from None
            except ValueError as exc:
                raise FlagError("configuration", describe_error(exc)) from None
    return GridPlan(spec=spec, settings=grid_settings(spec))


def _host_tiers(text: str) -> tuple[float, ...]:
    """``--host-memory-gib``: comma-separated GiB per GPU, each in the range
    ``launch.capacity.check_host_memory_gib`` allows, at least one.

    Raises:
        FlagError: an item that is not such a number, or none at all.
    """
    try:
        tiers = tuple(check_host_memory_gib(float(v)) for v in text.split(",") if v)
    except ValueError as exc:
        message = str(exc)
        if "could not convert" in message:
            message = f"{text!r}: need comma-separated GiB per GPU, e.g. 0,64,256"
        raise FlagError("--host-memory-gib", message) from None
    if not tiers:
        raise FlagError("--host-memory-gib", f"{text!r}: give at least one amount (0: none)")
    return tiers
