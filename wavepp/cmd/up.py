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
killed only after that (``launch.up.drain_times``). Spec fields only the operator applies are
named in one warning line each at start (``launch.up.operator_only_warnings``); metrics servers
bind ``--host`` as the gateway does.

``--config FILE`` is a WavePipeline spec in YAML or JSON (the custom resource's ``spec``, or the
whole resource); without it, tiny-llama on 2 torch stages. ``--model DIR`` serves a Hugging
Face checkpoint directory and ``--stages S`` sets the stage count, with or without ``--config``
(``wavepp.launch.up``: the spec, the host's GPUs, ``spec.telemetry``: a stated ``metricsPort``
P serves replica i's admission metrics on port P + i and each stage's own on the ports after
those (``launch.up.stage_metrics_port``); the gateway's series are on its own ``/metrics``). A
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

This module parses the flags and runs the steps of :func:`run`; what to run is resolved by
``wavepp.launch.up.plan_up`` and the children are supervised by
``runtime.serving.processes.Supervisor``.
"""

from __future__ import annotations

import argparse
import functools
import signal
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from wavepp.cmd.common import fail, finite_float

if TYPE_CHECKING:
    from wavepp.launch.up import UpPlan
    from wavepp.runtime.serving.nats_watchdog import NatsWatchdog
    from wavepp.runtime.serving.processes import Supervisor
    from wavepp.runtime.transport.auth import PoolAuth
    from wavepp.runtime.transport.natsio import EmbeddedNatsServer


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
    parser.add_argument(
        "--host-memory-gib",
        type=float,
        default=None,
        metavar="GIB",
        help="host memory per GPU for each stage's host KV tier (0: none), replacing the "
        "spec's cache.hostMemoryGiB",
    )
    parser.add_argument(
        "--planner-cost-model",
        default="",
        metavar="FILE",
        help="the chunk planner's CostModel JSON, e.g. one fitted for the served checkpoint by "
        "`wavepp calibrate --model DIR --out FILE` (default: the packaged CPU fit)",
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
        help="JetStream's disk limit in bytes (0: the server's default, from free space); also "
        "the NATS account's limit, which the gateway exports (wavepp_gateway_jetstream_store_*)",
    )
    parser.add_argument(
        "--insecure-nats",
        action="store_true",
        help="DEBUGGING ONLY: no NATS credentials; any local process may read every prompt and "
        "publish on every subject",
    )
    parser.add_argument(
        "--decode",
        choices=["vllm"],
        default=None,
        help="start local vLLM decode instances with WavePP's KV connector: /v1/completions "
        "then serves whole completions (prefill here, decode there)",
    )
    parser.add_argument(
        "--decode-url",
        action="append",
        default=[],
        metavar="URL",
        help="a running decode server (OpenAI-compatible vLLM with WavePP's connector as "
        "kv_consumer), e.g. http://10.0.0.5:8100; repeatable",
    )
    parser.add_argument(
        "--decode-python",
        default="",
        metavar="PY",
        help="the Python that runs vLLM for --decode vllm (e.g. a virtual environment's "
        "bin/python; default: this one)",
    )
    parser.add_argument(
        "--decode-replicas", type=int, default=1, help="local decode instances (--decode vllm)"
    )
    parser.add_argument(
        "--decode-args",
        default="",
        help='more vLLM server options for --decode vllm, as shell words (e.g. "--max-num-seqs 8")',
    )
    parser.add_argument(
        "--decode-max-tokens",
        type=int,
        default=4096,
        help="largest max_tokens of a decoded completion (with decode endpoints)",
    )
    parser.add_argument(
        "--max-stage-restarts",
        type=int,
        default=10,
        help="restarts of one stage process before wavepp up gives up (exit 1)",
    )


_fail = functools.partial(fail, "up")


def _is_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


@dataclass
class _Up:
    """One run of ``wavepp up``: its plan, state folder, supervisor, nats-server and children."""

    args: argparse.Namespace
    plan: UpPlan
    state_dir: Path
    store_dir: Path
    sup: Supervisor
    stopping: bool = False
    auth: PoolAuth | None = None
    server: EmbeddedNatsServer | None = None
    watchdog: NatsWatchdog | None = None
    stage_names: list[str] = field(default_factory=list)
    service_names: list[str] = field(default_factory=list)
    decode_names: list[str] = field(default_factory=list)

    @property
    def endpoint(self) -> str:
        return f"http://{self.args.host}:{self.plan.port}"


def run(args: argparse.Namespace) -> int:
    from wavepp.launch.flags import FlagError
    from wavepp.launch.up import plan_up

    try:
        plan = plan_up(args)
    except FlagError as exc:
        return _fail(exc.flag, str(exc))
    up = _prepare(args, plan)
    _catch_stop_signals(up)
    code = _ensure_bus_key() or _start_nats(up)
    if code:
        return code
    try:
        code = _start_children(up) or _supervise(up)
    finally:
        _stop(up)
    return code


def _prepare(args: argparse.Namespace, plan: UpPlan) -> _Up:
    """The state folder (``--state-dir`` or a fresh one), the supervisor writing
    ``processes.json`` there, ``gateway.json``, and the operator-only warnings on stderr."""
    from wavepp.launch.up import operator_only_warnings, up_dirs
    from wavepp.runtime.serving.processes import Supervisor

    state_dir, log_dir, store_dir = up_dirs(args)
    sup = Supervisor(log_dir, state_file=state_dir / "processes.json")
    (state_dir / "gateway.json").write_text(plan.gateway.model_dump_json(indent=2))
    for line in operator_only_warnings(plan.raw):
        print(f"wavepp up: WARNING: {line}", file=sys.stderr, flush=True)
    return _Up(args=args, plan=plan, state_dir=state_dir, store_dir=store_dir, sup=sup)


def _catch_stop_signals(up: _Up) -> None:
    """Ctrl-C and SIGTERM end the supervision loop (then everything is stopped in order)."""

    def on_signal(signum: int, frame: object) -> None:
        up.stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)


def _ensure_bus_key() -> int:
    """The bus key every child signs and checks messages with (inherited through the
    environment; generated here unless the caller set ``WAVEPP_BUS_KEY`` or
    ``WAVEPP_BUS_KEY_FILE``). 0, or the exit code of a bad one."""
    from wavepp.runtime.transport.buskey import BusKeyError, ensure_bus_key

    try:
        ensure_bus_key()
    except BusKeyError as exc:
        return _fail("WAVEPP_BUS_KEY", str(exc))
    return 0


def _start_nats(up: _Up) -> int:
    """Start the nats-server (with fresh credentials unless ``--insecure-nats``) and its
    watchdog, and record the endpoints in ``processes.json``'s info. 0, or an exit code."""
    from wavepp.launch.flags import describe_error
    from wavepp.launch.up import metrics_endpoints, store_limit_config
    from wavepp.runtime.serving.nats_watchdog import NatsWatchdog
    from wavepp.runtime.transport.auth import write_pool_auth
    from wavepp.runtime.transport.natsio import EmbeddedNatsServer, free_port

    args, plan, sup = up.args, up.plan, up.sup
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
            store_dir=str(up.store_dir),
            config_file=store_limit_config(up.state_dir, args.jetstream_max_bytes),
            log_file=str(sup.log_dir / "nats-server.log"),
            monitor_port=free_port(),
        )
    else:
        try:
            up.auth = write_pool_auth(
                up.state_dir / "nats-auth",
                pool=args.pool,
                replicas={c.pipeline: c.num_stages for c in plan.configs},
                namespace=plan.configs[0].namespace,
                store_dir=up.store_dir,
                max_file_store_bytes=args.jetstream_max_bytes or None,
            )
        except ValueError as exc:
            return _fail("--pool", str(exc))
        server = EmbeddedNatsServer(
            config_file=up.auth.server_config,
            log_file=str(sup.log_dir / "nats-server.log"),
            monitor_port=free_port(),
        )
        server.store_dir = str(up.store_dir)
    try:
        server.start()
    except (OSError, RuntimeError, TimeoutError) as exc:
        server.stop()
        return _fail("nats-server", f"did not start: {describe_error(exc)}")
    up.server = server
    up.watchdog = NatsWatchdog(server, up.store_dir)
    first = plan.configs[0]
    sup.info = {
        "endpoint": up.endpoint,
        "nats_url": server.url,
        "nats_pid": server.pid,
        "state_dir": str(up.state_dir),
        "nats_creds": up.auth.creds if up.auth else None,
        "stages": first.num_stages,
        "tensor_parallel_size": first.tensor_parallel_size,
        "drain_timeout_s": plan.drain_s,
        "decode": {d.name: d.url for d in plan.decode},
        "decode_urls": plan.decode_urls,
        **metrics_endpoints(plan.configs, args.host),
    }
    return 0


def _start_children(up: _Up) -> int:
    """Write each replica's config and start the children of ``launch.up.child_commands``, each
    with its own NATS user's credentials (none with ``--insecure-nats``); names are appended
    to ``up.stage_names`` / ``up.service_names`` as each starts (so a failure stops those
    started). 0, or 2 when a child could not be started."""
    from wavepp.launch.flags import describe_error
    from wavepp.launch.up import child_commands
    from wavepp.runtime.transport.natsio import free_port

    assert up.server is not None
    try:
        for server in up.plan.decode:  # first: vLLM takes the longest to start
            up.decode_names.append(server.name)
            up.sup.start(server.name, server.command, env=server.env)
        paths = []
        for config in up.plan.configs:
            path = up.state_dir / f"{config.pipeline}.json"
            path.write_text(config.model_dump_json(indent=2))
            paths.append(str(path))
        commands = child_commands(
            up.plan.configs,
            paths,
            [f"tcp://127.0.0.1:{free_port()}" for _ in up.plan.configs],
            args=up.args,
            nats_url=up.server.url,
            port=up.plan.port,
            drain_s=up.plan.drain_s,
            creds=up.auth.creds if up.auth else None,
            gateway_config=str(up.state_dir / "gateway.json"),
        )
        for name, command in commands:
            (up.stage_names if name.startswith("stage-") else up.service_names).append(name)
            up.sup.start(name, command)
    except OSError as exc:
        print(f"wavepp up: starting a child failed: {describe_error(exc)}", file=sys.stderr)
        up.stopping = True
        return 2
    return 0


def _supervise(up: _Up) -> int:
    """Until Ctrl-C/SIGTERM: every second check the nats-server (:func:`_check_nats`), restart
    the children as the module docstring says (:func:`_check_stages`,
    :func:`_check_services`), and print the serving line once the gateway is ready. The exit
    code: 0 stopped by a signal, 1 a failure while serving, 2 one during start-up (or not
    ready within ``--startup-timeout-s``)."""
    is_serving = False
    deadline = time.monotonic() + up.args.startup_timeout_s
    next_nats_check = time.monotonic()
    while not up.stopping:
        if time.monotonic() >= next_nats_check:
            next_nats_check = time.monotonic() + 1.0
            code = _check_nats(up)
            if code:
                return code
        code = _check_stages(up, is_serving) or _check_services(up, is_serving)
        if code:
            return code
        if not is_serving:
            if _is_ready(f"http://127.0.0.1:{up.plan.port}/readyz") and all(
                _is_ready(f"{url}/health") for url in up.plan.decode_urls
            ):
                is_serving = True
                _print_serving(up)
            elif time.monotonic() > deadline:
                print(
                    f"wavepp up: --startup-timeout-s: not ready in {up.args.startup_timeout_s} s",
                    file=sys.stderr,
                )
                return 2
        time.sleep(0.2)
    return 0


def _check_nats(up: _Up) -> int:
    """Restart the nats-server when its watchdog says so (a failed restart is retried, logged,
    bounded); 1 once it gives up, else 0."""
    from wavepp.runtime.serving.nats_watchdog import NatsRestartFailed

    assert up.watchdog is not None and up.server is not None
    try:
        reason = up.watchdog.check()
    except NatsRestartFailed as exc:
        print(f"wavepp up: {exc}; stopping", file=sys.stderr, flush=True)
        return 1
    if reason is not None:
        print(f"wavepp up: nats-server restarted: {reason}", file=sys.stderr)
        up.sup.info["nats_pid"] = up.server.pid
        up.sup.num_restarts["nats-server"] = up.watchdog.num_restarts
        up.sup.write_state()
    return 0


def _check_stages(up: _Up, is_serving: bool) -> int:
    """A stage that died once serving is restarted with the same arguments (its replica re-forms
    around it), at most ``--max-stage-restarts`` times; otherwise one line and 1 (serving) or
    2 (start-up). 0 while all is well."""
    sup = up.sup
    dead = next((n for n in up.stage_names if sup.exited(n)), None)
    if dead is None:
        return 0
    if is_serving and sup.num_restarts.get(dead, 0) < up.args.max_stage_restarts:
        sup.restart(dead)
        return 0
    print(
        f"wavepp up: {dead} exited with code {sup.procs[dead].returncode}"
        f"{'' if is_serving else ' during start-up'}: {sup.last_error(dead)} "
        f"(log: {sup.log_dir / dead}.log); stopping",
        file=sys.stderr,
        flush=True,
    )
    return 1 if is_serving else 2


def _check_services(up: _Up, is_serving: bool) -> int:
    """An admission, the gateway or a local decode instance that died is restarted once serving
    (the admissions' requests are in JetStream; the gateway passes over a decode instance that
    is down); during start-up one line and 2. 0 while all is well."""
    sup = up.sup
    for name in up.service_names + up.decode_names:
        if not sup.exited(name):
            continue
        if not is_serving:
            print(
                f"wavepp up: {name} exited during start-up: {sup.last_error(name)} "
                f"(log: {sup.log_dir / name}.log); stopping",
                file=sys.stderr,
                flush=True,
            )
            up.stopping = True
            return 2
        sup.restart(name)
    return 0


def _print_serving(up: _Up) -> None:
    from wavepp.launch.up import serving_line

    assert up.server is not None
    print(f"wavepp up: {up.plan.auth_line}", flush=True)
    print(
        serving_line(
            up.endpoint, up.args.pool, up.plan.configs, up.plan.tokenizer, up.server.url,
            up.auth is not None, up.sup.log_dir, up.plan.decode_urls,
        ),
        flush=True,
    )  # fmt: skip


def _stop(up: _Up) -> None:
    """Stop the gateway, then the local decode instances (their whole process groups: vLLM's
    engine runs in a child of its server), then the admissions (each drains for up to its
    grace; its stages stay up until it has left), then the stages, then the nats-server."""
    up.sup.stop(["gateway"])
    up.sup.stop(up.decode_names, group=True)
    up.sup.stop([n for n in up.service_names if n != "gateway"], up.plan.admission_grace_s)
    up.sup.stop(up.stage_names)
    if up.server is not None:
        up.server.stop()
    print("wavepp up: stopped", file=sys.stderr, flush=True)
