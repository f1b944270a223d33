"""What ``wavepp up`` serves and how, from its flags: the spec (``--config``, ``--model DIR``,
``--stages S``, ``--tensor-parallel-size T``, this host), each replica's RuntimeConfig, the
gateway's GatewayConfig and the tenants, the drain, the children's command lines, warnings for
what only the operator applies, and the serving line (:func:`plan_up` resolves them all; every
refusal is an :class:`FlagError` naming the flag).

``--config FILE`` is a WavePipeline spec; without it, tiny-llama on 2 torch stages.
``--model DIR`` serves the Hugging Face checkpoint in DIR (config.json + safetensors, any family
``wavepp.runtime.hf_config`` reads): it replaces the spec's ``model`` by ``{name: <DIR's
name>-<config.json's sha8>, path: DIR}`` (keeping ``model.dtype``), so the shape comes from
config.json and the layers are split by cost. ``--stages S`` replaces ``stages`` (and drops a
``layerPartition`` of the old count); ``--tensor-parallel-size T`` replaces
``tensorParallelSize``. A model directory's ``tokenizer.json`` is the gateway's
tokenizer unless ``--tokenizer`` names another. Then, as in the pods: the spec's
``telemetry``, and ``resources.gpusPerStage`` decided for this host.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wavepp.api.cli_args import NatsArgs, admission_args, gateway_args
from wavepp.api.permissions import admission_user_name, gateway_user_name, stage_user_name
from wavepp.api.pod import DRAIN_EXIT_MARGIN_S
from wavepp.api.spec import (
    SpecError,
    SpecFileError,
    TenantSpec,
    WavePipelineSpec,
    check_spec,
    read_spec_mapping,
)
from wavepp.gateway.config import GatewayConfig
from wavepp.gateway.tenants import TenantPolicy, policy_from_spec
from wavepp.launch.decode import DecodeServer, plan_decode
from wavepp.launch.flags import FlagError, check_port_free
from wavepp.launch.gateway import gateway_model_fields, key_files_problem, replica_info
from wavepp.launch.replica import planner_cost_model, telemetry_from_spec
from wavepp.launch.runtime_config import (
    checkpoint_tokenizer,
    runtime_configs_from_spec,
    with_checkpoint_layers,
)
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.hf_config import load_model_dir
from wavepp.runtime.serving.processes import stage_command, wavepp_command
from wavepp.runtime.stage.placement import launcher_cores, stage_cores
from wavepp.runtime.transport.natsio import free_port

DEFAULT_SPEC = {"model": {"name": "tiny-llama"}, "stages": 2}


def spec_mapping(args: argparse.Namespace) -> dict[str, Any]:
    """The raw spec from ``--config`` (or the default), ``--model``, ``--stages``,
    ``--tensor-parallel-size`` (``tensorParallelSize``) and ``--host-memory-gib``
    (``cache.hostMemoryGiB``), with a
    checkpoint's layer count from its config.json (``runtime_config.with_checkpoint_layers``).

    Raises:
        FlagError: an unreadable ``--config``, a ``--model`` directory without a readable
            config.json, ``--stages`` or ``--tensor-parallel-size`` < 1, or a spec model path without config.json (names the
            flag).
    """
    try:
        raw = dict(read_spec_mapping(args.config)) if args.config else dict(DEFAULT_SPEC)
    except SpecFileError as exc:
        raise FlagError("--config", str(exc)) from None
    if args.model:
        try:
            name = load_model_dir(args.model).name
        except ValueError as exc:
            raise FlagError("--model", f"{args.model}: {exc}") from None
        old = raw.get("model") if isinstance(raw.get("model"), dict) else {}
        model: dict[str, Any] = {"name": name, "path": str(Path(args.model).resolve())}
        if old.get("dtype") is not None:
            model["dtype"] = old["dtype"]
        raw["model"] = model
        if raw.get("engine", "torch") != "torch":
            raise FlagError("--model", f"{args.model}: a checkpoint needs engine: torch")
    if args.stages is not None:
        if args.stages < 1:
            raise FlagError("--stages", f"{args.stages}: must be >= 1")
        raw["stages"] = args.stages
        raw.pop("layerPartition", None)
        raw.pop("layer_partition", None)
    tp = getattr(args, "tensor_parallel_size", None)
    if tp is not None:
        if tp < 1:
            raise FlagError("--tensor-parallel-size", f"{tp}: must be >= 1")
        raw.pop("tensor_parallel_size", None)
        raw["tensorParallelSize"] = tp
    host_gib = getattr(args, "host_memory_gib", None)
    if host_gib is not None:
        # the spec check refuses a bad amount naming cache.hostMemoryGiB, the flag's field
        cache = raw.get("cache") if isinstance(raw.get("cache"), dict) else {}
        raw["cache"] = {**cache, "hostMemoryGiB": host_gib}
    try:
        return with_checkpoint_layers(raw)
    except SpecError as exc:
        raise FlagError("--model" if args.model else "--config", str(exc)) from None


def local_resources(raw: Any) -> dict[str, Any]:
    """The spec as a dict, with ``resources.gpusPerStage`` decided for this host when the spec
    leaves it out (torch engine): 1 (CUDA) when torch sees a GPU, else 0 (CPU). In a cluster the
    default is 1 GPU per stage pod; on a laptop there are no pods to give GPUs to."""
    data = raw.to_wire() if isinstance(raw, WavePipelineSpec) else dict(raw)
    resources = dict(data.get("resources") or {})
    if data.get("engine", "torch") == "torch" and resources.get("gpusPerStage") is None:
        import torch

        resources["gpusPerStage"] = 1 if torch.cuda.is_available() else 0
        data["resources"] = resources
    return data


def stage_metrics_port(configs: list[RuntimeConfig], replica: int, rank: int) -> int | None:
    """Under ``wavepp up`` (one host), the port of stage ``rank`` of replica ``replica``'s own
    ``/metrics``: P + R + replica x S + rank after the R admission ports P .. P + R - 1 (P the
    stated ``metricsPort``); None when no metrics port is stated."""
    first = configs[0].telemetry.metrics_port
    if not first:
        return None
    return first + len(configs) + replica * configs[0].num_stages + rank


def metrics_endpoints(configs: list[RuntimeConfig], host: str) -> dict[str, dict[str, str]]:
    """``processes.json``'s Prometheus endpoints: ``metrics`` (pipeline -> its admission's URL)
    and ``stage_metrics`` (``{pipeline}-{rank}`` -> that stage's URL); empty without a port."""
    return {
        "metrics": {
            c.pipeline: f"http://{host}:{c.telemetry.metrics_port}/metrics"
            for c in configs
            if c.telemetry.metrics_port
        },
        "stage_metrics": {
            f"{c.pipeline}-{rank}": f"http://{host}:{stage_metrics_port(configs, i, rank)}/metrics"
            for i, c in enumerate(configs)
            for rank in range(c.num_stages)
            if c.telemetry.metrics_port
        },
    }


def with_telemetry(
    configs: list[RuntimeConfig], spec: WavePipelineSpec, raw: dict, gateway_port: int = 0
) -> list[RuntimeConfig]:
    """The replicas' configs with ``spec.telemetry``: ``otlpEndpoint``/``samplingRatio`` as in
    the pods; a stated ``metricsPort`` P serves replica i's admission metrics on P + i and
    stage s of replica i its own on P + R + i x S + s (``stage_metrics_port``; one machine, one
    port each); without it no Prometheus port is opened.

    Raises:
        ValueError: the last of those ports passes 65535, one of them is ``gateway_port`` (the
            gateway's ``--port``; 0: not checked), or a bad ``$WAVEPP_METRICS_PORT`` (named).
    """
    telemetry = telemetry_from_spec(spec, os.environ)
    stated = isinstance(raw.get("telemetry"), dict) and (
        "metricsPort" in raw["telemetry"] or "metrics_port" in raw["telemetry"]
    )
    if not stated and not os.environ.get("WAVEPP_METRICS_PORT"):
        telemetry = telemetry.model_copy(update={"metrics_port": None})
    if telemetry.metrics_port and configs:
        last = telemetry.metrics_port + len(configs) * (1 + configs[0].num_stages) - 1
        ports = (
            f"telemetry.metricsPort {telemetry.metrics_port}: the {len(configs)} admissions' "
            f"and {len(configs) * configs[0].num_stages} stages' ports"
        )
        if last > 65535:
            raise ValueError(f"{ports} reach {last} > 65535")
        if telemetry.metrics_port <= gateway_port <= last:
            raise ValueError(
                f"{ports} {telemetry.metrics_port}..{last} include the gateway's --port "
                f"{gateway_port}; choose a metricsPort outside it"
            )
    out = []
    for i, config in enumerate(configs):
        port = telemetry.metrics_port
        if port:
            port += i
        out.append(
            config.model_copy(
                update={"telemetry": telemetry.model_copy(update={"metrics_port": port})}
            )
        )
    return out


# ---- what only the operator applies, the drain, the children's command lines ----------------

_POD_ONLY = "a pod setting; wavepp up runs this checkout's wavepp as local processes"
_PLACEMENT = "pod placement, applied by the Kubernetes operator only; wavepp up runs every process on this machine"
OPERATOR_ONLY_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("autoscaling", "autoscaling", "applied by the Kubernetes operator only; wavepp up runs spec.replicas replicas"),
    ("image", "image", _POD_ONLY),
    ("imagePullPolicy", "image_pull_policy", _POD_ONLY),
    ("imagePullSecrets", "image_pull_secrets", _POD_ONLY),
    ("serviceAccountName", "service_account_name", _POD_ONLY),
    ("podTemplate", "pod_template", _POD_ONLY),
    ("nodeSelector", "node_selector", _PLACEMENT),
    ("tolerations", "tolerations", _PLACEMENT),
    ("affinity", "affinity", _PLACEMENT),
    ("topologySpreadConstraints", "topology_spread_constraints", _PLACEMENT),
    ("topology", "topology", _PLACEMENT),
    ("networkPolicy", "network_policy", "a NetworkPolicy the operator renders; wavepp up makes none (its NATS bus has per-process credentials)"),
    ("inferencePool", "inference_pool", "an InferencePool the operator renders; wavepp up makes none"),
    ("decode", "decode", "the decode pool or Service of the operator's pods; wavepp up decodes with --decode vllm or --decode-url URL"),
    ("restartBudget", "restart_budget", "the operator's re-formation budget; wavepp up restarts a stage at most --max-stage-restarts times"),
)  # fmt: skip
"""Top-level spec fields only the operator applies: (wire name, Python name, why)."""
_SECTION_FIELDS_OPERATOR_ONLY = (
    ("resources", "a pod's resource request, applied by the Kubernetes operator only; wavepp up "
     "does not limit its processes (it uses resources.gpusPerStage)",
     (("cpu", "cpu"), ("memory", "memory"), ("sharedMemory", "shared_memory"),
      ("gpuResourceName", "gpu_resource_name"))),
    ("nats", "the pods' NATS server; wavepp up runs its own nats-server (with fresh credentials, "
     "see --insecure-nats)",
     (("url", "url"), ("credentialsSecret", "credentials_secret"), ("tlsSecret", "tls_secret"),
      ("tlsClientCert", "tls_client_cert"))),
)  # fmt: skip
"""Fields of a spec section only the operator applies: (section, why, ((wire, Python name), ...))."""


def _stated(mapping: Any, wire: str, python: str) -> bool:
    return isinstance(mapping, dict) and any(mapping.get(key) is not None for key in (wire, python))


def operator_only_warnings(raw: Any) -> list[str]:
    """One ``spec.FIELD: why`` line per field set in the raw spec that ``wavepp up`` does not
    apply: pod, placement and Kubernetes-object settings (``OPERATOR_ONLY_FIELDS``),
    ``resources`` other than ``gpusPerStage``, and ``nats`` (up runs its own nats-server).
    Empty when none is set. Pure: ``wavepp up`` prints them at start."""
    lines = [
        f"spec.{wire}: {why}"
        for wire, python, why in OPERATOR_ONLY_FIELDS
        if _stated(raw, wire, python)
    ]
    for section, why, fields in _SECTION_FIELDS_OPERATOR_ONLY:
        part = raw.get(section) if isinstance(raw, dict) else None
        lines += [
            f"spec.{section}.{wire}: {why}"
            for wire, python in fields
            if _stated(part, wire, python)
        ]
    return lines


STOP_GRACE_S = 10.0
"""The least time ``wavepp up`` gives a child between SIGTERM and SIGKILL (seconds)."""


def up_dirs(args: argparse.Namespace) -> tuple[Path, Path, Path]:
    """Where a run keeps its files, absolute: the state folder (``--state-dir``, created, or a
    fresh temporary one), the children's logs (``--log-dir`` or ``STATE/logs``) and the
    JetStream store (``--jetstream-dir`` or ``STATE/jetstream``)."""
    state_dir = Path(args.state_dir or tempfile.mkdtemp(prefix="wavepp-up-")).resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    log_dir = Path(args.log_dir).resolve() if args.log_dir else state_dir / "logs"
    store_dir = (
        Path(args.jetstream_dir).resolve() if args.jetstream_dir else state_dir / "jetstream"
    )
    return state_dir, log_dir, store_dir


def store_limit_config(state_dir: Path, max_bytes: int) -> str | None:
    """The nats-server config of ``--insecure-nats``, which only caps JetStream's disk use at
    ``max_bytes`` (``--jetstream-max-bytes``), written to ``STATE/nats-store-limit.conf``;
    None (no file) when ``max_bytes`` is 0. The authenticated server's config carries the same
    cap (``runtime.transport.auth.write_pool_auth``)."""
    if not max_bytes:
        return None
    path = state_dir / "nats-store-limit.conf"
    path.write_text(f"jetstream: {{ max_file_store: {max_bytes} }}\n")
    return str(path)


def drain_times(spec: WavePipelineSpec) -> tuple[float, float]:
    """(the admissions' ``--drain-timeout-s``, their SIGTERM-to-SIGKILL grace) in seconds for
    ``spec.rollout.drainTimeoutSeconds`` D, as the operator sets them
    (``api.pod.DRAIN_EXIT_MARGIN_S``): the admission drains for max(0, D - margin) and exits
    within the margin, so ``wavepp up`` waits max(D, ``STOP_GRACE_S``) before it kills one."""
    drain_s = max(0.0, spec.rollout.drain_timeout_s - DRAIN_EXIT_MARGIN_S)
    return drain_s, max(STOP_GRACE_S, drain_s + DRAIN_EXIT_MARGIN_S)


def child_commands(
    configs: list[RuntimeConfig],
    config_paths: list[str],
    dist_urls: list[str],
    *,
    args: argparse.Namespace,
    nats_url: str,
    port: int,
    drain_s: float,
    creds: dict[str, str] | None,
    gateway_config: str,
) -> list[tuple[str, list[str]]]:
    """``wavepp up``'s children in start order, (name, command): per replica i its stages
    (``config_paths[i]``, rendezvous ``dist_urls[i]``, metrics on ``stage_metrics_port``) and
    its admission (``--drain-timeout-s drain_s``), then the gateway (``gateway_config``); every metrics server binds
    ``args.host`` as the gateway does. ``creds``: NATS user -> credentials file (None: none).
    With ``pin_cores`` each stage gets its share of this process's cores among every
    replica's stages (``--cores``, ``placement.stage_cores``)."""

    def nats(user: str) -> NatsArgs:
        return NatsArgs(nats_url, creds=None if creds is None else creds[user])

    out: list[tuple[str, list[str]]] = []
    all_stages = sum(config.num_stages for config in configs)
    index = 0  # this stage's place among every replica's stages (its share of the cores)
    for replica, config in enumerate(configs):
        path = config_paths[replica]
        for rank in range(config.num_stages):
            metrics_port = stage_metrics_port(configs, replica, rank)
            command = stage_command(
                config,
                path,
                rank,
                dist_urls[replica],
                nats(stage_user_name(config.pipeline, rank)),
                core_share=(index, all_stages),
                metrics_port=metrics_port,
                metrics_host=None if metrics_port is None else args.host,
            )
            index += 1
            out.append((f"stage-{config.pipeline}-{rank}", command))
        command = admission_args(
            nats(admission_user_name(config.pipeline)),
            runtime_config=path,
            pool=args.pool,
            ack_wait_s=args.ack_wait_s,
            drain_s=drain_s,
            metrics_host=args.host,
            planner_cost_model=getattr(args, "planner_cost_model", "") or None,
        )
        out.append((f"admission-{config.pipeline}", wavepp_command(command)))
    command = gateway_args(
        nats(gateway_user_name(args.pool)),
        gateway_config=gateway_config,
        host=args.host,
        port=port,
    )
    out.append(("gateway", wavepp_command(command)))
    return out


def serving_line(
    endpoint: str, pool: str, configs: list[RuntimeConfig], tokenizer: str | None, nats_url: str, secure: bool,
    log_dir: object, decode_urls: list[str] | None = None,
) -> str:  # fmt: skip
    """The line ``wavepp up`` prints once the gateway is ready: the endpoint, replicas x stages
    (x tensor-parallel processes), engine, model, tokenizer, the decode endpoints (whole
    completions; none: prefill only), NATS and the logs."""
    first = configs[0]
    decode = (
        f"; decode on {', '.join(decode_urls)}"
        if decode_urls
        else "; prefill only (no decode endpoints)"
    )
    tp = first.tensor_parallel_size
    return (
        f"wavepp up: serving {endpoint} (pool {pool}: {len(configs)} replica(s) x "
        f"{first.num_stages} {first.engine} stages"
        f"{f' x tensor parallel {tp}' if tp > 1 else ''} of {first.model.name}"
        f"{f' from {first.model_dir}' if first.model_dir else ''}"
        f"{f', tokenizer {tokenizer}' if tokenizer else ''}{decode}; NATS {nats_url} "
        f"{'with auth' if secure else 'WITHOUT AUTH (--insecure-nats)'}; logs {log_dir})"
    )


# ---- the whole plan -----------------------------------------------------------------------

MAX_LOCAL_PROCESSES = 256
"""Processes ``wavepp up`` starts at most: replicas x (stages + 1) + gateway + nats-server."""


@dataclass(frozen=True)
class UpPlan:
    """What ``wavepp up`` runs, resolved from its flags before anything starts.

    Attributes:
        raw: the spec mapping (``--config`` or the default, with the flags laid over it).
        spec: the checked spec (``resources.gpusPerStage`` decided for this host).
        configs: each replica's RuntimeConfig, with telemetry (:func:`with_telemetry`).
        gateway: the gateway's configuration (tenants with their limits and key files).
        port: the gateway's port (``--port``, or a free one for 0).
        tokenizer: ``--tokenizer``, else the checkpoint's ``tokenizer.json``, else None.
        drain_s: the admissions' ``--drain-timeout-s`` (:func:`drain_times`).
        admission_grace_s: SIGTERM to SIGKILL of an admission (:func:`drain_times`).
        auth_line: the line saying whether API keys are required, printed once serving.
        decode: the local decode instances to start (``--decode vllm``; ``launch.decode.plan_decode``).
        decode_urls: every decode endpoint, local ones first (the gateway's ``decode_urls``).
    """

    raw: dict[str, Any]
    spec: WavePipelineSpec
    configs: list[RuntimeConfig]
    gateway: GatewayConfig
    port: int
    tokenizer: str | None
    drain_s: float
    admission_grace_s: float
    auth_line: str
    decode: list[DecodeServer] = field(default_factory=list)
    decode_urls: list[str] = field(default_factory=list)


def plan_up(args: argparse.Namespace) -> UpPlan:
    """Resolve ``wavepp up``'s flags (``cmd.up.add_arguments``) into an :class:`UpPlan`,
    checking them in this order: the spec (:func:`spec_mapping`, the spec check, the
    RuntimeConfigs and telemetry), the process count (at most ``MAX_LOCAL_PROCESSES``), a core
    per stage with ``engineOptions.pinCores`` (``placement.stage_cores``), the
    gateway's flags (``--max-outstanding``, ``--max-queued``, ``--tokenizer``, ``--port``: in
    range and free now), ``--max-stage-restarts``, the tenants (``--tenant-limits``, the spec's
    key files), ``--jetstream-max-bytes``, ``--planner-cost-model`` (a readable CostModel JSON;
    made absolute for the admissions).

    Raises:
        FlagError: the first refusal, naming the flag (``--config`` for the spec's fields).
    """
    raw = spec_mapping(args)
    flags = [
        f
        for f, v in (
            ("--model", args.model),
            ("--stages", args.stages),
            ("--tensor-parallel-size", args.tensor_parallel_size),
            ("--host-memory-gib", getattr(args, "host_memory_gib", None)),
        )
        if v is not None and v != ""
    ]
    # A refusal names what made the spec: the file (and the flags that override it), the flags
    # alone (then the refusal's flag names them), or the default spec.
    flag = "/".join((["--config"] if args.config else []) + flags) or "--config"
    prefix = ""
    if args.config:
        prefix = f"{args.config} with {' '.join(flags)}: " if flags else f"{args.config}: "
    elif not flags:
        prefix = "the default spec: "
    spec, issues = check_spec(
        local_resources(raw), default_image="local", default_nats_url="nats://embedded"
    )
    if spec is None:
        raise FlagError(flag, prefix + "; ".join(str(i) for i in issues))
    try:
        configs = runtime_configs_from_spec(spec, pool=args.pool)
        configs = with_telemetry(configs, spec, raw, gateway_port=args.port)
    except ValueError as exc:  # SpecError among them
        raise FlagError(flag, str(exc)) from None
    tokenizer = args.tokenizer or checkpoint_tokenizer(spec)
    drain_s, admission_grace_s = drain_times(spec)
    num_processes = sum(c.num_stages + 1 for c in configs) + 2
    if num_processes > MAX_LOCAL_PROCESSES:
        raise FlagError(
            flag,
            f"{prefix}spec.replicas x (spec.stages + 1) + 2 = {num_processes} local "
            f"processes; wavepp up runs at most {MAX_LOCAL_PROCESSES} (use the operator)",
        )
    pinned = sum(c.num_stages for c in configs if c.pin_cores)
    if pinned:
        try:
            stage_cores(launcher_cores(), sum(c.num_stages for c in configs), 0)
        except ValueError as exc:
            raise FlagError(flag, f"{prefix}{exc}") from None
    _check_gateway_flags(args)
    port = args.port or free_port()
    tenants = _tenants(args, spec)
    key_files = {t.name: t.api_keys_file for t in tenants if t.api_keys_file}
    problem = key_files_problem(key_files)
    if problem:
        raise FlagError("--config", problem)
    if key_files:
        keyless = sorted(t.name for t in tenants if not t.api_keys_file)
        auth_line = f"authentication on: API keys of tenants {sorted(key_files)}" + (
            f"; tenants without keys cannot be reached: {keyless}" if keyless else ""
        )
    else:
        auth_line = (
            "authentication off (open local mode): no tenant has API keys (apiKeysFile), any "
            "caller may name any tenant"
        )
    first = configs[0]
    on_cpu = spec.gpus_per_stage() == 0
    decode, decode_urls = plan_decode(args, first, on_cpu)
    gateway = GatewayConfig(
        pool=args.pool,
        replicas=[replica_info(c.pipeline, c) for c in configs],
        **gateway_model_fields(first),
        tenants=tenants,
        routing=args.routing,
        max_outstanding_per_replica=args.max_outstanding,
        max_queued_requests=args.max_queued,
        request_timeout_s=args.request_timeout_s,
        replica_timeout_s=args.replica_timeout_s,
        tokenizer=str(Path(tokenizer).resolve()) if tokenizer else None,
        decode_urls=decode_urls,
        decode_max_tokens=args.decode_max_tokens,
        # the replicas' tracing (exporter, endpoint, sampling); metrics on the gateway's port
        telemetry=first.telemetry.model_copy(update={"metrics_port": None}),
    )
    if args.jetstream_max_bytes < 0:
        raise FlagError("--jetstream-max-bytes", f"{args.jetstream_max_bytes}: must be >= 0")
    if args.planner_cost_model:
        try:
            planner_cost_model(first, args.planner_cost_model)
        except (OSError, ValueError, TypeError) as exc:
            raise FlagError(
                "--planner-cost-model", f"{args.planner_cost_model}: not a CostModel JSON: {exc}"
            ) from None
        args.planner_cost_model = str(Path(args.planner_cost_model).resolve())
    return UpPlan(
        raw=raw,
        spec=spec,
        configs=configs,
        gateway=gateway,
        port=port,
        tokenizer=tokenizer,
        drain_s=drain_s,
        admission_grace_s=admission_grace_s,
        auth_line=auth_line,
        decode=decode,
        decode_urls=decode_urls,
    )


def _check_gateway_flags(args: argparse.Namespace) -> None:
    """``--max-outstanding``, ``--max-queued``, ``--tokenizer``, ``--port`` (in range, free now)
    and ``--max-stage-restarts``, in that order; raises FlagError naming the flag."""
    if args.max_outstanding < 1:
        raise FlagError("--max-outstanding", f"{args.max_outstanding}: must be >= 1")
    if args.max_queued < 1:
        raise FlagError("--max-queued", f"{args.max_queued}: must be >= 1")
    if args.tokenizer and not Path(args.tokenizer).exists():
        raise FlagError("--tokenizer", f"{args.tokenizer}: no such file or folder")
    if not 0 <= args.port <= 65535:
        raise FlagError("--port", f"{args.port}: must be in [0, 65535]")
    busy = check_port_free(args.host, args.port)
    if busy is not None:
        raise FlagError("--port", f"{busy}; choose another port (0: a free one)")
    if args.max_stage_restarts < 0:
        raise FlagError("--max-stage-restarts", f"{args.max_stage_restarts}: must be >= 0")


def _tenants(args: argparse.Namespace, spec: WavePipelineSpec) -> list[TenantPolicy]:
    """The spec's tenants (or one ``default``) with the flags filling what the spec leaves unset
    (``--tenant-max-concurrency``, ``--tenant-tokens-per-s``) and ``--tenant-limits``
    overriding both; a tenant's ``apiKeysFile`` relative to the spec's folder.

    Raises:
        FlagError: ``--tenant-limits`` is not a JSON object of known tenants or gives a bad
            limit; a tenant names an ``apiKeySecret`` (Kubernetes only; ``--config``).
    """
    try:
        overrides = json.loads(args.tenant_limits) if args.tenant_limits else {}
        if not isinstance(overrides, dict):
            raise ValueError("must be a JSON object: tenant -> limits")
    except ValueError as exc:
        raise FlagError("--tenant-limits", str(exc)) from None
    tenant_specs = spec.tenants or [TenantSpec(name="default")]
    names = [t.name for t in tenant_specs]
    unknown = sorted(set(overrides) - set(names))
    if unknown:
        raise FlagError("--tenant-limits", f"unknown tenants {unknown}; the spec has {names}")
    spec_dir = Path(args.config).resolve().parent if args.config else Path.cwd()
    tenants = []
    for t in tenant_specs:
        if t.api_key_secret:
            raise FlagError(
                "--config",
                f"spec.tenants[{t.name}].apiKeySecret names a Kubernetes Secret; for wavepp up "
                "give apiKeysFile (the same format as the Secret's 'keys')",
            )
        keys_file = str(spec_dir / t.api_keys_file) if t.api_keys_file else None
        base = policy_from_spec(t, api_keys_file=keys_file).model_dump()
        # the flags fill what the spec leaves unset; --tenant-limits overrides both
        if base["max_concurrency"] is None:
            base["max_concurrency"] = args.tenant_max_concurrency
        if base["tokens_per_s"] is None:
            base["tokens_per_s"] = args.tenant_tokens_per_s
        try:
            tenants.append(TenantPolicy.model_validate({**base, **overrides.get(t.name, {})}))
        except ValueError as exc:
            raise FlagError("--tenant-limits", str(exc)) from None
    return tenants
