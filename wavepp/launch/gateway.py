"""The gateway's configuration (GatewayConfig) from the spec, the operator's ``pool.json`` and
the flags of ``wavepp gateway``; the pieces ``wavepp up`` builds its own from.

In a pod the gateway reads ``--config SPEC --pool-file POOL_JSON`` (:func:`gateway_config_from_spec`);
under ``wavepp up`` a GatewayConfig JSON (``--gateway-config``) that up wrote with the same
pieces (:func:`replica_info`, :func:`gateway_model_fields`; ``wavepp.launch.up``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from wavepp.api.pod import api_keys_path
from wavepp.api.spec import SpecError, WavePipelineSpec, decode_urls
from wavepp.gateway.config import GatewayConfig, ReplicaInfo
from wavepp.gateway.tenants import TenantPolicy, default_cache_salt, policy_from_spec
from wavepp.launch.flags import NAMESPACE_ENV, ArgError, describe_error, model_from_file
from wavepp.launch.replica import spec_from_args, telemetry_from_spec
from wavepp.launch.runtime_config import (
    checkpoint_tokenizer,
    replica_pipeline_name,
    runtime_configs_from_spec,
)
from wavepp.runtime.config import RuntimeConfig


def pool_replicas(pool_doc: dict[str, Any], num_spec_replicas: int) -> list[int]:
    """The replica indices the gateway routes to, from the operator's ``pool.json``.

    ``pool.json`` is ``{"pipeline": p, "replicas": [{"replica": i, "admitting": b, ...}]}``
    (``builders.build_pool_configmap``). The admitting replicas; when none admits yet (a new
    pipeline: the file is written before any replica serves), every listed one; an empty list
    means ``range(max(1, spec.replicas))``. Replicas that do not answer are left out by the
    router at run time (heartbeats), so listing a forming replica is harmless.

    Args:
        pool_doc: the parsed ``pool.json``.
        num_spec_replicas: ``spec.replicas``.

    Returns:
        Sorted, distinct replica indices (at least one).

    Raises:
        ValueError: ``replicas`` is not a list of objects with an integer ``replica`` >= 0.
    """
    entries = pool_doc.get("replicas", [])
    if not isinstance(entries, list):
        raise ValueError(f"pool.json replicas: {entries!r:.80} is not a list")
    listed: list[int] = []
    admitting: list[int] = []
    for entry in entries:
        index = entry.get("replica") if isinstance(entry, dict) else None
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise ValueError(f"pool.json replicas[]: {entry!r:.80} has no integer replica >= 0")
        listed.append(index)
        if entry.get("admitting"):
            admitting.append(index)
    chosen = admitting or listed or list(range(max(1, num_spec_replicas)))
    return sorted(set(chosen))


def replica_info(pipeline: str, config: RuntimeConfig) -> ReplicaInfo:
    """The gateway's view of one replica: its pipeline name, stages and each stage's KV blocks
    (the router's index of a stage holds at most that many block hashes)."""
    return ReplicaInfo(
        pipeline=pipeline,
        num_stages=config.num_stages,
        stage_blocks=[config.kv_blocks_of(r) for r in range(config.num_stages)],
    )


def gateway_model_fields(first: RuntimeConfig) -> dict[str, Any]:
    """GatewayConfig's model fields from a replica's RuntimeConfig: ``model_name``,
    ``model_id``, ``block_size``, ``vocab_size`` and ``max_prompt_tokens`` (the fewest blocks
    one admission may hold on a stage, its pool or ``max_blocks_per_owner`` when lower, in
    tokens, at most the model's ``max_position``: a longer prompt could never be admitted)."""
    return {
        "model_name": first.model.name,
        "model_id": first.model_id,
        "block_size": first.block_size,
        "vocab_size": first.model.vocab_size,
        "max_prompt_tokens": min(
            min(first.owner_blocks_of(r) for r in range(first.num_stages)) * first.block_size,
            first.model.max_position,
        ),
    }


def gateway_config_from_spec(
    spec: WavePipelineSpec,
    pool_doc: dict[str, Any],
    *,
    routing: str | None = None,
    namespace: str = "local",
) -> GatewayConfig:
    """The gateway's configuration from the resolved spec and the operator's ``pool.json``.

    Pool name: ``pool_doc["pipeline"]`` (the WavePipeline's name); replicas: :func:`pool_replicas`,
    each ``{pool}-r{i}`` with ``spec.stages`` stages; model, block size and vocabulary from the
    replica's RuntimeConfig; ``max_prompt_tokens`` = min(smallest stage KV capacity (or
    ``max_blocks_per_owner`` when lower) x block_size,
    the model's max position) as ``wavepp up`` does; tenants from ``spec.tenants`` with every
    limit the spec sets (salt: the spec's, else ``tenant:{name}``), or one ``default`` tenant;
    a tenant's ``apiKeySecret`` is read from its mount, ``{API_KEYS_DIR}/{tenant}/keys``; the
    tokenizer is the checkpoint's ``tokenizer.json`` when ``model.path`` (or the PVC, mounted
    into the gateway pod too) holds one, else none (text prompts: 422); ``decode_urls`` the
    Service of ``spec.decode`` (``wavepp.api.spec.decode_urls``: the rendered pool's or the
    referenced one), none without it (prefill only); tracing as the replicas'
    (``spec.telemetry``, ``replica.telemetry_from_spec``).

    Args:
        spec: the resolved spec.
        pool_doc: the parsed ``pool.json``.
        routing: routing policy override (None: ``prefix``).
        namespace: the pool's namespace (``$WAVEPP_NAMESPACE``), in every NATS name.

    Returns:
        A validated GatewayConfig.

    Raises:
        ValueError: no pool name in ``pool_doc``, a malformed replica list, a tenant with
            ``apiKeysFile`` (``wavepp up`` only), or a spec the runtime cannot run (SpecError
            is a ValueError).
    """
    pool = pool_doc.get("pipeline")
    if not isinstance(pool, str) or not pool:
        raise ValueError(f"pool.json pipeline: {pool!r} is not a pool name")
    replicas = pool_replicas(pool_doc, spec.num_replicas)
    first = runtime_configs_from_spec(spec, pool=pool, namespace=namespace)[0]
    for t in spec.tenants:
        if t.api_keys_file:
            raise SpecError(
                "tenants.apiKeysFile",
                f"tenant {t.name!r}: apiKeysFile is for wavepp up; in Kubernetes use apiKeySecret",
            )
    tenants = [
        policy_from_spec(t, api_keys_file=api_keys_path(t.name) if t.api_key_secret else None)
        for t in spec.tenants
    ] or [TenantPolicy(name="default", cache_salt=default_cache_salt("default"))]
    extra = {"routing": routing} if routing else {}
    return GatewayConfig(
        pool=pool,
        namespace=namespace,
        replicas=[replica_info(replica_pipeline_name(pool, i), first) for i in replicas],
        **gateway_model_fields(first),
        tenants=tenants,
        tokenizer=checkpoint_tokenizer(spec),
        decode_urls=decode_urls(spec.decode, pipeline=pool, namespace=namespace),
        # the pods' tracing (spec.telemetry: otlpEndpoint, samplingRatio); metrics: its port
        telemetry=telemetry_from_spec(spec, {}).model_copy(update={"metrics_port": None}),
        **extra,
    )


def gateway_config_from_args(
    args: argparse.Namespace, env: Mapping[str, str] = os.environ
) -> GatewayConfig:
    """The gateway process's GatewayConfig: ``--gateway-config F`` (a GatewayConfig JSON), or
    ``--config SPEC --pool-file POOL_JSON`` (:func:`gateway_config_from_spec`, namespace
    ``$WAVEPP_NAMESPACE``); then ``--routing`` and ``--max-queued`` laid over it.

    Raises:
        ArgError: an unreadable or invalid file, no ``--pool-file`` with ``--config``, a
            spec the runtime cannot run, ``--max-queued`` < 1 (names the flag).
    """
    if args.gateway_config:
        return _override(
            model_from_file("--gateway-config", args.gateway_config, GatewayConfig), args
        )
    if not args.pool_file:
        raise ArgError(f"--pool-file: required with --config {args.config} (the pool.json file)")
    try:
        pool_doc = json.loads(Path(args.pool_file).read_text())
        if not isinstance(pool_doc, dict):
            raise ValueError("expected a JSON object")
    except (OSError, ValueError) as exc:
        raise ArgError(f"--pool-file {args.pool_file}: {describe_error(exc)}") from None
    spec = spec_from_args(args)
    try:
        config = gateway_config_from_spec(
            spec,
            pool_doc,
            routing=args.routing,
            namespace=env.get(NAMESPACE_ENV) or "local",
        )
    except ValueError as exc:
        raise ArgError(
            f"--config {args.config} / --pool-file {args.pool_file}: {describe_error(exc)}"
        ) from None
    return _override(config, args)


def gateway_host(args: argparse.Namespace) -> str:
    """The address the gateway binds: ``--host``, else every interface with ``--config`` (a
    pod: the Service reaches it), else 127.0.0.1 (a local gateway is not exposed by default)."""
    return args.host or ("0.0.0.0" if args.config else "127.0.0.1")


def _override(config: GatewayConfig, args: argparse.Namespace) -> GatewayConfig:
    """``config`` with the flags that override it (``--routing``, ``--max-queued``)."""
    update: dict[str, object] = {}
    if args.routing:
        update["routing"] = args.routing
    if args.max_queued is not None:
        if args.max_queued < 1:
            raise ArgError(f"--max-queued {args.max_queued}: must be >= 1")
        update["max_queued_requests"] = args.max_queued
    return config.model_copy(update=update) if update else config


def key_files_problem(key_files: dict[str, str]) -> str:
    """The first problem with the tenants' API key files (tenant -> path), read as the gateway
    reads them at start (``gateway.auth.authenticator_for``), as ``apiKeysFile: ...``; "" when
    every file loads."""
    from wavepp.gateway.auth import KeyFileError, authenticator_for

    try:
        authenticator_for(
            key_files,
            poll_s=1.0,
            failure_burst=1,
            failures_per_s=1.0,
            clock=time.monotonic,
            wall_clock=time.time,
        )
    except KeyFileError as exc:
        return f"apiKeysFile: {exc}"
    return ""


def spec_key_files_problem(spec: WavePipelineSpec, spec_path: str) -> str:
    """The first problem with the tenants' ``apiKeysFile``s (read as ``wavepp up`` reads them,
    relative to the spec's folder) naming the field (``spec.tenants[0].apiKeysFile: ...``),
    or "" when there is none."""
    folder = Path(spec_path).resolve().parent
    key_files: dict[str, str] = {}
    for index, tenant in enumerate(getattr(spec, "tenants", [])):
        if not tenant.api_keys_file:
            continue
        path = str(folder / tenant.api_keys_file)
        problem = key_files_problem({tenant.name: path})
        if problem:
            return f"spec.tenants[{index}].{problem}"
        key_files[tenant.name] = path
    # NOTE: what only the files together can break (a key in two tenants' files).
    problem = key_files_problem(key_files)
    return f"spec.tenants[*].{problem}" if problem else ""
