"""The NATS ``StageClient``: request-reply to the stage's KV subject with a timeout."""

from __future__ import annotations

from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from wavepp.api.messages import (
    KVReply,
    KVRequestMessage,
)
from wavepp.api.subjects import ReplicaSubjects
from wavepp.runtime.agreement.clients import StageUnavailableError


class NatsStageClient:
    """Request-reply to ``{prefix}.stage.{rank}.kv`` with a timeout.

    Raises:
        StageUnavailableError: nobody listens on the subject (a configuration fault), or no reply
            within ``timeout_s`` (a slow or dead stage).
    """

    def __init__(self, nc: NATS, subject_prefix: str, rank: int, timeout_s: float = 10.0) -> None:
        self.nc = nc
        self.rank = rank
        self.subject = ReplicaSubjects(subject_prefix).stage_kv(rank)
        self.timeout_s = timeout_s

    async def call(self, msg: KVRequestMessage) -> KVReply:
        try:
            reply = await self.nc.request(
                self.subject, msg.model_dump_json().encode(), timeout=self.timeout_s
            )
        except NoRespondersError as exc:
            raise StageUnavailableError(self.rank, f"no stage listens on {self.subject}") from exc
        except (TimeoutError, NatsTimeoutError) as exc:
            raise StageUnavailableError(
                self.rank, f"no reply on {self.subject} within {self.timeout_s}s"
            ) from exc
        return KVReply.model_validate_json(reply.data)
