"""``wavepp up``: the whole service on this machine, as processes.

Starts an embedded nats-server with JetStream, then for each replica of the spec S ``wavepp
stage`` processes and one ``wavepp admission``, then one ``wavepp gateway``; waits until the
gateway's ``/readyz`` answers 200, prints ``wavepp up: serving http://HOST:PORT ...`` and
supervises: a gateway or admission process that dies is restarted (its requests are in
JetStream); a stage that dies once serving is restarted with the same arguments, as a kubelet
would, and its replica re-forms its group in place (``stage.rendezvous``) while the other
replicas serve (the gateway routes around it); a stage that dies during startup, or more than
``--max-stage-restarts`` times, stops everything (exit 1). Ctrl-C or SIGTERM stops all children
(gateway, admissions, stages: SIGTERM, wait, kill) and the nats-server, and exits 0; an
admission drains for ``spec.rollout.drainTimeoutSeconds`` less the operator's margin and is
killed only after that (``up_spec.drain_times``). Spec fields only the operator applies are
named in one warning line each at start (``up_spec.operator_only_warnings``); metrics servers
bind ``--host`` as the gateway does.

``--config FILE`` is a WavePipeline spec in YAML or JSON (the custom resource's ``spec``, or the
whole resource); without it, tiny-llama on 2 torch stages. ``--model DIR`` serves a Hugging
Face checkpoint directory and ``--stages S`` sets the stage count, with or without ``--config``
(``cmd.up_spec``: the spec, the host's GPUs, ``spec.telemetry``: a stated ``metricsPort`` P
serves replica i's admission metrics on port P + i and each stage's own on the ports after
those (``up_spec.stage_metrics_port``); the gateway's series are on its own ``/metrics``). A
checkpoint's ``tokenizer.json`` is the gateway's tokenizer unless
``--tokenizer`` names another. ``STATE_DIR/processes.json`` lists
the endpoints,
the child pids and each component's NATS credentials file (for tests and operators),
``STATE_DIR/logs/`` (or ``--log-dir``) their output and the nats-server's.

The bus is authenticated by default: at every start, fresh keys in ``STATE_DIR/nats-auth/``
(mode 0700): a nats-server config that trusts only them, and one ``.creds`` per component with
only its own subjects (``wavepp.api.permissions``); anonymous clients are refused.
``--insecure-nats`` turns that off for debugging, with a warning at start and in the serving
line. The nats-server is watched (``runtime.serving.nats_watchdog``): restarted when it exits
or disabled JetStream (a full disk) and space came back; failed restarts are retried with a
backoff; after 60 s of them up stops (one line, exit 1). ``--jetstream-dir``/``-max-bytes``: store.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

from wavepp.cmd.common import add_deprecated_alias, finite_float
from wavepp.cmd.up_spec import child_commands, metrics_endpoints, serving_line
from wavepp.runtime.serving.lifecycle import child_env

if TYPE_CHECKING:
    from wavepp.runtime.transport.auth import PoolAuth

MAX_LOCAL_PROCESSES = 256
"""Processes ``wavepp up`` starts at most: replicas x (stages + 1) + gateway + nats-server."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="", help="WavePipeline spec (YAML or JSON)")
    parser.add_argument(
        "--model",
        default="",
        metavar="DIR",
        help="serve this Hugging Face checkpoint directory (config.json + safetensors; its "
        "tokenizer.json for text prompts), replacing the spec's model",
    )
    parser.add_argument(
        "--stages", type=int, default=None, help="pipeline stages S, replacing the spec's"
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=None,
        metavar="T",
        help="processes computing each stage, one per device (spec.tensorParallelSize), "
        "replacing the spec's",
    )
    parser.add_argument("--pool", default="default", help="pool name (NATS subjects, results)")
    parser.add_argument("--host", default="127.0.0.1", help="gateway bind address")
    parser.add_argument("--port", type=int, default=8000, help="gateway port (0: a free one)")
    parser.add_argument(
        "--state-dir",
        default="",
        help="logs, configs, JetStream store (default: a fresh wavepp-up-* temporary folder)",
    )
    parser.add_argument(
        "--tokenizer",
        default="",
        help="local tokenizer path (for text prompts; without it, the checkpoint's tokenizer.json)",
    )
    parser.add_argument(
        "--routing",
        choices=["prefix", "round_robin", "least_loaded"],
        default="prefix",
        help="which replica a request goes to",
    )
    parser.add_argument(
        "--max-outstanding", type=int, default=8, help="requests per replica past the gateway"
    )
    parser.add_argument(
        "--max-queued",
        type=int,
        default=1024,
        help="requests queued or running in the gateway, all tenants; past it: 429",
    )
    parser.add_argument(
        "--tenant-max-concurrency", type=int, default=None, help="per tenant, queued or running"
    )
    parser.add_argument(
        "--tenant-tokens-per-s",
        type=finite_float,
        default=None,
        help="per tenant prompt-token rate",
    )
    parser.add_argument(
        "--tenant-limits",
        default="",
        help='JSON per tenant, e.g. {"acme": {"max_concurrency": 4, "tokens_per_s": 5000, '
        '"burst_tokens": 20000}}; overrides the two flags above',
    )
    parser.add_argument(
        "--ack-wait-s", type=finite_float, default=10.0, help="intake redelivery delay"
    )
    parser.add_argument(
        "--request-timeout-s",
        type=finite_float,
        default=120.0,
        help="a request unanswered this long: 504",
    )
    parser.add_argument(
        "--replica-timeout-s",
        type=finite_float,
        default=3.0,
        help="a replica without a heartbeat this long leaves the pool",
    )
    parser.add_argument(
        "--startup-timeout-s",
        type=finite_float,
        default=300.0,
        help="not serving this long after start: stop everything, exit 2",
    )
    add_deprecated_alias(parser, "--name", "--pool", "pool")
    parser.add_argument(
        "--log-dir",
        default="",
        help="the children's and nats-server's logs (default STATE_DIR/logs)",
    )
    parser.add_argument(
        "--jetstream-dir", default="", help="JetStream's store (default STATE_DIR/jetstream)"
    )
    parser.add_argument(
        "--jetstream-max-bytes",
        type=int,
        default=0,
        help="JetStream's disk limit in bytes (0: the server's default, from free space)",
    )
    parser.add_argument(
        "--insecure-nats",
        action="store_true",
        help="DEBUGGING ONLY: no NATS credentials; any local process may read every prompt and "
        "publish on every subject",
    )
    parser.add_argument(
        "--max-stage-restarts",
        type=int,
        default=10,
        help="restarts of one stage process before wavepp up gives up (exit 1)",
    )


def _fail(flag: str, message: str) -> int:
    print(f"wavepp up: {flag}: {message}", file=sys.stderr)
    return 2


class Supervisor:
    """Owns the child processes of ``wavepp up``."""

    def __init__(self, state_dir: Path, log_dir: Path | None = None) -> None:
        self.state_dir = state_dir
        self.log_dir = log_dir or state_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.commands: dict[str, list[str]] = {}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.num_restarts: dict[str, int] = {}
        self.info: dict[str, object] = {}

    def start(self, name: str, command: list[str]) -> None:
        self.commands[name] = command
        out = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        self.procs[name] = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=child_env(),
        )
        self.write_state()

    def restart(self, name: str) -> None:
        self.num_restarts[name] = self.num_restarts.get(name, 0) + 1
        print(f"wavepp up: {name} exited; restarting", file=sys.stderr, flush=True)
        self.start(name, self.commands[name])

    def write_state(self) -> None:
        state = {
            **self.info,
            "pids": {name: proc.pid for name, proc in self.procs.items()},
            "restarts": self.num_restarts,
        }
        path = self.state_dir / "processes.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(path)

    def log_tail(self, name: str, num_lines: int = 20) -> str:
        path = self.log_dir / f"{name}.log"
        lines = path.read_text(errors="replace").splitlines() if path.exists() else []
        return "\n".join(lines[-num_lines:])

    def last_error(self, name: str) -> str:
        """The child's last log line that looks like an error (else its last line), one line."""
        lines = [ln.strip() for ln in self.log_tail(name, 60).splitlines() if ln.strip()]
        for line in reversed(lines):
            if "Error" in line or "error" in line or line.startswith("wavepp"):
                return line
        return lines[-1] if lines else "no output"

    def stop(self, names: list[str], grace_s: float = 10.0) -> None:
        """SIGTERM the ``names`` still running, wait up to ``grace_s`` seconds for all of them
        (together), then SIGKILL those left."""
        for name in names:
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + grace_s
        for name in names:
            proc = self.procs.get(name)
            if proc is None:
                continue
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def _store_limit_config(state_dir: Path, max_bytes: int) -> str | None:
    """A nats-server config that only caps JetStream's disk use (for ``--insecure-nats``)."""
    if not max_bytes:
        return None
    path = state_dir / "nats-store-limit.conf"
    path.write_text(f"jetstream: {{ max_file_store: {max_bytes} }}\n")
    return str(path)


def _is_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _start_children(
    sup: Supervisor,
    args: argparse.Namespace,
    configs: list,
    state_dir: Path,
    nats_url: str,
    port: int,
    drain_s: float,
    stage_names: list[str],
    service_names: list[str],
    auth: PoolAuth | None,
) -> None:
    """Write each replica's config and start the children of ``up_spec.child_commands``, each
    with its own NATS user's credentials (none with ``--insecure-nats``); names are appended
    to ``stage_names`` / ``service_names`` as each starts (so a failure stops those started)."""
    from wavepp.runtime.transport.natsio import free_port

    paths = []
    for config in configs:
        path = state_dir / f"{config.pipeline}.json"
        path.write_text(config.model_dump_json(indent=2))
        paths.append(str(path))
    commands = child_commands(
        configs,
        paths,
        [f"tcp://127.0.0.1:{free_port()}" for _ in configs],
        args=args,
        nats_url=nats_url,
        port=port,
        drain_s=drain_s,
        creds=auth.creds if auth else None,
        gateway_config=str(state_dir / "gateway.json"),
    )
    for name, command in commands:
        (stage_names if name.startswith("stage-") else service_names).append(name)
        sup.start(name, command)


def run(args: argparse.Namespace) -> int:
    from wavepp.api.spec import SpecError, TenantSpec, check_spec
    from wavepp.cmd.common import check_port_free, describe_error, key_files_problem
    from wavepp.cmd.gateway import gateway_model_fields, replica_info
    from wavepp.cmd.up_spec import (
        UpSpecError,
        drain_times,
        local_resources,
        operator_only_warnings,
        spec_mapping,
        with_telemetry,
    )
    from wavepp.gateway.config import GatewayConfig
    from wavepp.gateway.tenants import TenantPolicy, policy_from_spec
    from wavepp.runtime.serving.from_spec import checkpoint_tokenizer, runtime_configs_from_spec
    from wavepp.runtime.serving.nats_watchdog import NatsRestartFailed, NatsWatchdog
    from wavepp.runtime.transport.auth import write_pool_auth
    from wavepp.runtime.transport.natsio import EmbeddedNatsServer, free_port

    try:
        raw = spec_mapping(args)
    except UpSpecError as exc:
        return _fail(exc.flag, str(exc))
    flags = [
        f
        for f, v in (
            ("--model", args.model),
            ("--stages", args.stages),
            ("--tensor-parallel-size", args.tensor_parallel_size),
        )
        if v
    ]
    source = args.config or (f"the spec of {' '.join(flags)}" if flags else "the default spec")
    flag = "--config" if args.config or not flags else "/".join(flags)
    spec, issues = check_spec(
        local_resources(raw), default_image="local", default_nats_url="nats://embedded"
    )
    if spec is None:
        return _fail(flag, f"{source}: " + "; ".join(str(i) for i in issues))
    try:
        configs = runtime_configs_from_spec(spec, pool=args.pool)
        configs = with_telemetry(configs, spec, raw, gateway_port=args.port)
    except SpecError as exc:
        return _fail(flag, str(exc))
    except ValueError as exc:
        return _fail("--config", str(exc))
    tokenizer = args.tokenizer or checkpoint_tokenizer(spec)
    drain_s, admission_grace_s = drain_times(spec)
    num_processes = sum(c.num_stages + 1 for c in configs) + 2
    if num_processes > MAX_LOCAL_PROCESSES:
        return _fail(
            "--config",
            f"{args.config}: spec.replicas x (spec.stages + 1) + 2 = {num_processes} local "
            f"processes; wavepp up runs at most {MAX_LOCAL_PROCESSES} (use the operator)",
        )
    if args.max_outstanding < 1:
        return _fail("--max-outstanding", f"{args.max_outstanding}: must be >= 1")
    if args.max_queued < 1:
        return _fail("--max-queued", f"{args.max_queued}: must be >= 1")
    if args.tokenizer and not Path(args.tokenizer).exists():
        return _fail("--tokenizer", f"{args.tokenizer}: no such file or folder")
    if not 0 <= args.port <= 65535:
        return _fail("--port", f"{args.port}: must be in [0, 65535]")
    busy = check_port_free(args.host, args.port)
    if busy is not None:
        return _fail("--port", f"{busy}; choose another port (0: a free one)")
    if args.max_stage_restarts < 0:
        return _fail("--max-stage-restarts", f"{args.max_stage_restarts}: must be >= 0")
    port = args.port or free_port()
    try:
        overrides = json.loads(args.tenant_limits) if args.tenant_limits else {}
        if not isinstance(overrides, dict):
            raise ValueError("must be a JSON object: tenant -> limits")
    except ValueError as exc:
        return _fail("--tenant-limits", str(exc))
    tenant_specs = spec.tenants or [TenantSpec(name="default")]
    names = [t.name for t in tenant_specs]
    unknown = sorted(set(overrides) - set(names))
    if unknown:
        return _fail("--tenant-limits", f"unknown tenants {unknown}; the spec has {names}")
    spec_dir = Path(args.config).resolve().parent if args.config else Path.cwd()
    tenants = []
    for t in tenant_specs:
        if t.api_key_secret:
            return _fail(
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
            return _fail("--tenant-limits", str(exc))
    key_files = {t.name: t.api_keys_file for t in tenants if t.api_keys_file}
    problem = key_files_problem(key_files)
    if problem:
        return _fail("--config", problem)
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
    gateway_config = GatewayConfig(
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
    )
    if args.jetstream_max_bytes < 0:
        return _fail("--jetstream-max-bytes", f"{args.jetstream_max_bytes}: must be >= 0")
    state_dir = Path(args.state_dir or tempfile.mkdtemp(prefix="wavepp-up-")).resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    sup = Supervisor(state_dir, Path(args.log_dir).resolve() if args.log_dir else None)
    store_dir = (
        Path(args.jetstream_dir).resolve() if args.jetstream_dir else state_dir / "jetstream"
    )
    (state_dir / "gateway.json").write_text(gateway_config.model_dump_json(indent=2))
    for line in operator_only_warnings(raw):
        print(f"wavepp up: WARNING: {line}", file=sys.stderr, flush=True)
    stopping = {"flag": False}

    def on_signal(signum: int, frame: object) -> None:
        stopping["flag"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    # The bus key every child signs and checks messages with (inherited through the
    # environment; generated here unless the caller set WAVEPP_BUS_KEY or WAVEPP_BUS_KEY_FILE).
    from wavepp.runtime.transport.buskey import BusKeyError, ensure_bus_key

    try:
        ensure_bus_key()
    except BusKeyError as exc:
        return _fail("WAVEPP_BUS_KEY", str(exc))
    auth = None
    if args.insecure_nats:
        print(
            "wavepp up: WARNING: --insecure-nats: the NATS server takes anonymous clients; any "
            "local process can read every tenant's prompts and publish on every subject. "
            "For debugging only.",
            file=sys.stderr,
            flush=True,
        )
        server = EmbeddedNatsServer(
            jetstream=True,
            store_dir=str(store_dir),
            config_file=_store_limit_config(state_dir, args.jetstream_max_bytes),
            log_file=str(sup.log_dir / "nats-server.log"),
            monitor_port=free_port(),
        )
    else:
        try:
            auth = write_pool_auth(
                state_dir / "nats-auth",
                pool=args.pool,
                replicas={c.pipeline: c.num_stages for c in configs},
                namespace=configs[0].namespace,
                store_dir=store_dir,
                max_file_store_bytes=args.jetstream_max_bytes or None,
            )
        except ValueError as exc:
            return _fail("--pool", str(exc))
        server = EmbeddedNatsServer(
            config_file=auth.server_config,
            log_file=str(sup.log_dir / "nats-server.log"),
            monitor_port=free_port(),
        )
        server.store_dir = str(store_dir)
    try:
        server.start()
    except (OSError, RuntimeError, TimeoutError) as exc:
        server.stop()
        return _fail("nats-server", f"did not start: {describe_error(exc)}")
    watchdog = NatsWatchdog(server, store_dir)
    endpoint = f"http://{args.host}:{port}"
    sup.info = {
        "endpoint": endpoint,
        "nats_url": server.url,
        "nats_pid": server.pid,
        "state_dir": str(state_dir),
        "nats_creds": auth.creds if auth else None,
        "stages": first.num_stages,
        "tensor_parallel_size": first.tensor_parallel_size,
        "drain_timeout_s": drain_s,
        **metrics_endpoints(configs, args.host),
    }
    stage_names: list[str] = []
    service_names: list[str] = []
    code = 0
    try:
        _start_children(
            sup, args, configs, state_dir, server.url, port, drain_s, stage_names,
            service_names, auth,
        )  # fmt: skip
    except OSError as exc:
        print(f"wavepp up: starting a child failed: {describe_error(exc)}", file=sys.stderr)
        stopping["flag"], code = True, 2
    is_serving = False
    deadline = time.monotonic() + args.startup_timeout_s
    next_nats_check = time.monotonic()
    try:
        while not stopping["flag"]:
            if time.monotonic() >= next_nats_check:
                next_nats_check = time.monotonic() + 1.0
                try:
                    reason = watchdog.check()  # a failed restart: retried, logged, bounded
                except NatsRestartFailed as exc:
                    print(f"wavepp up: {exc}; stopping", file=sys.stderr, flush=True)
                    code = 1
                    break
                if reason is not None:
                    print(f"wavepp up: nats-server restarted: {reason}", file=sys.stderr)
                    sup.info["nats_pid"] = server.pid
                    sup.num_restarts["nats-server"] = watchdog.num_restarts
                    sup.write_state()
            dead_stage = next((n for n in stage_names if sup.procs[n].poll() is not None), None)
            if (
                dead_stage is not None
                and is_serving
                and sup.num_restarts.get(dead_stage, 0) < args.max_stage_restarts
            ):
                sup.restart(dead_stage)  # same args: the replica re-forms around it
                dead_stage = None
            if dead_stage is not None:
                print(
                    f"wavepp up: {dead_stage} exited with code {sup.procs[dead_stage].returncode}"
                    f"{'' if is_serving else ' during start-up'}: {sup.last_error(dead_stage)} "
                    f"(log: {sup.log_dir / dead_stage}.log); stopping",
                    file=sys.stderr,
                    flush=True,
                )
                code = 1 if is_serving else 2
                break
            for name in service_names:
                if sup.procs[name].poll() is not None:
                    if not is_serving:
                        print(
                            f"wavepp up: {name} exited during start-up: {sup.last_error(name)} "
                            f"(log: {sup.log_dir / name}.log); stopping",
                            file=sys.stderr,
                            flush=True,
                        )
                        stopping["flag"], code = True, 2
                        break
                    sup.restart(name)
            if not is_serving and not stopping["flag"]:
                if _is_ready(f"http://127.0.0.1:{port}/readyz"):
                    is_serving = True
                    print(f"wavepp up: {auth_line}", flush=True)
                    print(
                        serving_line(
                            endpoint, args.pool, configs, tokenizer, server.url,
                            auth is not None, sup.log_dir,
                        ),
                        flush=True,
                    )  # fmt: skip
                elif time.monotonic() > deadline:
                    print(
                        f"wavepp up: --startup-timeout-s: not ready in {args.startup_timeout_s} s",
                        file=sys.stderr,
                    )
                    code = 2
                    break
            time.sleep(0.2)
    finally:
        sup.stop(["gateway"])
        # an admission drains (serves what its intake holds) for up to drain_s: not killed
        # before, and its stages stay up until it has left
        sup.stop([n for n in service_names if n != "gateway"], admission_grace_s)
        sup.stop(stage_names)
        server.stop()
        print("wavepp up: stopped", file=sys.stderr, flush=True)
    return code
