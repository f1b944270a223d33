"""The NATS ``StageClient``: request-reply to the stage's KV subjects with a timeout; and
``serve_stage_kv``, the stage side of those subjects without a whole stage process.

A round's batch goes to all S stages at once (``NatsStageClient.call_batch_all``): S publishes
whose replies come back on one reply subscription per connection, into one future, under one
timer. (``nc.request`` per stage costs a task, a random token, a future with its callback and a
timer each: most of a round's fixed cost in the controller.)
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Sequence

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
    nc: NATS,
    subject_prefix: str,
    rank: int,
    manager: StageKVManager,
    *,
    handler_cpu_s: list[float] | None = None,
) -> list[Subscription]:
    """Answer a stage's agreement endpoints (JSON single requests and binary rounds) from
    ``manager`` on ``nc``: what a stage process does, for benchmarks and tests that run the
    KV side without a whole stage. Returns the subscriptions (unsubscribe to stop).

    ``handler_cpu_s``: a one-element list the CPU seconds (``time.process_time``) spent in
    ``handle_kv_batch`` are added to (a benchmark's split of its process's CPU)."""
    subjects = ReplicaSubjects(subject_prefix)

    async def on_kv(msg: Msg) -> None:
        await msg.respond(handle_kv_request(manager, rank, msg.data).model_dump_json().encode())

    async def on_batch(msg: Msg) -> None:
        if handler_cpu_s is None:
            await msg.respond(handle_kv_batch(manager, rank, msg.data))
            return
        started_s = time.process_time()
        reply = handle_kv_batch(manager, rank, msg.data)
        handler_cpu_s[0] += time.process_time() - started_s
        await msg.respond(reply)

    return [
        await nc.subscribe(subjects.stage_kv(rank), cb=on_kv),
        await nc.subscribe(subjects.stage_kv_batch(rank), cb=on_batch),
    ]


_NO_RESPONDERS = "503"


class _Call:
    __slots__ = ("future", "replies", "missing", "clients")

    def __init__(self, future: asyncio.Future[list[bytes]], clients: Sequence[NatsStageClient]):
        self.future = future
        self.clients = clients
        self.replies: list[bytes | None] = [None] * len(clients)
        self.missing = len(clients)


class _BatchMux:
    """One reply subscription (``{inbox}.>``) per connection for batch calls: a call's replies
    arrive on ``{inbox}.{call}.{index}`` and complete one future."""

    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        self._prefix = ""
        self._ready: asyncio.Future[None] | None = None
        self._calls: dict[str, _Call] = {}
        self._next_call = 0

    async def _subscribe(self) -> None:
        if self._ready is None:
            self._ready = asyncio.get_running_loop().create_future()
            try:
                inbox = self.nc.new_inbox()
                await self.nc.subscribe(f"{inbox}.>", cb=self._on_reply)
                self._prefix = f"{inbox}."
                self._ready.set_result(None)
            except BaseException as exc:
                self._ready.set_exception(exc)
                self._ready = None
                raise
        elif not self._ready.done():
            await asyncio.shield(self._ready)

    async def call(self, clients: Sequence[NatsStageClient], payload: bytes) -> list[bytes]:
        if not self._prefix:
            await self._subscribe()
        self._next_call += 1
        key = str(self._next_call)
        loop = asyncio.get_running_loop()
        call = _Call(loop.create_future(), clients)
        self._calls[key] = call
        reply_prefix = f"{self._prefix}{key}."
        timeout_s = min(client.timeout_s for client in clients)
        timer = loop.call_later(timeout_s, self._time_out, key)
        try:
            for index, client in enumerate(clients):
                await self.nc.publish(client.batch_subject, payload, reply=f"{reply_prefix}{index}")
            try:
                # a round lost with a dying server fails at the reconnect, as `_request` does
                return await fail_on_reconnect(self.nc, lambda: call.future)
            except ReconnectedError as exc:
                rank = clients[call.replies.index(None)].rank if None in call.replies else -1
                raise StageUnavailableError(
                    rank, "no reply to a batched round: NATS reconnected meanwhile"
                ) from exc
        finally:
            timer.cancel()
            self._calls.pop(key, None)

    def _time_out(self, key: str) -> None:
        call = self._calls.get(key)
        if call is None or call.future.done():
            return
        index = call.replies.index(None)
        client = call.clients[index]
        call.future.set_exception(
            StageUnavailableError(
                client.rank, f"no reply on {client.batch_subject} within {client.timeout_s}s"
            )
        )

    async def _on_reply(self, msg: Msg) -> None:
        key, _, index_text = msg.subject[len(self._prefix) :].partition(".")
        call = self._calls.get(key)
        if call is None or call.future.done() or not index_text.isdigit():
            return
        index = int(index_text)
        if index >= len(call.replies) or call.replies[index] is not None:
            return
        client = call.clients[index]
        if msg.headers and msg.headers.get("Status") == _NO_RESPONDERS:
            call.future.set_exception(
                StageUnavailableError(client.rank, f"no stage listens on {client.batch_subject}")
            )
            return
        call.replies[index] = msg.data
        call.missing -= 1
        if not call.missing:
            call.future.set_result(call.replies)  # type: ignore[arg-type]


_MUXES: weakref.WeakKeyDictionary[NATS, _BatchMux] = weakref.WeakKeyDictionary()


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
        mux = _MUXES.get(nc)
        if mux is None:
            mux = _MUXES[nc] = _BatchMux(nc)
        self.batch_mux = mux  # shared by the clients of one connection

    async def call(self, msg: KVRequestMessage) -> KVReply:
        data = await self._request(self.subject, msg.model_dump_json().encode())
        return KVReply.model_validate_json(data)

    async def call_batch(self, payload: bytes) -> bytes:
        return (await self.batch_mux.call([self], payload))[0]

    @staticmethod
    async def call_batch_all(clients: Sequence[NatsStageClient], payload: bytes) -> list[bytes]:
        """``call_batch`` to every client at once, in order (clients of one connection: one
        reply subscription, one future, one timer at the smallest ``timeout_s``).

        Raises:
            StageUnavailableError: naming the first stage that has no listener or did not answer
                in time.
        """
        mux = clients[0].batch_mux
        if any(client.batch_mux is not mux for client in clients):
            return list(await asyncio.gather(*(client.call_batch(payload) for client in clients)))
        return await mux.call(clients, payload)

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
