"""``wavepp stage``: one pipeline stage process (what each stage pod runs).

Two ways to name the configuration:

- ``--runtime-config F``: a resolved RuntimeConfig JSON (``wavepp up`` writes one per replica);
- ``--config SPEC --replica I``: the WavePipeline spec (the operator's ``spec.json``) and the
  replica index; the RuntimeConfig is ``runtime_configs_from_spec(spec, pool=P, namespace=N)[I]``,
  with P from ``--pool`` or the environment variable ``WAVEPP_PIPELINE`` and N from
  ``WAVEPP_NAMESPACE`` (default ``local``; the operator sets both).

``--rank`` may be an integer or the unexpanded ``$(WAVEPP_RANK)``; absent or unexpanded, the
environment variable ``WAVEPP_RANK`` gives the rank. ``--health-port P`` serves, on the stage's
event loop (aiohttp):

| path        | 200 when                                                              |
| ----------- | --------------------------------------------------------------------- |
| /healthz    | the compute thread is alive (it feeds its own beat; a raise or stall ends it) |
| /startupz   | the torch.distributed group has formed and the engine is built        |
| /readyz     | subscribed to its plans and KV requests (serving), not stopping, compute alive |

otherwise 503. With ``--tensor-parallel-size T`` (or the configuration's ``tensor_parallel_size``,
the spec's ``tensorParallelSize``) the process is the stage's TP rank 0 and starts T - 1
follower processes, one per device (``wavepp.runtime.stage.tp_launch``). A configuration the stage cannot honour (a bad flag or spec, CUDA asked for but
absent, weights not there) is one line naming the flag or field and exit 2, or
``$WAVEPP_CONFIG_EXIT_CODE`` (78 in the operator's pods: ``CONFIG_EXIT_CODE``; see
``wavepp.cmd.common.config_exit_code``). This module also holds the helpers ``wavepp admission``
shares (spec -> config, health server); it imports nothing heavy at module level.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import ssl
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from wavepp.cmd.common import add_nats_wait_arg

if TYPE_CHECKING:
    from aiohttp import web

    from wavepp.api.spec import WavePipelineSpec
    from wavepp.runtime.config import RuntimeConfig
    from wavepp.telemetry.settings import TelemetrySettings

RANK_ENV = "WAVEPP_RANK"
POOL_ENV = "WAVEPP_PIPELINE"
NAMESPACE_ENV = "WAVEPP_NAMESPACE"  # the pod's namespace (downward API): in every NATS name
METRICS_PORT_ENV = "WAVEPP_METRICS_PORT"
_UNEXPANDED = re.compile(r"^\$\([A-Za-z_][A-Za-z0-9_]*\)$")


class ArgError(ValueError):
    """A bad command-line value; the message names the flag."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_replica_config_args(parser, runtime_config_help="path of the resolved RuntimeConfig JSON")
    parser.add_argument(
        "--pool",
        default=None,
        help=f"pool name (with --config); default: ${POOL_ENV} (set by the operator)",
    )
    parser.add_argument(
        "--rank",
        default=None,
        help=f"stage rank r in [0, S); absent or an unexpanded $({RANK_ENV}): ${RANK_ENV}",
    )
    add_nats_args(parser, url_help="NATS server URL, e.g. nats://host:4222")
    parser.add_argument(
        "--dist-url",
        required=True,
        help="torch.distributed init method, e.g. tcp://stage-0.pipeline:29500",
    )
    parser.add_argument(
        "--health-port",
        type=int,
        default=None,
        help="serve /healthz, /startupz, /readyz on this port (none: no health server)",
    )
    parser.add_argument("--health-host", default="0.0.0.0", help="bind address of --health-port")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve the stage's Prometheus /metrics on this port (none: no metrics; "
        "wavepp.runtime.stage.metrics)",
    )
    parser.add_argument(
        "--metrics-host",
        default="0.0.0.0",
        help="bind address of --metrics-port (wavepp up passes its --host)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=None,
        metavar="T",
        help="processes computing this stage, one per device (cuda:0..T-1, or T CPU processes "
        "over gloo); default: the configuration's (spec.tensorParallelSize)",
    )


def with_tensor_parallel(config: RuntimeConfig, size: int | None) -> RuntimeConfig:
    """``config`` with ``--tensor-parallel-size`` laid over it (None: unchanged).

    Raises:
        ArgError: a size the config refuses (the family, the engine, the heads; names the flag).
    """
    from wavepp.runtime.config import RuntimeConfig

    if size is None:
        return config
    try:
        return RuntimeConfig.model_validate(config.model_dump() | {"tensor_parallel_size": size})
    except ValueError as exc:
        from wavepp.cmd.common import describe_error

        raise ArgError(f"--tensor-parallel-size {size}: {describe_error(exc)}") from None


# ---- helpers shared with `wavepp admission` -------------------------------------------------


def add_replica_config_args(parser: argparse.ArgumentParser, *, runtime_config_help: str) -> None:
    """Where a replica's RuntimeConfig comes from (read by ``runtime_config_from_args``):
    ``--runtime-config F`` or ``--config SPEC --replica I``, and ``--model DIR``."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--runtime-config", help=runtime_config_help)
    source.add_argument(
        "--config", help="WavePipeline spec (YAML/JSON, e.g. /etc/wavepp/spec.json); with --replica"
    )
    parser.add_argument("--replica", type=int, default=None, help="replica index (with --config)")
    add_model_dir_arg(parser)


def add_nats_args(
    parser: argparse.ArgumentParser, *, url_help: str = "NATS server URL (with JetStream)"
) -> None:
    """``--nats-url`` (required), ``--nats-creds``, ``--nats-tls-*`` and the connect wait."""
    parser.add_argument("--nats-url", required=True, help=url_help)
    parser.add_argument("--nats-creds", default=None, help="NATS credentials file (.creds)")
    add_nats_tls_args(parser)
    add_nats_wait_arg(parser)


def add_model_dir_arg(parser: argparse.ArgumentParser) -> None:
    """``--model DIR``: serve the Hugging Face checkpoint in DIR (overrides the config's model)."""
    parser.add_argument(
        "--model",
        default=None,
        metavar="DIR",
        help="Hugging Face checkpoint directory (config.json + safetensors): the model and "
        "RuntimeConfig.model_dir, overriding the configuration's model",
    )


def resolve_rank(value: str | None, env: dict[str, str] | os._Environ[str]) -> int:
    """The stage rank from ``--rank`` or, when absent or unexpanded, ``$WAVEPP_RANK``.

    Args:
        value: the ``--rank`` argument: an integer, ``$(WAVEPP_RANK)`` left unexpanded (a pod
            without that variable), or None.
        env: the process environment.

    Returns:
        The rank (not yet checked against the stage count).

    Raises:
        ArgError: neither gives an integer (names the flag and the value).
    """
    if value is not None and not _UNEXPANDED.match(value.strip()):
        source, raw = "--rank", value
    elif env.get(RANK_ENV):
        source, raw = f"${RANK_ENV}", env[RANK_ENV]
    else:
        raise ArgError(f"--rank {value}: give an integer, or set ${RANK_ENV}")
    try:
        return int(raw.strip())
    except ValueError:
        raise ArgError(f"{source} {raw!r}: must be an integer") from None


def check_port(flag: str, port: int | None) -> None:
    """Raise ArgError naming ``flag`` unless ``port`` is None or in [0, 65535] (0: any free)."""
    if port is not None and not 0 <= port <= 65535:
        raise ArgError(f"{flag} {port}: must be in [0, 65535]")


def add_nats_tls_args(parser: argparse.ArgumentParser) -> None:
    """``--nats-tls-ca/--nats-tls-cert/--nats-tls-key`` (PEM files; see ``NatsTLS``)."""
    parser.add_argument(
        "--nats-tls-ca", default=None, help="CA of the NATS server's certificate: connect over TLS"
    )
    parser.add_argument("--nats-tls-cert", default=None, help="client certificate (mutual TLS)")
    parser.add_argument("--nats-tls-key", default=None, help="client key (mutual TLS)")


def apply_nats_tls(args: argparse.Namespace) -> None:
    """Check the ``--nats-tls-*`` files and export them for ``natsio.connect`` and children.

    Raises:
        ArgError: cert/key without a CA, one of cert/key alone, a missing file, or PEM files
            that do not load (the flag is named).
    """
    from wavepp.runtime.transport.natsio import NatsTLS

    ca, cert, key = args.nats_tls_ca, args.nats_tls_cert, args.nats_tls_key
    if ca is None:
        if cert or key:
            raise ArgError("--nats-tls-cert/--nats-tls-key need --nats-tls-ca")
        return
    tls = NatsTLS(ca=ca, cert=cert, key=key)
    try:
        tls.check()
        tls.ssl_context()
    except ValueError as exc:
        raise ArgError(str(exc)) from exc
    except (OSError, ssl.SSLError) as exc:
        raise ArgError(f"--nats-tls-ca/--nats-tls-cert/--nats-tls-key: cannot load: {exc}") from exc
    os.environ.update(tls.to_env())


def check_creds(path: str | None) -> None:
    """Raise ArgError when ``--nats-creds`` names no readable file."""
    if path is not None and not Path(path).is_file():
        raise ArgError(f"--nats-creds {path}: no such file")


def telemetry_from_spec(
    spec: WavePipelineSpec, env: dict[str, str] | os._Environ[str]
) -> TelemetrySettings:
    """The processes' TelemetrySettings from ``spec.telemetry`` (what the pods' env says too).

    ``otlpEndpoint`` set: OTLP export (HTTP when the endpoint is on port 4318 or ends in
    ``/v1/traces``, else gRPC) at ``samplingRatio``; unset: no tracing. ``metricsPort``: the
    Prometheus port, overridden by ``$WAVEPP_METRICS_PORT`` (the operator sets both alike).

    Raises:
        ArgError: ``$WAVEPP_METRICS_PORT`` is not an integer in [0, 65535].
    """
    from wavepp.telemetry.settings import TelemetrySettings

    endpoint = spec.telemetry.otlp_endpoint or ""
    is_http = ":4318" in endpoint or endpoint.rstrip("/").endswith("/v1/traces")
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
        exporter=("otlp-http" if is_http else "otlp-grpc") if endpoint else "none",
        endpoint=endpoint,
        sampling_ratio=spec.telemetry.sampling_ratio,
        metrics_port=metrics_port,
    )


def runtime_config_from_args(
    args: argparse.Namespace, env: dict[str, str] | os._Environ[str]
) -> RuntimeConfig:
    """The process's RuntimeConfig from ``--runtime-config`` or ``--config/--replica/--pool``,
    with ``--model DIR`` (when given) laid over it (``RuntimeConfig.with_model_dir``).

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


def with_checkpoint(config: RuntimeConfig, model_dir: str) -> RuntimeConfig:
    """``config`` serving the checkpoint in ``model_dir`` (``RuntimeConfig.with_model_dir``);
    without an explicit partition, the layers are split by active parameters per stage
    (``engine.balance.checkpoint_partition``), the same in every process.

    Raises:
        ValueError: a bad directory, config.json or split (names the field).
    """
    from wavepp.runtime.config import RuntimeConfig
    from wavepp.runtime.stage.engine.balance import checkpoint_partition

    if config.partition is not None:
        return config.with_model_dir(model_dir)
    partition = checkpoint_partition(model_dir, config.num_stages)
    # NOTE: validate model and partition together (the old partition fits the old model).
    return RuntimeConfig.model_validate(
        config.with_model_dir_unchecked(model_dir) | {"partition": partition}
    )


def _runtime_config_from_source(
    args: argparse.Namespace, env: dict[str, str] | os._Environ[str]
) -> RuntimeConfig:
    from wavepp.api.spec import SpecError, SpecFileError, load_spec_file
    from wavepp.cmd.common import describe_error
    from wavepp.runtime.config import RuntimeConfig
    from wavepp.runtime.serving.from_spec import runtime_configs_from_spec

    if args.runtime_config:
        try:
            return RuntimeConfig.model_validate_json(Path(args.runtime_config).read_text())
        except (OSError, ValueError) as exc:
            raise ArgError(
                f"--runtime-config {args.runtime_config}: {describe_error(exc)}"
            ) from None
    if args.replica is None:
        raise ArgError(f"--replica: required with --config {args.config}")
    pool = args.pool or env.get(POOL_ENV)
    if not pool:
        raise ArgError(f"--pool: required with --config unless ${POOL_ENV} is set")
    try:
        spec = load_spec_file(args.config).resolved(
            default_image="local", default_nats_url=args.nats_url
        )
        configs = runtime_configs_from_spec(
            spec, pool=pool, namespace=env.get(NAMESPACE_ENV) or "local"
        )
    except SpecFileError as exc:
        raise ArgError(f"--config {exc}") from None
    except (SpecError, ValueError) as exc:
        raise ArgError(f"--config {args.config}: {describe_error(exc)}") from None
    # NOTE: not bounded by spec.replicas: the file is per spec hash, which leaves replicas out,
    # so a replica added by a scale-up reads the file written before it (replicas were fewer).
    from wavepp.api.spec import MAX_REPLICAS
    from wavepp.api.subjects import replica_pipeline_name

    if not 0 <= args.replica < MAX_REPLICAS:
        raise ArgError(f"--replica {args.replica}: must be in [0, {MAX_REPLICAS})")
    try:  # validated: a long pool name plus "-r{i}" may pass the pipeline name's limit
        config = type(configs[0]).model_validate(
            configs[0].model_dump() | {"pipeline": replica_pipeline_name(pool, args.replica)}
        )
    except ValueError as exc:
        raise ArgError(f"--replica {args.replica}: {describe_error(exc)}") from None
    return config.model_copy(update={"telemetry": telemetry_from_spec(spec, env)})


async def start_health_server(
    host: str, port: int, checks: dict[str, Callable[[], bool]]
) -> tuple[web.AppRunner, int]:
    """Serve ``GET path`` -> 200 ``ok`` when ``checks[path]()`` is true, else 503.

    Runs on the caller's event loop; the checks must be cheap and never block.

    Args:
        host: bind address.
        port: TCP port (0: any free port).
        checks: path (e.g. ``/readyz``) -> predicate.

    Returns:
        ``(runner, bound port)``; ``await runner.cleanup()`` stops it.
    """
    from aiohttp import web

    def handler(check: Callable[[], bool]) -> Callable[[web.Request], object]:
        async def answer(_request: web.Request) -> web.Response:
            is_ok = check()
            return web.Response(text="ok" if is_ok else "not ready", status=200 if is_ok else 503)

        return answer

    app = web.Application()
    for path, check in checks.items():
        app.router.add_get(path, handler(check))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    server = site._server  # NOTE: aiohttp exposes the bound port only through the server
    bound = port
    if server is not None and getattr(server, "sockets", None):
        bound = int(server.sockets[0].getsockname()[1])
    return runner, bound


# ---- the command ----------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    from wavepp.runtime.serving.lifecycle import exit_with_parent

    exit_with_parent()
    from wavepp.cmd.common import (
        config_exit_code,
        describe_error,
        startup_failure,
    )
    from wavepp.runtime.stage.build import check_environment
    from wavepp.runtime.stage.process import StageReadiness, TensorParallelLost, run_stage
    from wavepp.runtime.transport.buskey import BusKeyError, load_bus_key

    try:
        config = runtime_config_from_args(args, os.environ)
        config = with_tensor_parallel(config, args.tensor_parallel_size)
        rank = resolve_rank(args.rank, os.environ)
        if args.nats_creds:  # the operator's per-rank file, should the kubelet not expand it
            args.nats_creds = args.nats_creds.replace("$(WAVEPP_RANK)", str(rank))
        check_creds(args.nats_creds)
        apply_nats_tls(args)
        check_port("--health-port", args.health_port)
        check_port("--metrics-port", args.metrics_port)
        # The stage's metrics port is its flag only (the config's is the admission's: under
        # wavepp up both read one file on one host).
        config = config.model_copy(
            update={
                "telemetry": config.telemetry.model_copy(update={"metrics_port": args.metrics_port})
            }
        )
        check_environment(config)
        load_bus_key()  # a bad WAVEPP_BUS_KEY is a one-line error here, not a traceback later
    except (ArgError, ValueError, BusKeyError) as exc:
        print(f"wavepp stage: {describe_error(exc)}", file=sys.stderr)
        return config_exit_code(os.environ)
    if not 0 <= rank < config.num_stages:
        print(f"wavepp stage: --rank {rank}: must be in [0, {config.num_stages})", file=sys.stderr)
        return config_exit_code(os.environ)
    failure = startup_failure(
        args.nats_url,
        args.nats_connect_timeout_s,
        [
            ("--health-port", args.health_host, args.health_port),
            ("--metrics-port", args.metrics_host, args.metrics_port),
        ],
    )
    if failure is not None:  # not a config error: the operator restarts the pod
        print(f"wavepp stage: {failure}", file=sys.stderr)
        return 2

    async def main() -> None:
        readiness = StageReadiness()
        runner = None
        if args.health_port is not None:
            runner, port = await start_health_server(
                args.health_host,
                args.health_port,
                {
                    "/healthz": lambda: readiness.is_alive,
                    "/startupz": lambda: readiness.is_formed,
                    "/readyz": lambda: readiness.is_serving,
                },
            )
            print(f"wavepp stage {rank}: health on port {port}", file=sys.stderr, flush=True)
        try:
            await run_stage(
                config,
                rank,
                args.nats_url,
                args.dist_url,
                nats_creds=args.nats_creds,
                readiness=readiness,
                metrics_host=args.metrics_host,
            )
        finally:
            if runner is not None:
                await runner.cleanup()

    code = 0
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
    except TensorParallelLost as exc:
        print(f"wavepp stage: {exc}", file=sys.stderr)
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # The gloo process group and a compute thread blocked in recv() would hold the interpreter
    # at exit; everything this process owns is already drained.
    os._exit(code)
