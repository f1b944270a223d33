"""`wavepp up` as a real process tree for the tests: start it, read its endpoint, stop it.

A module of its own (not conftest) so that test files import it by a name no other test folder
uses (tests/operator has a conftest too).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

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
    tmp: Path, spec: dict | None, extra_args: list[str] = (), timeout_s: float = 120.0
) -> UpService:
    """Start `wavepp up` (``--config`` a file of ``spec``; None: no config file); wait for its
    'serving' line; fail fast (with the output) if it exits."""
    tmp.mkdir(parents=True, exist_ok=True)
    config_args = []
    if spec is not None:
        config = tmp / "pipeline.yaml"
        config.write_text(yaml.safe_dump(spec))
        config_args = ["--config", str(config)]
    port = free_port()
    state_dir = tmp / "state"
    proc = subprocess.Popen(
        [sys.executable, "-m", "wavepp.cli", "up", *config_args, "--port", str(port),
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


def wait_replicas_in_pool(service: UpService, count: int, timeout_s: float = 90.0) -> None:
    """Wait until the gateway's /readyz has ``count`` replicas in its pool: `wavepp up` says
    'serving' once one is, and a replica's processes serve /metrics only once formed."""
    deadline = time.monotonic() + timeout_s
    members: dict = {}
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{service.endpoint}/readyz", timeout=5.0) as response:
                members = json.loads(response.read()).get("replicas", {})
        except (urllib.error.URLError, OSError, ValueError):
            members = {}
        if sum(bool(m.get("in_pool")) for m in members.values()) >= count:
            return
        time.sleep(0.2)
    pytest.fail(f"{count} replicas not in the pool in {timeout_s} s: {members}")


def stop_up(proc: subprocess.Popen[str]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait(10)
    return proc.returncode


def free_port_run(count: int) -> int:
    """A port P with P .. P + count - 1 free (``wavepp up --metrics-port P`` numbers its
    processes' metrics ports from P)."""
    for _ in range(50):
        port = free_port()  # below the ephemeral range: no outgoing connection takes P + i
        try:
            for other_port in range(port + 1, port + count):
                with socket.socket() as other:
                    other.bind(("127.0.0.1", other_port))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no {count} adjacent free ports")
