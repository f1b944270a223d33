"""One run of ``wavepp up`` (:func:`run_up`): the nats-server, the children of
``launch.up.child_commands`` under the one local supervisor (``runtime.serving.processes``),
their supervision until Ctrl-C/SIGTERM, and the stop in order.

Supervision: a gateway, admission or local decode process that dies once serving is restarted
(the admissions' requests are in JetStream); a stage that dies once serving is restarted with
the same arguments, at most ``--max-stage-restarts`` times (its replica re-forms in place); a
child that dies during start-up, a stage past its restarts, or a nats-server the watchdog gave
up on stops everything. Every line printed starts ``wavepp up:``. Exit codes: 0 stopped by a
signal, 1 a failure while serving, 2 one during start-up (a bad flag, a child that could not
start, not ready within ``--startup-timeout-s``).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from wavepp.launch.flags import describe_error
from wavepp.launch.up import (
    UpPlan,
    child_commands,
    metrics_endpoints,
    operator_only_warnings,
    plan_up,
    serving_line,
    store_limit_config,
    up_dirs,
)
from wavepp.runtime.serving.nats_watchdog import NatsRestartFailed, NatsWatchdog
from wavepp.runtime.serving.processes import Supervisor, pool_nats_server
from wavepp.runtime.transport.auth import PoolAuth
from wavepp.runtime.transport.buskey import BusKeyError, ensure_bus_key
from wavepp.runtime.transport.natsio import EmbeddedNatsServer, free_port


def _fail(flag: str, message: str) -> int:
    """``wavepp up: FLAG: MESSAGE`` on stderr; 2 (a usage error)."""
    print(f"wavepp up: {flag}: {message}", file=sys.stderr)
    return 2


def _is_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def run_up(args: argparse.Namespace) -> int:
    """Plan (``launch.up.plan_up``), start, supervise and stop ``wavepp up``; the exit code
    (module docstring). Ctrl-C and SIGTERM end the supervision (then everything stops)."""
    plan = plan_up(args)
    up = UpRun.prepare(args, plan)
    up.catch_stop_signals()
    code = _ensure_bus_key() or up.start_nats()
    if code:
        return code
    try:
        code = up.start_children() or up.supervise()
    finally:
        up.stop()
    return code


def _ensure_bus_key() -> int:
    """The bus key every child signs and checks messages with (inherited through the
    environment; generated here unless the caller set ``WAVEPP_BUS_KEY`` or
    ``WAVEPP_BUS_KEY_FILE``). 0, or the exit code of a bad one."""
    try:
        ensure_bus_key()
    except BusKeyError as exc:
        return _fail("WAVEPP_BUS_KEY", str(exc))
    return 0


@dataclass
class UpRun:
    """One run of ``wavepp up``: its plan, state folder, supervisor, nats-server and children
    (their supervisor names by kind, in start order)."""

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

    @classmethod
    def prepare(cls, args: argparse.Namespace, plan: UpPlan) -> UpRun:
        """The state folder (``--state-dir`` or a fresh one), the supervisor writing
        ``processes.json`` there, ``gateway.json``, and the operator-only warnings on stderr."""
        state_dir, log_dir, store_dir = up_dirs(args)
        sup = Supervisor(log_dir, state_file=state_dir / "processes.json")
        (state_dir / "gateway.json").write_text(plan.gateway.model_dump_json(indent=2))
        for line in operator_only_warnings(plan.raw):
            print(f"wavepp up: WARNING: {line}", file=sys.stderr, flush=True)
        return cls(args=args, plan=plan, state_dir=state_dir, store_dir=store_dir, sup=sup)

    def catch_stop_signals(self) -> None:
        """Ctrl-C and SIGTERM end the supervision loop (then everything is stopped in order)."""

        def on_signal(signum: int, frame: object) -> None:
            self.stopping = True

        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)

    def start_nats(self) -> int:
        """Start the nats-server (with fresh credentials unless ``--insecure-nats``) and its
        watchdog, and record the endpoints in ``processes.json``'s info. 0, or an exit code."""
        args, plan, sup = self.args, self.plan, self.sup
        if args.insecure_nats:
            print(
                "wavepp up: WARNING: --insecure-nats: the NATS server takes anonymous clients; "
                "any local process can read every tenant's prompts and publish on every "
                "subject. For debugging only.",
                file=sys.stderr,
                flush=True,
            )
            server = EmbeddedNatsServer(
                jetstream=True,
                store_dir=str(self.store_dir),
                config_file=store_limit_config(self.state_dir, args.jetstream_max_bytes),
                log_file=str(sup.log_dir / "nats-server.log"),
                monitor_port=free_port(),
            )
        else:
            try:
                self.auth, server = pool_nats_server(
                    self.state_dir / "nats-auth",
                    sup.log_dir,
                    pool=args.pool,
                    replicas={c.pipeline: c.num_stages for c in plan.configs},
                    namespace=plan.configs[0].namespace,
                    store_dir=self.store_dir,
                    max_file_store_bytes=args.jetstream_max_bytes or None,
                    monitor_port=free_port(),
                )
            except ValueError as exc:
                return _fail("--pool", str(exc))
        try:
            server.start()
        except (OSError, RuntimeError, TimeoutError) as exc:
            server.stop()
            return _fail("nats-server", f"did not start: {describe_error(exc)}")
        self.server = server
        self.watchdog = NatsWatchdog(server, self.store_dir)
        first = plan.configs[0]
        sup.info = {
            "endpoint": self.endpoint,
            "nats_url": server.url,
            "nats_pid": server.pid,
            "state_dir": str(self.state_dir),
            "nats_creds": self.auth.creds if self.auth else None,
            "stages": first.num_stages,
            "tensor_parallel_size": first.tensor_parallel_size,
            "drain_timeout_s": plan.drain_s,
            "decode": {d.name: d.url for d in plan.decode},
            "decode_urls": plan.decode_urls,
            **metrics_endpoints(plan.configs, args.host),
        }
        return 0

    def start_children(self) -> int:
        """Write each replica's config and start the children of ``launch.up.child_commands``,
        each with its own NATS user's credentials (none with ``--insecure-nats``); names are
        appended to ``stage_names`` / ``service_names`` as each starts (so a failure stops
        those started). 0, or 2 when a child could not be started."""
        assert self.server is not None
        try:
            for server in self.plan.decode:  # first: vLLM takes the longest to start
                self.decode_names.append(server.name)
                self.sup.start(server.name, server.command, env=server.env)
            paths = []
            for config in self.plan.configs:
                path = self.state_dir / f"{config.pipeline}.json"
                path.write_text(config.model_dump_json(indent=2))
                paths.append(str(path))
            commands = child_commands(
                self.plan.configs,
                paths,
                [f"tcp://127.0.0.1:{free_port()}" for _ in self.plan.configs],
                args=self.args,
                nats_url=self.server.url,
                port=self.plan.port,
                drain_s=self.plan.drain_s,
                creds=self.auth.creds if self.auth else None,
                gateway_config=str(self.state_dir / "gateway.json"),
            )
            for name, command in commands:
                names = self.stage_names if name.startswith("stage-") else self.service_names
                names.append(name)
                self.sup.start(name, command)
        except OSError as exc:
            print(f"wavepp up: starting a child failed: {describe_error(exc)}", file=sys.stderr)
            self.stopping = True
            return 2
        return 0

    def supervise(self) -> int:
        """Until Ctrl-C/SIGTERM: every second check the nats-server (:meth:`check_nats`),
        restart the children as the module docstring says (:meth:`check_stages`,
        :meth:`check_services`), and print the serving line once the gateway is ready. The
        exit code: 0 stopped by a signal, 1 a failure while serving, 2 one during start-up (or
        not ready within ``--startup-timeout-s``)."""
        is_serving = False
        deadline = time.monotonic() + self.args.startup_timeout_s
        next_nats_check = time.monotonic()
        while not self.stopping:
            if time.monotonic() >= next_nats_check:
                next_nats_check = time.monotonic() + 1.0
                code = self.check_nats()
                if code:
                    return code
            code = self.check_stages(is_serving) or self.check_services(is_serving)
            if code:
                return code
            if not is_serving:
                if _is_ready(f"http://127.0.0.1:{self.plan.port}/readyz") and all(
                    _is_ready(f"{url}/health") for url in self.plan.decode_urls
                ):
                    is_serving = True
                    self.print_serving()
                elif time.monotonic() > deadline:
                    print(
                        f"wavepp up: --startup-timeout-s: not ready in "
                        f"{self.args.startup_timeout_s} s",
                        file=sys.stderr,
                    )
                    return 2
            time.sleep(0.2)
        return 0

    def check_nats(self) -> int:
        """Restart the nats-server when its watchdog says so (a failed restart is retried,
        logged, bounded); 1 once it gives up, else 0."""
        assert self.watchdog is not None and self.server is not None
        try:
            reason = self.watchdog.check()
        except NatsRestartFailed as exc:
            print(f"wavepp up: {exc}; stopping", file=sys.stderr, flush=True)
            return 1
        if reason is not None:
            print(f"wavepp up: nats-server restarted: {reason}", file=sys.stderr)
            self.sup.info["nats_pid"] = self.server.pid
            self.sup.num_restarts["nats-server"] = self.watchdog.num_restarts
            self.sup.write_state()
        return 0

    def check_stages(self, is_serving: bool) -> int:
        """A stage that died once serving is restarted with the same arguments (its replica
        re-forms around it), at most ``--max-stage-restarts`` times; otherwise one line and 1
        (serving) or 2 (start-up). 0 while all is well."""
        sup = self.sup
        dead = sup.first_exited(self.stage_names)
        if dead is None:
            return 0
        if is_serving and sup.num_restarts.get(dead, 0) < self.args.max_stage_restarts:
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

    def check_services(self, is_serving: bool) -> int:
        """An admission, the gateway or a local decode instance that died is restarted once
        serving (the admissions' requests are in JetStream; the gateway passes over a decode
        instance that is down); during start-up one line and 2. 0 while all is well."""
        sup = self.sup
        for name in self.service_names + self.decode_names:
            if not sup.exited(name):
                continue
            if not is_serving:
                print(
                    f"wavepp up: {name} exited during start-up: {sup.last_error(name)} "
                    f"(log: {sup.log_dir / name}.log); stopping",
                    file=sys.stderr,
                    flush=True,
                )
                self.stopping = True
                return 2
            sup.restart(name)
        return 0

    def print_serving(self) -> None:
        """The plan's auth line and the serving line (``launch.up.serving_line``), stdout."""
        assert self.server is not None
        print(f"wavepp up: {self.plan.auth_line}", flush=True)
        print(
            serving_line(
                self.endpoint, self.args.pool, self.plan.configs, self.plan.tokenizer,
                self.server.url, self.auth is not None, self.sup.log_dir, self.plan.decode_urls,
            ),
            flush=True,
        )  # fmt: skip

    def stop(self) -> None:
        """Stop the gateway, then the local decode instances (their whole process groups:
        vLLM's engine runs in a child of its server), then the admissions (each drains for up
        to its grace; its stages stay up until it has left), then the stages, then the
        nats-server."""
        self.sup.stop(["gateway"])
        self.sup.stop(self.decode_names, group=True)
        self.sup.stop(
            [n for n in self.service_names if n != "gateway"], self.plan.admission_grace_s
        )
        self.sup.stop(self.stage_names)
        if self.server is not None:
            self.server.stop()
        print("wavepp up: stopped", file=sys.stderr, flush=True)
