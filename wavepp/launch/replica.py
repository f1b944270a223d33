"""The RuntimeConfig of one replica's process (``wavepp stage``, ``wavepp admission``) from its
flags and environment.

Two ways to name it: ``--runtime-config F`` (a resolved RuntimeConfig JSON, ``wavepp up``
writes one per replica), or ``--config SPEC --replica I`` (the operator's ``spec.json``): then
``runtime_configs_from_spec(spec, pool=P, namespace=N)[0]`` renamed to replica I, with P from
``--pool`` or ``$WAVEPP_PIPELINE``, N from ``$WAVEPP_NAMESPACE`` (default ``local``), the
telemetry of :func:`telemetry_from_spec` and, when the spec has a ``decode`` section, the KV
transfer server of :func:`pod_handoff` (listening on every interface at ``HANDOFF_PORT``,
advertising ``$POD_IP``). ``--model DIR`` and ``--tensor-parallel-size T`` are
laid over either.
"""

from __future__ import annotations

import argparse
import json
import os
from importlib import resources
from pathlib import Path

from wavepp.api.pod import HANDOFF_PORT, POD_IP_ENV
from wavepp.api.spec import MAX_REPLICAS, SpecFileError, WavePipelineSpec, load_spec_file
from wavepp.api.subjects import replica_pipeline_name
from wavepp.launch.flags import (
    METRICS_PORT_ENV,
    NAMESPACE_ENV,
    POOL_ENV,
    ArgError,
    check_port,
    describe_error,
    model_from_file,
)
from wavepp.launch.runtime_config import runtime_configs_from_spec, with_checkpoint
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.planning import CostModel
from wavepp.telemetry.settings import TelemetrySettings


def with_tensor_parallel(config: RuntimeConfig, size: int | None) -> RuntimeConfig:
    """``config`` with ``--tensor-parallel-size`` laid over it (None: unchanged).

    Raises:
        ArgError: a size the config refuses (the family, the engine, the heads; names the flag).
    """
    if size is None:
        return config
    try:
        return RuntimeConfig.model_validate(config.model_dump() | {"tensor_parallel_size": size})
    except ValueError as exc:
        raise ArgError(f"--tensor-parallel-size {size}: {describe_error(exc)}") from None


def telemetry_from_spec(
    spec: WavePipelineSpec, env: dict[str, str] | os._Environ[str]
) -> TelemetrySettings:
    """The processes' TelemetrySettings from ``spec.telemetry`` (what the pods' env says too).

    ``otlpEndpoint`` set: OTLP export (``TelemetrySpec.exporter``) at ``samplingRatio``; unset:
    no tracing. ``metricsPort``: the
    Prometheus port, overridden by ``$WAVEPP_METRICS_PORT`` (the operator sets both alike).

    Raises:
        ArgError: ``$WAVEPP_METRICS_PORT`` is not an integer in [0, 65535].
    """
    metrics_port: int = spec.telemetry.metrics_port
    if env.get(METRICS_PORT_ENV):
        try:
            metrics_port = int(env[METRICS_PORT_ENV])
        except ValueError:
            raise ArgError(
                f"${METRICS_PORT_ENV} {env[METRICS_PORT_ENV]!r}: must be an integer"
            ) from None
        check_port(f"${METRICS_PORT_ENV}", metrics_port)
    return TelemetrySettings(
        exporter=spec.telemetry.exporter(),
        endpoint=spec.telemetry.otlp_endpoint or "",
        sampling_ratio=spec.telemetry.sampling_ratio,
        metrics_port=metrics_port,
    )


def spec_from_args(args: argparse.Namespace) -> WavePipelineSpec:
    """The spec of ``--config SPEC`` resolved as a pod's processes read it: image ``local`` and
    NATS URL ``--nats-url`` where the spec sets none.

    Raises:
        ArgError: ``--config SPEC: why``: the file cannot be read, is not a valid spec, or
            cannot be resolved (e.g. an unknown layer count).
    """
    try:
        return load_spec_file(args.config).resolved(
            default_image="local", default_nats_url=args.nats_url
        )
    except SpecFileError as exc:
        raise ArgError(f"--config {exc}") from None
    except ValueError as exc:  # SpecError
        raise ArgError(f"--config {args.config}: {describe_error(exc)}") from None


def runtime_config_from_args(
    args: argparse.Namespace, env: dict[str, str] | os._Environ[str]
) -> RuntimeConfig:
    """The process's RuntimeConfig from ``--runtime-config`` or ``--config/--replica/--pool``,
    with ``--model DIR`` (when given) laid over it (``runtime_config.with_checkpoint``).

    Args:
        args: parsed flags with ``runtime_config``, ``config``, ``replica``, ``pool``,
            ``nats_url``.
        env: the process environment (``WAVEPP_PIPELINE``, ``WAVEPP_NAMESPACE``: the
            namespace of every NATS name, default ``local``; ``WAVEPP_METRICS_PORT``).

    Returns:
        The RuntimeConfig; from a spec, with ``telemetry`` from :func:`telemetry_from_spec`.

    Raises:
        ArgError: unreadable or invalid file, replica out of range, no pool name, or a bad
            ``--model`` directory (names the flag).
    """
    config = _runtime_config_from_source(args, env)
    if getattr(args, "model", None):
        try:
            config = with_checkpoint(config, args.model)
        except ValueError as exc:
            raise ArgError(f"--model {args.model}: {exc}") from exc
    return config


def stage_config_from_args(
    args: argparse.Namespace, env: dict[str, str] | os._Environ[str]
) -> RuntimeConfig:
    """``wavepp stage``'s RuntimeConfig: :func:`runtime_config_from_args` with
    ``--tensor-parallel-size`` laid over it and ``telemetry.metrics_port`` set to
    ``--metrics-port`` (None: no metrics server). The stage's metrics port is its flag only: the
    config's is the admission's (under ``wavepp up`` both read one file on one host).

    Raises:
        ArgError: as :func:`runtime_config_from_args`, a size the config refuses, or a
            ``--metrics-port`` outside [0, 65535] (names the flag).
    """
    config = with_tensor_parallel(runtime_config_from_args(args, env), args.tensor_parallel_size)
    check_port("--metrics-port", args.metrics_port)
    telemetry = config.telemetry.model_copy(update={"metrics_port": args.metrics_port})
    return config.model_copy(update={"telemetry": telemetry})


def admission_pool(args: argparse.Namespace, env: dict[str, str] | os._Environ[str]) -> str:
    """The pool an admission serves: ``--pool``, else ``$WAVEPP_PIPELINE``.

    Raises:
        ArgError: neither is set.
    """
    pool = args.pool or env.get(POOL_ENV)
    if not pool:
        raise ArgError(f"--pool: give the pool name, or set ${POOL_ENV}")
    return pool


def _runtime_config_from_source(
    args: argparse.Namespace, env: dict[str, str] | os._Environ[str]
) -> RuntimeConfig:

    if args.runtime_config:
        return model_from_file("--runtime-config", args.runtime_config, RuntimeConfig)
    if args.replica is None:
        raise ArgError(f"--replica: required with --config {args.config}")
    pool = args.pool or env.get(POOL_ENV)
    if not pool:
        raise ArgError(f"--pool: required with --config unless ${POOL_ENV} is set")
    spec = spec_from_args(args)
    try:
        configs = runtime_configs_from_spec(
            spec, pool=pool, namespace=env.get(NAMESPACE_ENV) or "local"
        )
    except ValueError as exc:
        raise ArgError(f"--config {args.config}: {describe_error(exc)}") from None
    # NOTE: not bounded by spec.replicas: the file is per spec hash, which leaves replicas out,
    # so a replica added by a scale-up reads the file written before it (replicas were fewer).
    if not 0 <= args.replica < MAX_REPLICAS:
        raise ArgError(f"--replica {args.replica}: must be in [0, {MAX_REPLICAS})")
    try:  # validated: a long pool name plus "-r{i}" may pass the pipeline name's limit
        config = type(configs[0]).model_validate(
            configs[0].model_dump() | {"pipeline": replica_pipeline_name(pool, args.replica)}
        )
    except ValueError as exc:
        raise ArgError(f"--replica {args.replica}: {describe_error(exc)}") from None
    update = {"telemetry": telemetry_from_spec(spec, env)} | pod_handoff(spec, env)
    return config.model_copy(update=update)


def pod_handoff(spec: WavePipelineSpec, env: dict[str, str] | os._Environ[str]) -> dict[str, str]:
    """RuntimeConfig's KV transfer fields for a pod of ``spec``: with a ``decode`` section,
    ``handoff_listen`` = ``0.0.0.0:HANDOFF_PORT`` (decode pods pull from other hosts) and
    ``handoff_advertise`` = ``$POD_IP`` (the downward API's ``status.podIP``); without one,
    none (the config's defaults).

    Raises:
        ArgError: a decode section and no ``$POD_IP``.
    """
    if spec.decode is None:
        return {}
    pod_ip = env.get(POD_IP_ENV, "")
    if not pod_ip:
        raise ArgError(
            f"${POD_IP_ENV}: required with the spec's decode section (the address decode pods "
            "pull the stages' KV from; the operator sets it from status.podIP)"
        )
    return {"handoff_listen": f"0.0.0.0:{HANDOFF_PORT}", "handoff_advertise": pod_ip}


PACKAGED_PLANNER_COST_MODEL = "tiny-llama-cpu-2layers.json"
"""The planner's cost model when none is given and the engine is not emulated: a fit measured
on a CPU (``wavepp calibrate``), shipped in ``wavepp/runtime/planning/calibration/``."""


def planner_cost_model(config: RuntimeConfig, path: str = "") -> CostModel:
    """What a replica's planner budgets with: the CostModel JSON at ``path`` when given
    (``--planner-cost-model``, ``--cost-model``), else the config's (the emulated engine's
    derived model), else ``PACKAGED_PLANNER_COST_MODEL``.

    Raises:
        OSError: ``path`` cannot be read.
        ValueError: its JSON is not a CostModel.
    """
    if path:
        return CostModel.from_dict(json.loads(Path(path).read_text()))
    if config.cost_model is not None:
        return CostModel.from_dict(config.cost_model)
    packaged = resources.files("wavepp.runtime.planning") / "calibration"
    return CostModel.from_dict(json.loads((packaged / PACKAGED_PLANNER_COST_MODEL).read_text()))
