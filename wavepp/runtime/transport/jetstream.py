"""JetStream objects of the serving path: the replica's durable intake stream, the pool's results
bucket. Names come from ``wavepp.api.subjects``.
"""

from __future__ import annotations

from nats.js.api import KeyValueConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError

from wavepp.api.subjects import intake_stream, intake_subject, results_bucket


async def ensure_intake(js, pipeline: str, *, duplicate_window_s: float = 120.0) -> None:  # noqa: ANN001 - JetStreamContext
    """Create the replica's intake stream if it does not exist (idempotent)."""
    name = intake_stream(pipeline)
    try:
        await js.stream_info(name)
    except NotFoundError:
        await js.add_stream(
            StreamConfig(
                name=name,
                subjects=[intake_subject(pipeline)],
                retention=RetentionPolicy.WORK_QUEUE,
                storage=StorageType.FILE,
                duplicate_window=duplicate_window_s,
            )
        )


async def ensure_results(js, pool: str, *, ttl_s: float = 3600.0):  # noqa: ANN001, ANN201
    """The pool's results KV bucket (key -> PrefillResult JSON), created if absent."""
    try:
        return await js.key_value(results_bucket(pool))
    except (NotFoundError, Exception):  # nats-py raises BucketNotFoundError (a NotFoundError)
        return await js.create_key_value(KeyValueConfig(bucket=results_bucket(pool), ttl=ttl_s))
