"""Removing a deleted pipeline's JetStream state: its replicas' intake streams and rendezvous
buckets and its results bucket (names from ``wavepp.api.subjects``, scoped by namespace and name,
so a same-named pipeline in another namespace keeps its own). The one place the operator speaks
NATS.

Under NATS auth (the operator holds the account seed) it connects as the pool's cleanup user
(``wavepp.api.permissions.cleanup_user``), twice: once allowed only to list the streams, then
allowed to delete exactly the pool's streams it found. Without a seed it connects anonymously
(an insecure NATS).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import nats

from wavepp.api.natsauth import derived_user_creds
from wavepp.api.permissions import cleanup_user
from wavepp.api.subjects import pool_streams


@asynccontextmanager
async def _connected(
    url: str, timeout_s: float, account_seed: str | None, user: Any
) -> AsyncIterator[Any]:
    """A connection as ``user`` (its ``.creds`` in a private temporary file while connecting),
    or anonymous without an account seed."""
    options: dict[str, Any] = {
        "connect_timeout": timeout_s,
        "max_reconnect_attempts": 0,
        "allow_reconnect": False,
    }
    path = None
    if account_seed is not None:
        fd, path = tempfile.mkstemp(suffix=".creds")
        with os.fdopen(fd, "w") as out:
            out.write(derived_user_creds(account_seed, user))
        options |= {"user_credentials": path, "inbox_prefix": user.inbox}
    try:
        nc = await nats.connect(url, **options)
    finally:
        if path is not None:
            os.unlink(path)
    try:
        yield nc
    finally:
        await nc.close()


async def delete_pool_streams(
    url: str,
    pool: str,
    *,
    namespace: str,
    timeout_s: float = 5.0,
    account_seed: str | None = None,
) -> list[str]:
    """Delete the streams of pool ``namespace/pool`` on the NATS server at ``url``.

    Args:
        url: NATS URL (the pipeline's ``spec.nats.url`` or the operator's default).
        pool: the WavePipeline's name.
        namespace: its namespace.
        timeout_s: connect and request timeout in seconds.
        account_seed: the NATS account's seed (None: connect without credentials).

    Returns:
        The names of the streams removed (a KV bucket is stream ``KV_...``).

    Raises:
        Exception: NATS unreachable or refusing (nats-py's errors); nothing is half-known.
    """
    async with _connected(
        url, timeout_s, account_seed, cleanup_user(pool, [], namespace=namespace)
    ) as nc:
        js = nc.jetstream(timeout=timeout_s)
        names = [info.config.name for info in await js.streams_info() if info.config.name]
    mine = pool_streams(names, pool, namespace=namespace)
    if not mine:
        return []
    user = cleanup_user(pool, mine, namespace=namespace)
    async with _connected(url, timeout_s, account_seed, user) as nc:
        js = nc.jetstream(timeout=timeout_s)
        removed = []
        for name in mine:
            await js.delete_stream(name)
            removed.append(name)
        return removed
