"""JetStream objects of the serving path: the replica's durable intake stream, the pool's results
bucket. Names come from ``wavepp.api.subjects``.
"""

from __future__ import annotations

from nats.js.api import KeyValueConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError

from wavepp.api.subjects import intake_stream, intake_subject, results_bucket


async def ensure_intake(  # noqa: ANN001 - JetStreamContext
    js, pipeline: str, *, namespace: str, duplicate_window_s: float = 120.0
) -> None:
    """Create the replica's intake stream if it does not exist (idempotent)."""
    name = intake_stream(pipeline, namespace=namespace)
    try:
        await js.stream_info(name)
    except NotFoundError:
        await js.add_stream(
            StreamConfig(
                name=name,
                subjects=[intake_subject(pipeline, namespace=namespace)],
                retention=RetentionPolicy.WORK_QUEUE,
                storage=StorageType.FILE,
                duplicate_window=duplicate_window_s,
            )
        )


async def ensure_results(js, pool: str, *, namespace: str, ttl_s: float = 3600.0):  # noqa: ANN001, ANN201
    """The pool's results KV bucket (key -> PrefillResult JSON), created if absent."""
    bucket = results_bucket(pool, namespace=namespace)
    try:
        return await js.key_value(bucket)
    except (NotFoundError, Exception):  # nats-py raises BucketNotFoundError (a NotFoundError)
        return await js.create_key_value(KeyValueConfig(bucket=bucket, ttl=ttl_s))
