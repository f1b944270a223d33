"""The one supervisor of local child processes (``wavepp.runtime.serving.processes``) and the
children's command lines (``api.cli_args``): what ``wavepp up``, ``wavepp replay`` and ``wavepp bench
grid`` start is what each subcommand's own parser reads, and ``processes.json`` follows every
start and restart."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from wavepp import cli
from wavepp.api.cli_args import NatsArgs, admission_args, gateway_args, stage_args
from wavepp.runtime.procs import stop_processes
from wavepp.runtime.serving.lifecycle import PARENT_PID_ENV
from wavepp.runtime.serving.processes import Supervisor, wavepp_command


def _parsed(command: list[str]):  # noqa: ANN202 - argparse.Namespace
    """``command`` (``python -m wavepp.cli SUB ...``) parsed by SUB's own parser."""
    assert command[:3] == [sys.executable, "-m", "wavepp.cli"]
    argv = command[3:]
    return cli.build_parser(argv[:1]).parse_args(argv)


def test_stage_args_parse_with_and_without_metrics_and_creds() -> None:
    """``wavepp stage``'s parser reads what ``stage_args`` builds; the metrics and credentials
    flags appear only when given."""
    bare = _parsed(
        wavepp_command(
            stage_args(
                NatsArgs("nats://h:1"), runtime_config="/s/rc.json", rank="1", dist_url="tcp://h:2"
            )
        )
    )
    assert (bare.runtime_config, bare.rank, bare.nats_url, bare.dist_url) == (
        "/s/rc.json",
        "1",
        "nats://h:1",
        "tcp://h:2",
    )
    assert bare.metrics_port is None and bare.nats_creds is None
    full = _parsed(
        wavepp_command(
            stage_args(
                NatsArgs("nats://h:1", creds="/c/stage.creds"),
                runtime_config="/s/rc.json",
                rank="0",
                dist_url="tcp://h:2",
                metrics_port=9401,
                metrics_host="10.0.0.1",
            )
        )
    )
    assert (full.metrics_port, full.metrics_host, full.nats_creds) == (
        9401,
        "10.0.0.1",
        "/c/stage.creds",
    )


def test_admission_and_gateway_args_parse() -> None:
    """``wavepp admission`` and ``wavepp gateway`` read what their builders build."""
    admission = _parsed(
        wavepp_command(
            admission_args(
                NatsArgs("nats://h:1", creds="/c/a.creds"),
                runtime_config="/s/rc.json",
                pool="p",
                ack_wait_s=7.5,
                drain_s=25.0,
                metrics_host="0.0.0.0",
            )
        )
    )
    assert (admission.pool, admission.ack_wait_s, admission.drain_timeout_s) == ("p", 7.5, 25.0)
    assert (admission.metrics_host, admission.nats_creds) == ("0.0.0.0", "/c/a.creds")
    gateway = _parsed(
        wavepp_command(
            gateway_args(NatsArgs("nats://h:1"), gateway_config="/s/gw.json", host="h", port=8123)
        )
    )
    assert (gateway.gateway_config, gateway.host, gateway.port, gateway.nats_creds) == (
        "/s/gw.json",
        "h",
        8123,
        None,
    )


def test_restart_reruns_the_command_and_rewrites_the_state_file(tmp_path: Path) -> None:
    """A restart starts the same command with the same environment (and the parent pid), counts
    it, appends to the child's log after one line naming the restart (so a restarted child's
    repeated start-up lines are not taken for lines written twice), and ``processes.json``
    names the new pid."""
    state = tmp_path / "processes.json"
    sup = Supervisor(tmp_path / "logs", state_file=state)
    sup.info = {"endpoint": "http://127.0.0.1:1"}
    script = f"import os; print(os.environ['WHO'], os.environ['{PARENT_PID_ENV}'], flush=True)"
    sup.start("child", [sys.executable, "-c", script], {"WHO": "first", "PATH": ""})
    first_pid = sup.procs["child"].pid
    assert json.loads(state.read_text())["pids"] == {"child": first_pid}
    sup.procs["child"].wait(30)
    assert sup.exited("child")
    sup.restart("child")
    sup.procs["child"].wait(30)
    written = json.loads(state.read_text())
    assert written["endpoint"] == "http://127.0.0.1:1"
    assert written["restarts"] == {"child": 1}
    assert written["pids"] == {"child": sup.procs["child"].pid} != {"child": first_pid}
    deadline = time.monotonic() + 10
    while sup.log_tail("child").count("first") < 2:
        assert time.monotonic() < deadline, sup.log_tail("child")
        time.sleep(0.05)
    first, restarted, again = sup.log_tail("child").splitlines()
    assert first == again == f"first {os.getpid()}"
    assert re.fullmatch(
        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} wavepp up: child restarted \(restart 1; "
        r"the previous process exited with code 0\)",
        restarted,
    ), restarted


def test_a_restart_says_why_the_child_died_on_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The restart line names the exit code, the child's last error line and its log, so a
    child that dies at start (vLLM refusing a checkpoint) is explained where the user looks."""
    sup = Supervisor(tmp_path / "logs")
    script = "import sys; print('loading', flush=True); sys.exit('RuntimeError: head_dim=16')"
    sup.start("decode-0", [sys.executable, "-c", script])
    sup.procs["decode-0"].wait(30)
    sup.restart("decode-0")
    sup.procs["decode-0"].wait(30)
    line = capsys.readouterr().err.strip().splitlines()[0]
    log = tmp_path / "logs" / "decode-0.log"
    assert line == (
        f"wavepp up: decode-0 exited (code 1: RuntimeError: head_dim=16); restarting (log {log})"
    )


def test_stop_processes_terminates_then_kills_what_outlives_the_grace() -> None:
    """SIGTERM first (a plain child ends by it); a child ignoring SIGTERM is SIGKILLed once
    the shared grace period is over; a child already gone is only reaped."""
    ignore = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(60)"
    plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stubborn = subprocess.Popen([sys.executable, "-c", ignore], stdout=subprocess.PIPE)
    assert stubborn.stdout is not None and stubborn.stdout.readline()  # its handler is set
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)
    started = time.monotonic()
    stop_processes([plain, stubborn, gone], grace_s=0.5)
    assert plain.returncode == -signal.SIGTERM
    assert stubborn.returncode == -signal.SIGKILL
    assert gone.returncode == 0
    assert time.monotonic() - started < 10
