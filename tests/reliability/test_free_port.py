"""``free_port``: ports a test or ``wavepp up`` hands to a process that binds them later."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from wavepp.runtime.transport.natsio import (
    DEFAULT_FREE_PORT_RANGE,
    FREE_PORT_RANGE,
    FREE_PORTS_ENV,
    _free_port_range,
    free_port,
)

REPO = Path(__file__).resolve().parents[2]


def _ephemeral_range() -> tuple[int, int]:
    low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    return int(low), int(high)


def test_ports_are_distinct_and_outside_the_ephemeral_range() -> None:
    """``free_port`` picks outside the kernel's ephemeral range (which outgoing connections
    share, so a port picked there can be taken before it is bound) and never repeats in one
    process: 300 ports, none repeats, none is ephemeral."""
    low, high = _ephemeral_range()
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert not [p for p in ports if low <= p <= high]
    assert all(FREE_PORT_RANGE[0] <= p < FREE_PORT_RANGE[1] for p in ports)


def test_a_seeded_global_random_does_not_repeat_ports() -> None:
    """A test that seeds ``random`` must not make two processes (or two runs) pick alike."""
    random.seed(1)
    first = free_port()
    random.seed(1)
    assert free_port() != first


def test_a_port_in_use_is_not_returned() -> None:
    """Ports taken by a listener are skipped: every returned port binds."""
    for _ in range(50):
        port = free_port()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))


def test_a_process_draws_only_in_the_part_its_environment_names() -> None:
    """Parallel test workers (tests/conftest.py) each give their processes, and those that
    these start, a part of the range in WAVEPP_FREE_PORTS: two workers never draw alike."""
    code = (
        "from wavepp.runtime.transport.natsio import free_port\n"
        "print(' '.join(str(free_port()) for _ in range(200)))"
    )
    env = os.environ | {FREE_PORTS_ENV: "21000-21300", "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout
    ports = [int(p) for p in out.split()]
    assert len(set(ports)) == 200 and all(21000 <= p < 21300 for p in ports)


@pytest.mark.parametrize("value", ["21000", "21300-21000", "x-y", "19999-21000", "21000-40000"])
def test_a_bad_part_is_refused_naming_the_variable_and_the_limits(value: str) -> None:
    with pytest.raises(ValueError, match=rf"{FREE_PORTS_ENV}=.*20000 <= LOW < HIGH <= 32768"):
        _free_port_range(value)


def test_no_part_is_the_whole_range() -> None:
    assert _free_port_range(None) == _free_port_range("") == DEFAULT_FREE_PORT_RANGE
