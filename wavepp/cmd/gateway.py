"""``wavepp gateway``: the prefill API over HTTP and NATS (what the gateway pod runs).

The configuration comes from ``--gateway-config F`` (a GatewayConfig JSON, ``wavepp up`` writes
it) or from ``--config SPEC --pool-file POOL_JSON`` (the operator's ``spec.json`` and ``pool.json``):
see :func:`gateway_config_from_spec`. ``--host`` defaults to 127.0.0.1 with ``--gateway-config``
and to 0.0.0.0 (a pod) with ``--config``.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wavepp.cmd.common import add_deprecated_alias
from wavepp.cmd.stage import add_nats_args

if TYPE_CHECKING:
    from wavepp.api.spec import WavePipelineSpec
    from wavepp.gateway.config import GatewayConfig, ReplicaInfo
    from wavepp.runtime.config import RuntimeConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--gateway-config", help="GatewayConfig JSON")
    source.add_argument(
        "--config",
        help="WavePipeline spec (YAML/JSON, e.g. /etc/wavepp/spec.json); with --pool-file",
    )
    parser.add_argument(
        "--pool-file",
        default=None,
        help="the operator's pool.json (with --config): pool name, replicas",
    )
    add_deprecated_alias(parser, "--pool", "--pool-file", "pool_file")
    add_nats_args(parser)
    parser.add_argument(
        "--host",
        default=None,
        help="HTTP bind address (default 127.0.0.1; 0.0.0.0 with --config)",
    )
    parser.add_argument("--port", type=int, default=8000, help="HTTP port")
    parser.add_argument(
        "--routing",
        choices=["prefix", "round_robin", "least_loaded"],
        default=None,
        help="override the config's routing policy",
    )
    parser.add_argument(
        "--max-queued",
        type=int,
        default=None,
        help="override the config's max_queued_requests (default 1024): requests queued or "
        "running in the gateway, all tenants; past it: 429",
    )


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
    from wavepp.gateway.config import ReplicaInfo

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
    into the gateway pod too) holds one, else none (text prompts: 422).

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
    from wavepp.api.spec import SpecError
    from wavepp.gateway.config import GatewayConfig
    from wavepp.gateway.tenants import TenantPolicy, default_cache_salt, policy_from_spec
    from wavepp.operator.containers import api_keys_path
    from wavepp.runtime.serving.from_spec import (
        checkpoint_tokenizer,
        replica_pipeline_name,
        runtime_configs_from_spec,
    )

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
        **extra,
    )


def _config_from_args(args: argparse.Namespace) -> GatewayConfig:
    from wavepp.api.spec import SpecFileError, load_spec_file
    from wavepp.cmd.common import describe_error
    from wavepp.cmd.stage import NAMESPACE_ENV, ArgError
    from wavepp.gateway.config import GatewayConfig

    if args.gateway_config:
        try:
            config = GatewayConfig.model_validate_json(Path(args.gateway_config).read_text())
        except (OSError, ValueError) as exc:
            raise ArgError(
                f"--gateway-config {args.gateway_config}: {describe_error(exc)}"
            ) from None
        return _override(config, args)
    if not args.pool_file:
        raise ArgError(f"--pool-file: required with --config {args.config} (the pool.json file)")
    try:
        pool_doc = json.loads(Path(args.pool_file).read_text())
        if not isinstance(pool_doc, dict):
            raise ValueError("expected a JSON object")
    except (OSError, ValueError) as exc:
        raise ArgError(f"--pool-file {args.pool_file}: {describe_error(exc)}") from None
    try:
        spec = load_spec_file(args.config).resolved(
            default_image="local", default_nats_url=args.nats_url
        )
        config = gateway_config_from_spec(
            spec,
            pool_doc,
            routing=args.routing,
            namespace=os.environ.get(NAMESPACE_ENV) or "local",
        )
    except SpecFileError as exc:
        raise ArgError(f"--config {exc}") from None
    except ValueError as exc:
        raise ArgError(
            f"--config {args.config} / --pool-file {args.pool_file}: {describe_error(exc)}"
        ) from None
    return _override(config, args)


def _override(config: GatewayConfig, args: argparse.Namespace) -> GatewayConfig:
    """``config`` with the flags that override it (``--routing``, ``--max-queued``)."""
    from wavepp.cmd.stage import ArgError

    update: dict[str, object] = {}
    if args.routing:
        update["routing"] = args.routing
    if args.max_queued is not None:
        if args.max_queued < 1:
            raise ArgError(f"--max-queued {args.max_queued}: must be >= 1")
        update["max_queued_requests"] = args.max_queued
    return config.model_copy(update=update) if update else config


def run(args: argparse.Namespace) -> int:
    from wavepp.runtime.serving.lifecycle import exit_with_parent

    exit_with_parent()
    from wavepp.cmd.common import (
        config_exit_code,
        describe_error,
        startup_failure,
    )
    from wavepp.cmd.stage import ArgError, apply_nats_tls, check_creds
    from wavepp.gateway.http import load_tokenizer, run_gateway
    from wavepp.runtime.transport.buskey import BusKeyError, load_bus_key

    try:
        config = _config_from_args(args)
        check_creds(args.nats_creds)
        apply_nats_tls(args)
        load_bus_key()  # a bad WAVEPP_BUS_KEY is a one-line error here
    except (ArgError, BusKeyError) as exc:
        print(f"wavepp gateway: {exc}", file=sys.stderr)
        return config_exit_code(os.environ)
    tokenizer = None
    if config.tokenizer:
        try:
            tokenizer = load_tokenizer(config.tokenizer)
        except Exception as exc:  # noqa: BLE001 - tokenizers raises its own Exception types
            print(f"wavepp gateway: tokenizer: {describe_error(exc)}", file=sys.stderr)
            return config_exit_code(os.environ)
    if not 0 < args.port < 65536:
        print(f"wavepp gateway: --port {args.port}: must be in [1, 65535]", file=sys.stderr)
        return config_exit_code(os.environ)
    host = args.host or ("0.0.0.0" if args.config else "127.0.0.1")
    failure = startup_failure(
        args.nats_url, args.nats_connect_timeout_s, [("--port", host, args.port)]
    )
    if failure is not None:
        print(f"wavepp gateway: {failure}", file=sys.stderr)
        return 2
    if args.nats_creds:
        # NOTE: run_gateway opens its connection with natsio.connect, which reads this.
        os.environ["WAVEPP_NATS_CREDS"] = args.nats_creds
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s gateway %(levelname)s %(name)s: %(message)s"
    )
    try:
        asyncio.run(run_gateway(config, args.nats_url, host, args.port, tokenizer=tokenizer))
    except OSError as exc:
        if exc.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):
            raise
        # NOTE: the port was free at the check above and taken before the bind.
        print(f"wavepp gateway: --port {host}:{args.port}: {describe_error(exc)}", file=sys.stderr)
        return 2
    return 0
