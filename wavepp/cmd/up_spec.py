"""The spec ``wavepp up`` serves: ``--config``, ``--model DIR``, ``--stages S``,
``--tensor-parallel-size T``, this host; and what up does with it (warnings for what only the
operator applies, the drain, the children's command lines, the serving line).

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
import os
from pathlib import Path
from typing import Any

DEFAULT_SPEC = {"model": {"name": "tiny-llama"}, "stages": 2}


class UpSpecError(ValueError):
    """A flag's value ``wavepp up`` cannot serve; ``flag`` names it."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(message)
        self.flag = flag


def spec_mapping(args: argparse.Namespace) -> dict[str, Any]:
    """The raw spec from ``--config`` (or the default), ``--model``, ``--stages`` and
    ``--tensor-parallel-size`` (``tensorParallelSize``), with a
    checkpoint's layer count from its config.json (``from_spec.with_checkpoint_layers``).

    Raises:
        UpSpecError: an unreadable ``--config``, a ``--model`` directory without a readable
            config.json, ``--stages`` or ``--tensor-parallel-size`` < 1, or a spec model path without config.json (names the
            flag).
    """
    from wavepp.api.spec import SpecError, SpecFileError, read_spec_mapping
    from wavepp.runtime.hf_config import load_model_dir
    from wavepp.runtime.serving.from_spec import with_checkpoint_layers

    try:
        raw = dict(read_spec_mapping(args.config)) if args.config else dict(DEFAULT_SPEC)
    except SpecFileError as exc:
        raise UpSpecError("--config", str(exc)) from None
    if args.model:
        try:
            name = load_model_dir(args.model).name
        except ValueError as exc:
            raise UpSpecError("--model", f"{args.model}: {exc}") from None
        old = raw.get("model") if isinstance(raw.get("model"), dict) else {}
        model: dict[str, Any] = {"name": name, "path": str(Path(args.model).resolve())}
        if old.get("dtype") is not None:
            model["dtype"] = old["dtype"]
        raw["model"] = model
        if raw.get("engine", "torch") != "torch":
            raise UpSpecError("--model", f"{args.model}: a checkpoint needs engine: torch")
    if args.stages is not None:
        if args.stages < 1:
            raise UpSpecError("--stages", f"{args.stages}: must be >= 1")
        raw["stages"] = args.stages
        raw.pop("layerPartition", None)
        raw.pop("layer_partition", None)
    tp = getattr(args, "tensor_parallel_size", None)
    if tp is not None:
        if tp < 1:
            raise UpSpecError("--tensor-parallel-size", f"{tp}: must be >= 1")
        raw.pop("tensor_parallel_size", None)
        raw["tensorParallelSize"] = tp
    try:
        return with_checkpoint_layers(raw)
    except SpecError as exc:
        raise UpSpecError("--model" if args.model else "--config", str(exc)) from None


def local_resources(raw: Any) -> dict[str, Any]:
    """The spec as a dict, with ``resources.gpusPerStage`` decided for this host when the spec
    leaves it out (torch engine): 1 (CUDA) when torch sees a GPU, else 0 (CPU). In a cluster the
    default is 1 GPU per stage pod; on a laptop there are no pods to give GPUs to."""
    from wavepp.api.spec import WavePipelineSpec

    data = raw.to_wire() if isinstance(raw, WavePipelineSpec) else dict(raw)
    resources = dict(data.get("resources") or {})
    if data.get("engine", "torch") == "torch" and resources.get("gpusPerStage") is None:
        import torch

        resources["gpusPerStage"] = 1 if torch.cuda.is_available() else 0
        data["resources"] = resources
    return data


def stage_metrics_port(configs: list, replica: int, rank: int) -> int | None:
    """Under ``wavepp up`` (one host), the port of stage ``rank`` of replica ``replica``'s own
    ``/metrics``: P + R + replica x S + rank after the R admission ports P .. P + R - 1 (P the
    stated ``metricsPort``); None when no metrics port is stated."""
    first = configs[0].telemetry.metrics_port
    if not first:
        return None
    return first + len(configs) + replica * configs[0].num_stages + rank


def metrics_endpoints(configs: list, host: str) -> dict[str, dict[str, str]]:
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
    configs: list, spec: object, raw: dict, gateway_port: int = 0
) -> list:  # RuntimeConfig, spec
    """The replicas' configs with ``spec.telemetry``: ``otlpEndpoint``/``samplingRatio`` as in
    the pods; a stated ``metricsPort`` P serves replica i's admission metrics on P + i and
    stage s of replica i its own on P + R + i x S + s (``stage_metrics_port``; one machine, one
    port each); without it no Prometheus port is opened.

    Raises:
        ValueError: the last of those ports passes 65535, one of them is ``gateway_port`` (the
            gateway's ``--port``; 0: not checked), or a bad ``$WAVEPP_METRICS_PORT`` (named).
    """
    from wavepp.cmd.stage import telemetry_from_spec

    telemetry = telemetry_from_spec(spec, os.environ)  # type: ignore[arg-type]
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
    ("restartBudget", "restart_budget", "the operator's re-formation budget; wavepp up restarts a stage at most --max-stage-restarts times"),
)  # fmt: skip
"""Top-level spec fields only the operator applies: (wire name, Python name, why)."""
_RESOURCES_ONLY = (("cpu", "cpu"), ("memory", "memory"), ("sharedMemory", "shared_memory"),
                   ("gpuResourceName", "gpu_resource_name"))  # fmt: skip
_NATS_ONLY = (("url", "url"), ("credentialsSecret", "credentials_secret"),
              ("tlsSecret", "tls_secret"), ("tlsClientCert", "tls_client_cert"))  # fmt: skip


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
    resources = raw.get("resources") if isinstance(raw, dict) else None
    lines += [
        f"spec.resources.{wire}: a pod's resource request, applied by the Kubernetes operator "
        "only; wavepp up does not limit its processes (it uses resources.gpusPerStage)"
        for wire, python in _RESOURCES_ONLY
        if _stated(resources, wire, python)
    ]
    nats = raw.get("nats") if isinstance(raw, dict) else None
    lines += [
        f"spec.nats.{wire}: the pods' NATS server; wavepp up runs its own nats-server "
        "(with fresh credentials, see --insecure-nats)"
        for wire, python in _NATS_ONLY
        if _stated(nats, wire, python)
    ]
    return lines


STOP_GRACE_S = 10.0
"""The least time ``wavepp up`` gives a child between SIGTERM and SIGKILL (seconds)."""


def drain_times(spec: Any) -> tuple[float, float]:
    """(the admissions' ``--drain-timeout-s``, their SIGTERM-to-SIGKILL grace) in seconds for
    ``spec.rollout.drainTimeoutSeconds`` D, as the operator sets them
    (``operator.containers``): the admission drains for max(0, D - margin) and exits within the
    margin, so ``wavepp up`` waits max(D, ``STOP_GRACE_S``) before it kills one."""
    from wavepp.operator.containers import DRAIN_EXIT_MARGIN_S

    drain_s = max(0.0, spec.rollout.drain_timeout_s - DRAIN_EXIT_MARGIN_S)
    return drain_s, max(STOP_GRACE_S, drain_s + DRAIN_EXIT_MARGIN_S)


def child_commands(
    configs: list,
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
    ``args.host`` as the gateway does. ``creds``: NATS user -> credentials file (None: none)."""
    import sys

    from wavepp.api.permissions import admission_user_name, gateway_user_name, stage_user_name

    def creds_of(user: str) -> list[str]:
        return [] if creds is None else ["--nats-creds", creds[user]]

    cli = [sys.executable, "-m", "wavepp.cli"]
    out: list[tuple[str, list[str]]] = []
    for replica, config in enumerate(configs):
        path = config_paths[replica]
        for rank in range(config.num_stages):
            metrics = stage_metrics_port(configs, replica, rank)
            out.append((
                f"stage-{config.pipeline}-{rank}",
                [*cli, "stage", "--runtime-config", path, "--rank", str(rank),
                 "--nats-url", nats_url, "--dist-url", dist_urls[replica],
                 *(["--metrics-port", str(metrics), "--metrics-host", args.host]
                   if metrics else []),
                 *creds_of(stage_user_name(config.pipeline, rank))],
            ))  # fmt: skip
        out.append((
            f"admission-{config.pipeline}",
            [*cli, "admission", "--runtime-config", path, "--nats-url", nats_url,
             "--pool", args.pool, "--ack-wait-s", str(args.ack_wait_s),
             "--drain-timeout-s", f"{drain_s:g}", "--metrics-host", args.host,
             *creds_of(admission_user_name(config.pipeline))],
        ))  # fmt: skip
    out.append((
        "gateway",
        [*cli, "gateway", "--gateway-config", gateway_config,
         "--nats-url", nats_url, "--host", args.host, "--port", str(port),
         *creds_of(gateway_user_name(args.pool))],
    ))  # fmt: skip
    return out


def serving_line(
    endpoint: str, pool: str, configs: list, tokenizer: str, nats_url: str, secure: bool,
    log_dir: object,
) -> str:  # fmt: skip
    """The line ``wavepp up`` prints once the gateway is ready: the endpoint, replicas x stages
    (x tensor-parallel processes), engine, model, tokenizer, NATS and the logs."""
    first = configs[0]
    tp = first.tensor_parallel_size
    return (
        f"wavepp up: serving {endpoint} (pool {pool}: {len(configs)} replica(s) x "
        f"{first.num_stages} {first.engine} stages"
        f"{f' x tensor parallel {tp}' if tp > 1 else ''} of {first.model.name}"
        f"{f' from {first.model_dir}' if first.model_dir else ''}"
        f"{f', tokenizer {tokenizer}' if tokenizer else ''}; NATS {nats_url} "
        f"{'with auth' if secure else 'WITHOUT AUTH (--insecure-nats)'}; logs {log_dir})"
    )
