"""`wavepp up` as a real process tree (nats-server, stages, admission, gateway) for the tests."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from up_support import UpService, build_tokenizer, start_up, stop_up  # noqa: F401

REPO = Path(__file__).resolve().parents[2]


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
