"""`wavepp up` as a real process tree (nats-server, stages, admission, gateway) for the tests."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from wavepp.runtime.transport.natsio import free_port

REPO = Path(__file__).resolve().parents[2]


@dataclass
class UpService:
    proc: subprocess.Popen[str]
    endpoint: str
    state_dir: Path
    lines: list[str]

    def processes(self) -> dict:
        return json.loads((self.state_dir / "processes.json").read_text())


def build_tokenizer(directory: Path, vocab_size: int = 200) -> Path:
    """A word-level tokenizer on local disk: words w0..w{vocab_size-2} and [UNK]."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(vocab_size - 1)}}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def start_up(
    tmp: Path, spec: dict, extra_args: list[str] = (), timeout_s: float = 120.0
) -> UpService:
    """Start `wavepp up`; wait for its 'serving' line; fail fast (with the output) if it exits."""
    tmp.mkdir(parents=True, exist_ok=True)
    config = tmp / "pipeline.yaml"
    config.write_text(yaml.safe_dump(spec))
    port = free_port()
    state_dir = tmp / "state"
    proc = subprocess.Popen(
        [sys.executable, "-m", "wavepp.cli", "up", "--config", str(config), "--port", str(port),
         "--state-dir", str(state_dir), *extra_args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )  # fmt: skip
    lines: list[str] = []
    serving = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "wavepp up: serving" in line:
                serving.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not serving.wait(0.2):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_up(proc)
            pytest.fail("wavepp up did not come up:\n" + "".join(lines[-40:]))
    match = re.search(r"serving (http://\S+)", "".join(lines))
    assert match, "".join(lines)
    return UpService(proc, match.group(1), state_dir, lines)


def stop_up(proc: subprocess.Popen[str]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait(10)
    return proc.returncode


TENANT_SPEC = {
    "model": {"name": "tiny-llama"},
    "stages": 2,
    "engineOptions": {"kvBlocks": 512},
    "cache": {"blockSize": 16},
    "tenants": [
        {"name": "default"},
        {"name": "alice", "weight": 1},
        {"name": "bob", "weight": 1},
        {"name": "carol", "weight": 1},
    ],
}


@pytest.fixture(scope="session")
def up_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpService]:
    tmp = tmp_path_factory.mktemp("up")
    tokenizer = build_tokenizer(tmp / "tokenizer")
    service = start_up(
        tmp,
        TENANT_SPEC,
        [
            "--tokenizer", str(tokenizer),
            "--ack-wait-s", "2",
            "--tenant-limits", json.dumps({"carol": {"tokens_per_s": 10, "burst_tokens": 100}}),
        ],
    )  # fmt: skip
    try:
        yield service
    finally:
        code = stop_up(service.proc)
        assert code == 0, "".join(service.lines[-40:])
        pids = service.processes()["pids"].values()
        for pid in pids:
            assert not Path(f"/proc/{pid}").exists() or _is_zombie(pid), f"child {pid} left"
        # Each child left on SIGTERM by closing its own NATS connection (the callback logs
        # "disconnected"), not by the supervisor's kill after its timeout.
        for log_path in sorted((service.state_dir / "logs").glob("*.log")):
            if log_path.name == "nats-server.log":
                continue
            tail = log_path.read_text(errors="replace").splitlines()[-5:]
            assert any(": disconnected" in line for line in tail), (log_path.name, tail)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


@pytest.fixture(scope="session")
def serving() -> SimpleNamespace:
    """Helpers for tests that start their own process trees (test files cannot import this
    conftest: tests/ is not a package)."""
    return SimpleNamespace(REPO=REPO, start_up=start_up, stop_up=stop_up)
