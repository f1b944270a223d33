"""Removing a deleted pipeline's JetStream state: its replicas' intake streams and its results
bucket (names from ``wavepp.api.subjects``, scoped by namespace and name, so a same-named pipeline
in another namespace keeps its own). The one place the operator speaks NATS.
"""

from __future__ import annotations

import nats

from wavepp.api.subjects import pool_streams


async def delete_pool_streams(
    url: str, pool: str, *, namespace: str, timeout_s: float = 5.0
) -> list[str]:
    """Delete the streams of pool ``namespace/pool`` on the NATS server at ``url``.

    Args:
        url: NATS URL (the pipeline's ``spec.nats.url`` or the operator's default).
        pool: the WavePipeline's name.
        namespace: its namespace.
        timeout_s: connect and request timeout in seconds.

    Returns:
        The names of the streams removed (the results bucket is stream ``KV_...``).

    Raises:
        Exception: NATS unreachable or refusing (nats-py's errors); nothing is half-known.
    """
    nc = await nats.connect(
        url, connect_timeout=timeout_s, max_reconnect_attempts=0, allow_reconnect=False
    )
    try:
        js = nc.jetstream(timeout=timeout_s)
        names = [info.config.name for info in await js.streams_info() if info.config.name]
        removed = []
        for name in pool_streams(names, pool, namespace=namespace):
            await js.delete_stream(name)
            removed.append(name)
        return removed
    finally:
        await nc.close()
