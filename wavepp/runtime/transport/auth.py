"""Credentials of a local pool (``wavepp up``, ``LocalPipeline``): a fresh trust root, a
nats-server config that trusts only it, and one ``.creds`` per component, written to a folder
only this user can read.

    auth = write_pool_auth(state_dir / "nats-auth", pool="default", replicas={"p0": 2},
                           namespace="local", store_dir=state_dir / "jetstream")
    EmbeddedNatsServer(config_file=auth.server_config)
    wavepp stage ... --nats-creds auth.creds["stage-p0-0"]

Keys are made at every start (nothing secret persists between runs beyond the folder).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from wavepp.api.natsauth import TrustRoot
from wavepp.api.permissions import (
    admission_user_name,
    gateway_user_name,
    stage_user_name,
    users_for_pool,
)


@dataclass(frozen=True)
class PoolAuth:
    """Paths: the nats-server config (``-c``) and each component user's ``.creds``."""

    server_config: str
    creds: dict[str, str]

    def stage(self, pipeline: str, rank: int) -> str:
        return self.creds[stage_user_name(pipeline, rank)]

    def admission(self, pipeline: str) -> str:
        return self.creds[admission_user_name(pipeline)]

    def gateway(self, pool: str) -> str:
        return self.creds[gateway_user_name(pool)]


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)


def write_pool_auth(
    folder: Path,
    *,
    pool: str,
    replicas: dict[str, int],
    namespace: str,
    store_dir: Path | None,
    max_file_store_bytes: int | None = None,
) -> PoolAuth:
    """Make a trust root and write ``server.conf`` and ``{user}.creds`` (mode 0600) to
    ``folder`` (mode 0700).

    Args:
        replicas: pipeline -> number of stages.
        namespace: the namespace token of the pool's NATS names (``local`` for ``wavepp up``).
        store_dir: JetStream's store (None: no JetStream, e.g. ``LocalPipeline``).
        max_file_store_bytes: JetStream's disk limit (None: the server's default): the
            server's ``max_file_store`` and the account's own limit, which its users read in
            their JetStream account info (the gateway exports it, ``wavepp.gateway.metrics``).

    Raises:
        ValueError: a pool or pipeline name that cannot be a NATS user name.
        OSError: the folder cannot be written.
    """
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    trust = TrustRoot.new(max_store_bytes=max_file_store_bytes)
    users = users_for_pool(pool, replicas, namespace=namespace)
    if store_dir is None:
        config = trust.auth_config()
    else:
        config = trust.server_config(str(store_dir), max_file_store_bytes=max_file_store_bytes)
    _write_private(folder / "server.conf", config)
    creds: dict[str, str] = {}
    for user in users:
        path = folder / f"{user.name}.creds"
        _write_private(path, trust.user_creds(user))
        creds[user.name] = str(path)
    return PoolAuth(server_config=str(folder / "server.conf"), creds=creds)
