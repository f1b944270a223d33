"""Keep ``wavepp up``'s nats-server serving: restart it when it died, or when it disabled
JetStream (it does so when a store write fails for want of disk space) and space came back.

nats-server never re-enables JetStream by itself: after a full disk every request would get 503
for as long as the server runs. The watchdog reads the server's monitoring ``/jsz`` (``"disabled":
true`` once JetStream is off) and the free space of the store's filesystem; a restart keeps the
port, the config (credentials) and the store, and clients reconnect on their own.

A restart that fails (the port taken by another process, the binary gone) is tried again with
a bounded backoff (``first_backoff_s`` doubling up to ``max_backoff_s``), one warning per failure
naming the port and the reason; once the server has been down ``give_up_s``, ``check`` raises
``NatsRestartFailed`` (``wavepp up`` then stops with that one line and exit code 1).

``restart_reason`` is the pure decision; ``NatsWatchdog.check`` does the I/O around it.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from wavepp.runtime.transport.natsio import EmbeddedNatsServer

log = logging.getLogger(__name__)

# Free bytes on the store's filesystem before a server that disabled JetStream is restarted.
MIN_FREE_BYTES = 64 * 1024 * 1024


class NatsRestartFailed(RuntimeError):
    """The nats-server could not be restarted within the watchdog's ``give_up_s`` (one line)."""


def restart_reason(
    *, is_running: bool, jsz: dict | None, free_bytes: int, min_free_bytes: int = MIN_FREE_BYTES
) -> str | None:
    """Why the server should be restarted now, or None.

    Args:
        is_running: the server process is alive.
        jsz: the server's ``/jsz`` answer (None: not reachable).
        free_bytes: free bytes on the filesystem of the JetStream store.
        min_free_bytes: restart a server with JetStream disabled only past this much free space
            (before it, a restart would fill the disk and disable JetStream again).
    """
    if not is_running:
        return "nats-server exited"
    if jsz is not None and jsz.get("disabled") and free_bytes >= min_free_bytes:
        return f"JetStream disabled and {free_bytes // 2**20} MiB free again"
    return None


class NatsWatchdog:
    """Checks a JetStream ``EmbeddedNatsServer`` (started with ``monitor_port``) and restarts it.

    Call ``check()`` periodically (``wavepp up`` does, every loop); it returns the reason when
    it restarted the server.
    """

    def __init__(
        self,
        server: EmbeddedNatsServer,
        store_dir: Path,
        *,
        min_free_bytes: int = MIN_FREE_BYTES,
        first_backoff_s: float = 0.5,
        max_backoff_s: float = 5.0,
        give_up_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Args (besides the server and its store): ``first_backoff_s`` .. ``max_backoff_s``:
        the wait after a failed restart (doubling), seconds > 0; ``give_up_s``: how long
        restarts may keep failing before ``check`` raises; ``clock``: monotonic seconds.

        Raises:
            ValueError: a server without ``monitor_port``, or a bound not > 0.
        """
        if not server.monitor_port:
            raise ValueError("NatsWatchdog needs a server started with monitor_port")
        if not 0 < first_backoff_s <= max_backoff_s or not give_up_s > 0:
            raise ValueError(
                "NatsWatchdog: need 0 < first_backoff_s <= max_backoff_s, give_up_s > 0"
            )
        self.server = server
        self.store_dir = store_dir
        self.min_free_bytes = min_free_bytes
        self.first_backoff_s = first_backoff_s
        self.max_backoff_s = max_backoff_s
        self.give_up_s = give_up_s
        self.clock = clock
        self.num_restarts = 0
        self.num_failed_restarts = 0
        self._failing_since: float | None = None  # first failed restart of the current outage
        self._backoff_s = first_backoff_s
        self._next_try_s = 0.0
        self._reason = ""

    def _jsz(self) -> dict | None:
        url = f"http://127.0.0.1:{self.server.monitor_port}/jsz"
        try:
            with urllib.request.urlopen(url, timeout=1.0) as response:
                return json.loads(response.read())
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def _free_bytes(self) -> int:
        path = self.store_dir
        while not path.exists() and path != path.parent:
            path = path.parent
        return shutil.disk_usage(path).free

    def check(self) -> str | None:
        """Restart the server if it needs it (or retry a failed restart whose backoff is over).

        Returns:
            why it restarted the server, when it did (and it serves again); else None.

        Raises:
            NatsRestartFailed: restarts kept failing for ``give_up_s``.
        """
        if self._failing_since is None:
            is_running = self.server.is_running
            reason = restart_reason(
                is_running=is_running,
                jsz=self._jsz() if is_running else None,
                free_bytes=self._free_bytes(),
                min_free_bytes=self.min_free_bytes,
            )
            if reason is None:
                return None
            log.warning("restarting nats-server: %s", reason)
        elif self.clock() < self._next_try_s:
            return None
        else:
            reason = self._reason
        try:
            self.server.restart()
        except (OSError, RuntimeError, TimeoutError) as exc:
            self._failed(reason, exc)
            return None
        self._failing_since = None
        self.num_restarts += 1
        return reason

    def _failed(self, reason: str, exc: BaseException) -> None:
        now = self.clock()
        if self._failing_since is None:
            self._failing_since, self._backoff_s, self._reason = now, self.first_backoff_s, reason
        else:
            self._backoff_s = min(2 * self._backoff_s, self.max_backoff_s)
        self.num_failed_restarts += 1
        down_s = now - self._failing_since
        port = self.server.port
        if down_s >= self.give_up_s:
            raise NatsRestartFailed(
                f"nats-server on port {port} could not be restarted in {down_s:.0f} s "
                f"({self.num_failed_restarts} tries): {exc}"
            ) from None
        self._next_try_s = now + self._backoff_s
        log.warning(
            "nats-server on port %d did not restart (%s): %s; trying again in %.1f s",
            port, reason, exc, self._backoff_s,
        )  # fmt: skip
