"""The NATS ``StageClient``: request-reply to the stage's KV subjects with a timeout; and
``serve_stage_kv``, the stage side of those subjects without a whole stage process."""

from __future__ import annotations

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from wavepp.api.messages import (
    KVReply,
    KVRequestMessage,
)
from wavepp.api.subjects import ReplicaSubjects
from wavepp.runtime.agreement.clients import StageUnavailableError
from wavepp.runtime.agreement.stage_handler import handle_kv_batch, handle_kv_request
from wavepp.runtime.kv import StageKVManager
from wavepp.runtime.transport.natsio import ReconnectedError, fail_on_reconnect


async def serve_stage_kv(
    nc: NATS, subject_prefix: str, rank: int, manager: StageKVManager
) -> list[Subscription]:
    """Answer a stage's agreement endpoints (JSON single requests and binary rounds) from
    ``manager`` on ``nc``: what a stage process does, for benchmarks and tests that run the
    KV side without a whole stage. Returns the subscriptions (unsubscribe to stop)."""
    subjects = ReplicaSubjects(subject_prefix)

    async def on_kv(msg: Msg) -> None:
        await msg.respond(handle_kv_request(manager, rank, msg.data).model_dump_json().encode())

    async def on_batch(msg: Msg) -> None:
        await msg.respond(handle_kv_batch(manager, rank, msg.data))

    return [
        await nc.subscribe(subjects.stage_kv(rank), cb=on_kv),
        await nc.subscribe(subjects.stage_kv_batch(rank), cb=on_batch),
    ]


class NatsStageClient:
    """Request-reply to ``{prefix}.stage.{rank}.kv`` with a timeout.

    Raises:
        StageUnavailableError: nobody listens on the subject (a configuration fault), no reply
            within ``timeout_s`` (a slow or dead stage), or NATS reconnected while it waited
            (the request or its reply may be lost with the server; the callers retry).
    """

    def __init__(self, nc: NATS, subject_prefix: str, rank: int, timeout_s: float = 10.0) -> None:
        self.nc = nc
        self.rank = rank
        subjects = ReplicaSubjects(subject_prefix)
        self.subject = subjects.stage_kv(rank)
        self.batch_subject = subjects.stage_kv_batch(rank)
        self.timeout_s = timeout_s

    async def call(self, msg: KVRequestMessage) -> KVReply:
        data = await self._request(self.subject, msg.model_dump_json().encode())
        return KVReply.model_validate_json(data)

    async def call_batch(self, payload: bytes) -> bytes:
        return await self._request(self.batch_subject, payload)

    async def _request(self, subject: str, payload: bytes) -> bytes:
        try:
            reply = await fail_on_reconnect(
                self.nc, lambda: self.nc.request(subject, payload, timeout=self.timeout_s)
            )
        except ReconnectedError as exc:  # its reply may be lost with the server: as a timeout
            raise StageUnavailableError(
                self.rank, f"no reply on {subject}: NATS reconnected meanwhile"
            ) from exc
        except NoRespondersError as exc:
            raise StageUnavailableError(self.rank, f"no stage listens on {subject}") from exc
        except (TimeoutError, NatsTimeoutError) as exc:
            raise StageUnavailableError(
                self.rank, f"no reply on {subject} within {self.timeout_s}s"
            ) from exc
        return reply.data
