"""``free_port``: ports a test or ``wavepp up`` hands to a process that binds them later."""

from __future__ import annotations

import random
import socket
from pathlib import Path

from wavepp.runtime.transport.natsio import FREE_PORT_RANGE, free_port


def _ephemeral_range() -> tuple[int, int]:
    low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    return int(low), int(high)


def test_ports_are_distinct_and_outside_the_ephemeral_range() -> None:
    """A CI run failed when a port chosen for one process was in use by the time it bound it:
    bind(0) picks in the kernel's ephemeral range, which outgoing connections share, and two
    picks can repeat. 300 ports in one process: none repeats, none is ephemeral."""
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
