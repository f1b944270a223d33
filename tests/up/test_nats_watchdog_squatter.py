"""``wavepp up``'s nats-server watchdog when the restarted server cannot start: its port taken
by another process after the server died. A real nats-server; the squatter is a plain listening
socket; the watchdog's clock is a counter (the backoff without sleeping).

Pinned: ``EmbeddedNatsServer.start`` does not take another process's listener on the port for
its server, and a server that exits during start does not raise out of ``NatsWatchdog.check``
into ``wavepp up``'s loop (no traceback; the watchdog retries with backoff)."""

from __future__ import annotations

import logging
import os
import signal
import socket
from pathlib import Path

import pytest

from wavepp.runtime.serving.nats_watchdog import NatsRestartFailed, NatsWatchdog
from wavepp.runtime.transport.natsio import EmbeddedNatsServer, free_port

pytestmark = pytest.mark.timeout(60)


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _squat(port: int) -> socket.socket:
    """Listen on 127.0.0.1:``port`` (accepting, never speaking): another process's server."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(8)
    return sock


def _kill(server: EmbeddedNatsServer) -> None:
    assert server._proc is not None  # noqa: SLF001
    os.kill(server._proc.pid, signal.SIGKILL)  # noqa: SLF001
    server._proc.wait(5)  # noqa: SLF001


def test_a_squatter_on_the_port_is_not_taken_for_the_server(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "nats.log"
    squatter = _squat(port)
    try:
        server = EmbeddedNatsServer(port=port, log_file=str(log))
        with pytest.raises(RuntimeError, match=rf"exited with code \d+ on port {port}: .*"):
            server.start(timeout_s=5)
        assert not server.is_running
        assert "address already in use" in str(log.read_text())
    finally:
        squatter.close()


def test_the_watchdog_retries_with_backoff_then_restarts_once_the_port_is_free(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = _Clock()
    server = EmbeddedNatsServer(
        jetstream=True, store_dir=str(tmp_path / "js"), monitor_port=free_port(),
        log_file=str(tmp_path / "nats.log"),
    )  # fmt: skip
    server.start()
    watchdog = NatsWatchdog(server, tmp_path / "js", clock=clock, give_up_s=30.0)
    try:
        assert watchdog.check() is None  # serving
        _kill(server)
        squatter = _squat(server.port)
        with caplog.at_level(logging.WARNING, "wavepp.runtime.serving.nats_watchdog"):
            assert watchdog.check() is None  # failed: logged, no exception
            assert watchdog.check() is None  # within the backoff (0.5 s): not tried
            clock.now += 0.5
            assert watchdog.check() is None  # failed again; now 1 s
        failures = [r.getMessage() for r in caplog.records if "did not restart" in r.getMessage()]
        assert len(failures) == 2, failures
        assert all(f"port {server.port}" in line and "exited" in line for line in failures)
        assert "trying again in 0.5 s" in failures[0] and "in 1.0 s" in failures[1]
        assert watchdog.num_failed_restarts == 2 and not server.is_running
        squatter.close()
        clock.now += 0.9
        assert watchdog.check() is None  # still backing off
        clock.now += 0.1
        assert watchdog.check() == "nats-server exited"
        assert server.is_running and watchdog.num_restarts == 1
        assert watchdog.check() is None
    finally:
        server.stop()


def test_the_watchdog_gives_up_with_one_line_after_its_bound(tmp_path: Path) -> None:
    clock = _Clock()
    server = EmbeddedNatsServer(monitor_port=free_port())
    server.start()
    server.store_dir = str(tmp_path)
    watchdog = NatsWatchdog(server, tmp_path, clock=clock, max_backoff_s=2.0, give_up_s=5.0)
    _kill(server)
    squatter = _squat(server.port)
    try:
        tries = 0
        with pytest.raises(NatsRestartFailed) as failed:
            while clock.now < 1100:
                watchdog.check()
                tries += 1
                clock.now += 0.25
        message = str(failed.value)
        assert "\n" not in message and f"port {server.port}" in message, message
        assert "could not be restarted in 6 s (5 tries)" in message  # 5.5 s, rounded
        # backoffs 0.5, 1, 2, 2 (bounded) then past 5 s: 5 failed starts, not one per check
        assert watchdog.num_failed_restarts == 5 and tries > 5
    finally:
        squatter.close()
        server.stop()
