"""The local child processes of ``wavepp up``, ``wavepp replay`` and ``wavepp bench grid``: one
supervisor, the one builder of a stage child's command line (:func:`stage_command`) and of
a pool's authenticated nats-server (:func:`pool_nats_server`); each child's arguments come from
``api.cli_args``.

Every child is ``python -m wavepp.cli <subcommand>`` (the commands pods run), started in its own
session (a Ctrl-C reaches only the parent, which stops the children in order) with
``WAVEPP_PARENT_PID`` set (``lifecycle.child_env``: a child ends when its parent dies). Its
stdout and stderr go to ``LOG_DIR/<name>.log`` (appended across restarts, each restart
announced by one line there). The nats-server's
command line is built once, by ``transport.natsio.EmbeddedNatsServer``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from wavepp.api.cli_args import NatsArgs, stage_args
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.procs import stop_processes
from wavepp.runtime.serving.lifecycle import child_env
from wavepp.runtime.stage.placement import launcher_cores, stage_cores
from wavepp.runtime.transport.auth import PoolAuth, write_pool_auth
from wavepp.runtime.transport.natsio import EmbeddedNatsServer


def wavepp_command(args: Sequence[str]) -> list[str]:
    """``python -m wavepp.cli`` (this interpreter) followed by ``args``, the arguments a pod
    passes to ``wavepp``: one of ``api.cli_args.stage_args``, ``admission_args`` or
    ``gateway_args``, so a local child and a pod read the same flags."""
    return [sys.executable, "-m", "wavepp.cli", *args]


def stage_command(
    config: RuntimeConfig,
    config_path: str,
    rank: int,
    dist_url: str,
    nats: NatsArgs,
    *,
    core_share: tuple[int, int] | None = None,
    metrics_port: int | None = None,
    metrics_host: str | None = None,
) -> list[str]:
    """The ``wavepp stage`` command of stage ``rank`` of ``config`` (read from
    ``config_path``), joining the torch.distributed group at ``dist_url``. With
    ``config.pin_cores`` it runs on share ``i`` of ``n`` of this process's cores
    (``placement.stage_cores``), ``core_share`` = (i, n), default (rank, ``num_stages``): a
    launcher of several replicas on one host numbers its stages across them.

    Raises:
        ValueError: naming ``engineOptions.pinCores``: fewer cores than ``n``.
    """
    cores = None
    if config.pin_cores:
        index, count = core_share or (rank, config.num_stages)
        cores = stage_cores(launcher_cores(), count, index)
    return wavepp_command(
        stage_args(
            nats,
            runtime_config=config_path,
            rank=rank,
            dist_url=dist_url,
            metrics_port=metrics_port,
            metrics_host=metrics_host,
            cores=cores,
        )
    )


def pool_nats_server(
    auth_dir: Path,
    log_dir: Path,
    *,
    pool: str,
    replicas: dict[str, int],
    namespace: str,
    store_dir: Path | None = None,
    max_file_store_bytes: int | None = None,
    monitor_port: int | None = None,
) -> tuple[PoolAuth, EmbeddedNatsServer]:
    """A pool's fresh credentials (``transport.auth.write_pool_auth`` into ``auth_dir``) and a
    nats-server, not yet started, that trusts only them: its log ``log_dir/nats-server.log``,
    JetStream in ``store_dir`` (None: none), HTTP monitoring on ``monitor_port`` (None: off).

    Raises:
        ValueError: a pool or replica name NATS cannot carry (from ``write_pool_auth``).
    """
    auth = write_pool_auth(
        auth_dir,
        pool=pool,
        replicas=replicas,
        namespace=namespace,
        store_dir=store_dir,
        max_file_store_bytes=max_file_store_bytes,
    )
    server = EmbeddedNatsServer(
        config_file=auth.server_config,
        log_file=str(log_dir / "nats-server.log"),
        monitor_port=monitor_port,
    )
    if store_dir is not None:
        server.store_dir = str(store_dir)
    return auth, server


class Supervisor:
    """Starts, restarts and stops named child processes.

    Args:
        log_dir: where ``<name>.log`` goes (created).
        state_file: when given, rewritten (atomically) at every start and restart: ``info``
            plus ``pids`` (name -> pid) and ``restarts`` (name -> count), e.g.
            ``processes.json`` of ``wavepp up``.
        prog: the program named in the restart line on stderr.
    """

    def __init__(
        self, log_dir: Path, *, state_file: Path | None = None, prog: str = "wavepp up"
    ) -> None:
        self.log_dir = log_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.state_file = state_file
        self.prog = prog
        self.commands: dict[str, list[str]] = {}
        self.envs: dict[str, Mapping[str, str] | None] = {}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.num_restarts: dict[str, int] = {}
        self.info: dict[str, object] = {}

    def start(self, name: str, command: list[str], env: Mapping[str, str] | None = None) -> None:
        """Start ``command`` as child ``name`` in a new session, with ``env`` (default: this
        process's environment) and ``WAVEPP_PARENT_PID``; output appended to its log."""
        self.commands[name] = command
        self.envs[name] = env
        self._spawn(name, None)

    def restart(self, name: str) -> None:
        """Start ``name`` again with the same command and environment; counted, one line on
        stderr (the exit code, the child's last error line, ``last_error``, and its log's path:
        why it died without opening the log), and one in the child's log before the new
        process's output (a restarted child logs its start-up lines again: the line tells a
        restart from lines written twice)."""
        num = self.num_restarts[name] = self.num_restarts.get(name, 0) + 1
        code = self.procs[name].poll()
        print(
            f"{self.prog}: {name} exited (code {code}: {self.last_error(name)}); restarting "
            f"(log {self.log_dir / f'{name}.log'})",
            file=sys.stderr,
            flush=True,
        )
        self._spawn(
            name,
            f"{self.prog}: {name} restarted (restart {num}; the previous process exited with "
            f"code {code})",
        )

    def _spawn(self, name: str, note: str | None) -> None:
        """Start child ``name``'s command, its output appended to its log after ``note`` (a
        line stamped like the children's log records: local time, milliseconds)."""
        with open(self.log_dir / f"{name}.log", "ab") as out:
            if note is not None:
                now = time.time()
                stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
                out.write(f"{stamp},{int(now * 1000) % 1000:03d} {note}\n".encode())
                out.flush()
            self.procs[name] = subprocess.Popen(
                self.commands[name],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=child_env(self.envs[name]),
            )
        self.write_state()

    def exited(self, name: str) -> bool:
        """Whether child ``name`` has exited."""
        return self.procs[name].poll() is not None

    def first_exited(self, names: Sequence[str]) -> str | None:
        """The first of ``names`` whose process has exited; None while all run."""
        return next((name for name in names if self.exited(name)), None)

    def write_state(self) -> None:
        if self.state_file is None:
            return
        state = {
            **self.info,
            "pids": {name: proc.pid for name, proc in self.procs.items()},
            "restarts": self.num_restarts,
        }
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.state_file)

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

    def stop(self, names: list[str], grace_s: float = 10.0, *, group: bool = False) -> None:
        """SIGTERM the ``names`` still running, wait up to ``grace_s`` seconds for all of them
        (together), then SIGKILL those left. ``group``: signal each child's whole process group
        (its session: the processes it started too), and SIGKILL what is left of the group once
        the child exited."""
        stop_processes(
            [self.procs[name] for name in names if name in self.procs], grace_s, group=group
        )

    def kill(self, names: list[str]) -> None:
        """SIGKILL the ``names`` still running and reap them (up to 10 s each)."""
        for name in names:
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                proc.kill()
        for name in names:
            proc = self.procs.get(name)
            if proc is not None:
                proc.wait(10)
