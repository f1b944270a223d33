"""The argument lists of the runtime's processes (``wavepp stage|admission|gateway``): one
builder each, shared by the operator's pods (``operator.containers.container_args``) and the
local supervisor's children (``runtime.serving.processes``), so a flag is spelt in one place.

Each builder returns the arguments after the program (``wavepp`` in a pod, ``python -m
wavepp.cli`` locally), subcommand first. A flag whose value is None is left out. The
configuration comes from exactly one source: ``config`` (a spec file, ``--config``) or the
resolved JSON (``runtime_config`` / ``gateway_config``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NatsArgs:
    """How a process reaches NATS: the URL, a credentials file, and the TLS files (the CA;
    a client certificate and key for mutual TLS), each a path as the process sees it."""

    url: str
    creds: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    def args(self) -> list[str]:
        return [
            "--nats-url", self.url, *_opt("--nats-creds", self.creds),
            *_opt("--nats-tls-ca", self.tls_ca), *_opt("--nats-tls-cert", self.tls_cert),
            *_opt("--nats-tls-key", self.tls_key),
        ]  # fmt: skip


def stage_args(
    nats: NatsArgs,
    *,
    rank: int | str,
    dist_url: str,
    config: str | None = None,
    runtime_config: str | None = None,
    replica: int | None = None,
    health_port: int | None = None,
    metrics_port: int | None = None,
    metrics_host: str | None = None,
    cores: tuple[int, ...] | None = None,
) -> list[str]:
    """``wavepp stage`` of stage ``rank`` (a number, or ``$(WAVEPP_RANK)`` for Kubernetes to
    expand), joining the torch.distributed group at ``dist_url``; ``cores``: the CPU ids it
    restricts itself to (``runtime.stage.placement``; None: all it may use).

    Raises:
        ValueError: not exactly one of ``config`` and ``runtime_config``.
    """
    return [
        "stage", *_config(config, "--runtime-config", runtime_config), *nats.args(),
        *_opt("--replica", replica), "--rank", str(rank), "--dist-url", dist_url,
        *_opt("--health-port", health_port), *_opt("--metrics-port", metrics_port),
        *_opt("--metrics-host", metrics_host),
        *_opt("--cores", None if cores is None else ",".join(map(str, cores))),
    ]  # fmt: skip


def admission_args(
    nats: NatsArgs,
    *,
    drain_s: float,
    config: str | None = None,
    runtime_config: str | None = None,
    replica: int | None = None,
    pool: str | None = None,
    ack_wait_s: float | None = None,
    health_port: int | None = None,
    metrics_host: str | None = None,
    planner_cost_model: str | None = None,
) -> list[str]:
    """``wavepp admission``, draining for ``drain_s`` seconds on SIGTERM; ``ack_wait_s``: the
    intake's redelivery time, seconds; ``planner_cost_model``: a CostModel JSON file the planner
    budgets with (None: the admission's default).

    Raises:
        ValueError: not exactly one of ``config`` and ``runtime_config``.
    """
    return [
        "admission", *_config(config, "--runtime-config", runtime_config), *nats.args(),
        *_opt("--replica", replica), *_opt("--pool", pool), *_opt("--ack-wait-s", ack_wait_s),
        *_opt("--health-port", health_port), "--drain-timeout-s", f"{drain_s:g}",
        *_opt("--metrics-host", metrics_host), *_opt("--planner-cost-model", planner_cost_model),
    ]  # fmt: skip


def gateway_args(
    nats: NatsArgs,
    *,
    port: int,
    config: str | None = None,
    gateway_config: str | None = None,
    pool_file: str | None = None,
    host: str | None = None,
) -> list[str]:
    """``wavepp gateway`` serving HTTP on ``port`` (bound to ``host`` when given).

    Raises:
        ValueError: not exactly one of ``config`` and ``gateway_config``.
    """
    return [
        "gateway", *_config(config, "--gateway-config", gateway_config), *nats.args(),
        *_opt("--pool-file", pool_file), *_opt("--host", host), "--port", str(port),
    ]  # fmt: skip


def _opt(flag: str, value: object) -> list[str]:
    return [] if value is None else [flag, str(value)]


def _config(config: str | None, resolved_flag: str, resolved: str | None) -> list[str]:
    if (config is None) == (resolved is None):
        raise ValueError(
            f"give exactly one of config (--config) and {resolved_flag.lstrip('-')} "
            f"({resolved_flag}); got {config!r} and {resolved!r}"
        )
    return ["--config", config] if config is not None else [resolved_flag, str(resolved)]
