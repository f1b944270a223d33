"""The local child processes of ``wavepp up``, ``wavepp replay`` and ``wavepp bench grid``: one
supervisor; each child's arguments come from ``api.cli_args``.

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

from wavepp.runtime.procs import stop_processes
from wavepp.runtime.serving.lifecycle import child_env


def wavepp_command(args: Sequence[str]) -> list[str]:
    """``python -m wavepp.cli`` (this interpreter) followed by ``args``, the arguments a pod
    passes to ``wavepp``: one of ``api.cli_args.stage_args``, ``admission_args`` or
    ``gateway_args``, so a local child and a pod read the same flags."""
    return [sys.executable, "-m", "wavepp.cli", *args]


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
