"""Start-up errors: a busy port, an unreachable NATS, a child that dies while starting. Each is
one line on stderr and exit code 2; what was started is stopped."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from gateway_support import tiny_gateway_config

from wavepp import cli
from wavepp.runtime.config import RuntimeConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _no_parent_death_signal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("wavepp.runtime.serving.lifecycle.exit_with_parent", lambda: None)


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_up_on_a_busy_port_starts_nothing(
    busy_port: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state"
    assert cli.main(["up", "--port", str(busy_port), "--state-dir", str(state)]) == 2
    line = _one_line(capsys)
    assert line.startswith("wavepp up: --port:") and str(busy_port) in line
    assert not state.exists(), "something was started"


def test_gateway_on_a_busy_port(
    busy_port: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tiny_gateway_config()
    path = tmp_path / "gateway.json"
    path.write_text(config.model_dump_json())
    argv = ["gateway", "--gateway-config", str(path), "--nats-url", "nats://127.0.0.1:1",
            "--port", str(busy_port)]  # fmt: skip
    assert cli.main(argv) == 2
    assert _one_line(capsys).startswith("wavepp gateway: --port:")


def test_gateway_with_a_malformed_tokenizer_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A malformed tokenizer.json ends the gateway with exit 2 and one line (``wavepp gateway:
    tokenizer: ...``), no traceback."""
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"model": {"type": "nonsense"}}')
    config = tiny_gateway_config().model_copy(update={"tokenizer": str(bad)})
    path = tmp_path / "gateway.json"
    path.write_text(config.model_dump_json())
    argv = ["gateway", "--gateway-config", str(path), "--nats-url", "nats://127.0.0.1:1"]
    assert cli.main(argv) == 2
    assert _one_line(capsys).startswith("wavepp gateway: tokenizer:")


@pytest.mark.parametrize("command", ["admission", "stage"])
def test_unreachable_nats_is_one_line(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "runtime.json"
    path.write_text(RuntimeConfig(num_stages=2).model_dump_json())
    argv = [command, "--runtime-config", str(path), "--nats-url", "nats://127.0.0.1:1",
            "--nats-connect-timeout-s", "0.3", "--pool", "p"]  # fmt: skip
    if command == "stage":
        argv += ["--rank", "0", "--dist-url", "tcp://127.0.0.1:1"]
    started = time.monotonic()
    assert cli.main(argv) == 2
    assert time.monotonic() - started < 10
    line = _one_line(capsys)
    assert line.startswith(f"wavepp {command}: --nats-url nats://127.0.0.1:1: no NATS server")


def test_up_stops_everything_when_a_child_dies_starting(tmp_path: Path) -> None:
    """A tokenizer file that does not load kills the gateway as it starts: one line, exit 2,
    no child left running."""
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text("not a tokenizer")
    state = tmp_path / "state"
    proc = subprocess.run(
        [sys.executable, "-m", "wavepp.cli", "up", "--port", "0", "--state-dir", str(state),
         "--tokenizer", str(tokenizer), "--startup-timeout-s", "120"],
        capture_output=True, text=True, timeout=180, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in proc.stderr
    assert lines[0].startswith("wavepp up: gateway exited during start-up:"), lines
    assert lines[-1] == "wavepp up: stopped" and len(lines) == 2, lines
    pids = json.loads((state / "processes.json").read_text())["pids"].values()
    assert len(pids) == 4  # 2 stages, the admission, the gateway
    for pid in pids:
        stat = Path(f"/proc/{pid}/stat")
        assert not stat.exists() or stat.read_text().split()[2] == "Z", f"child {pid} left"


def test_operator_without_credentials_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without credentials the operator exits with one line, instead of kopf logging a traceback
    per login retry and neither serving nor exiting."""
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing-kubeconfig"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert cli.main(["operator", "--liveness-port", "0"]) == 2
    line = _one_line(capsys)
    assert line.startswith("wavepp operator: no Kubernetes credentials:"), line
