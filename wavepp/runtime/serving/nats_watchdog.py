"""Keep ``wavepp up``'s nats-server serving: restart it when it died, or when it disabled
JetStream (it does so when a store write fails for want of disk space) and space came back.

nats-server never re-enables JetStream by itself: after a full disk every request would get 503
for as long as the server runs. The watchdog reads the server's monitoring ``/jsz`` (``"disabled":
true`` once JetStream is off) and the free space of the store's filesystem; a restart keeps the
port, the config (credentials) and the store, and clients reconnect on their own.

``restart_reason`` is the pure decision; ``NatsWatchdog.check`` does the I/O around it.
"""

from __future__ import annotations

import json
import logging
import shutil
import urllib.error
import urllib.request
from pathlib import Path

from wavepp.runtime.transport.natsio import EmbeddedNatsServer

log = logging.getLogger(__name__)

# Free bytes on the store's filesystem before a server that disabled JetStream is restarted.
MIN_FREE_BYTES = 64 * 1024 * 1024


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
    ) -> None:
        if not server.monitor_port:
            raise ValueError("NatsWatchdog needs a server started with monitor_port")
        self.server = server
        self.store_dir = store_dir
        self.min_free_bytes = min_free_bytes
        self.num_restarts = 0

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
        self.server.restart()
        self.num_restarts += 1
        return reason
