"""The NATS ``StageClient``: request-reply to the stage's KV subjects with a timeout; and
``serve_stage_kv``, the stage side of those subjects without a whole stage process.

A round's batch goes to all S stages of a replica with one publish on the replica-wide subject
``{p}.stages.kvb`` (``NatsStageClient.call_batch_all`` over clients made by
``NatsStageClient.for_replica``): every stage subscribes to it and answers on the one reply
subject with its rank in the reply, and the replies come back on one reply subscription per
connection, into one future, under one timer. (S publishes of the same payload, or
``nc.request`` per stage with a task, a token, a future and a timer each, were most of a round's
fixed cost in the controller.) A stage that misses the round is named: no listener on the
subject at all (the call is sent again per stage, ``{p}.stage.{r}.kvb``, which names the first
stage without one), no reply within ``timeout_s``, or, after ``liveness_check_s`` without its
reply, no listener on its own ``{p}.stage.{r}.kv`` (a read-only health ask: a stage that died
is named at once, not after the time-out). Clients that are not one whole replica (a subset, a
single ``call_batch``) keep one publish per stage on the per-stage subjects.

With the replica's bus key (``reply_key``) a call takes only replies tagged for its batch and
the rank they name (``kv_reply_tag.verify_reply``): the stages share one reply subject that anyone
who hears the round learns, so without NATS auth (``wavepp up --insecure-nats``) any client could
answer first for any rank. A reply whose tag is missing or wrong is dropped (counted in
``_BatchMux.num_dropped_replies``, logged once per call) and the call keeps waiting for that
stage's own; without a key every reply is taken (unsigned, as the batches). A no-responders
status (503) cannot be tagged: it is taken as it comes (see docs/architecture.md's trust table).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Sequence

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from wavepp.api.kv_reply import reply_rank
from wavepp.api.kv_reply_tag import batch_reply_tag_prefix, verify_reply
from wavepp.api.messages import (
    Health,
    KVReply,
    KVRequestMessage,
)
from wavepp.api.signing import BusKey
from wavepp.api.subjects import ReplicaSubjects
from wavepp.runtime.agreement.clients import StageUnavailableError
from wavepp.runtime.agreement.stage_handler import handle_kv_batch, handle_kv_request
from wavepp.runtime.heap import collect_young_soon
from wavepp.runtime.kv import StageKVManager
from wavepp.runtime.transport.natsio import ReconnectedError, fail_on_reconnect

LIVENESS_CHECK_S = 0.25
"""A fan-out round still missing a stage's reply after this long asks that stage's own KV
subject whether anyone listens (again every as long, until the time-out)."""

LATE_S = 0.1
"""A call's time-out timer that runs more than this after its deadline was held up by the
caller's own event loop (a callback that blocked it): the stages' replies may wait unread in
the socket. The call is then given ``LIVENESS_CHECK_S`` more of a running loop, again each
time that timer runs late too, these graces adding up to at most ``timeout_s`` rounded up to
a whole ``LIVENESS_CHECK_S``, before a stage is named (the error says how many seconds of
graces it was given); a timer on time names it at once. However long the caller blocked, a stage is blamed
only for time its replies could have been read."""

_HEALTH = Health().model_dump_json().encode()

log = logging.getLogger(__name__)


async def serve_stage_kv(
    nc: NATS,
    subject_prefix: str,
    rank: int,
    manager: StageKVManager,
    *,
    bus_key: BusKey | None = None,
    handler_cpu_s: list[float] | None = None,
) -> list[Subscription]:
    """Answer a stage's agreement endpoints (JSON single requests and binary rounds, on its own
    subjects and on the replica-wide ``{p}.stages.kvb``) from ``manager`` on ``nc``: what a stage
    process does, for benchmarks and tests that run the KV side without a whole stage.
    ``bus_key``: the replica's key (unsigned or repeated messages refused), None: insecure.
    ``handler_cpu_s``: a one-element list the CPU seconds (``time.process_time``) spent in
    ``handle_kv_batch`` are added to (a benchmark's split of its process's CPU).
    Returns the subscriptions (unsubscribe to stop)."""
    subjects = ReplicaSubjects(subject_prefix)

    async def on_kv(msg: Msg) -> None:
        reply = handle_kv_request(manager, rank, msg.data, bus_key=bus_key)
        await msg.respond(reply.model_dump_json().encode())

    async def on_batch(msg: Msg) -> None:
        if handler_cpu_s is None:
            await msg.respond(handle_kv_batch(manager, rank, msg.data, bus_key=bus_key))
        else:
            started_s = time.process_time()
            reply = handle_kv_batch(manager, rank, msg.data, bus_key=bus_key)
            handler_cpu_s[0] += time.process_time() - started_s
            await msg.respond(reply)
        collect_young_soon()  # answered: the young generation now, not inside a later round

    return [
        await nc.subscribe(subjects.stage_kv(rank), cb=on_kv),
        await nc.subscribe(subjects.stage_kv_batch(rank), cb=on_batch),
        await nc.subscribe(subjects.stages_kv_batch, cb=on_batch),  # a round to every stage
    ]


_NO_RESPONDERS = "503"


class _NobodyListens(Exception):
    """No subscriber at all on a fan-out subject: nobody received the round."""


class _Call:
    __slots__ = (
        "future",
        "replies",
        "missing",
        "clients",
        "fanout",
        "index_of",
        "check",
        "reply_key",
        "tag_prefix",
        "dropped",
        "timer",
        "graces",
    )

    def __init__(
        self,
        future: asyncio.Future[list[bytes]],
        clients: Sequence[NatsStageClient],
        fanout: str | None,
        reply_key: BusKey | None = None,
        tag_prefix: bytes = b"",
    ) -> None:
        self.future = future
        self.clients = clients
        self.fanout = fanout
        self.replies: list[bytes | None] = [None] * len(clients)
        self.missing = len(clients)
        # a fan-out's replies share one subject: the rank in each tells where it goes
        self.index_of = {client.rank: i for i, client in enumerate(clients)} if fanout else {}
        self.check: asyncio.TimerHandle | None = None
        self.reply_key = reply_key  # with a key: only replies tagged for this batch and rank
        self.tag_prefix = tag_prefix
        self.dropped: list[int] | None = None  # per client: replies dropped (tag missing/wrong)
        self.timer: asyncio.TimerHandle | None = None  # the time-out (``_BatchMux._time_out``)
        self.graces = 0  # time-outs put off because their timer ran late (LATE_S)


class _BatchMux:
    """One reply subscription (``{inbox}.>``) per connection for batch calls: a call's replies
    arrive on ``{inbox}.{call}.{index}`` (one publish per stage), ``{inbox}.{call}`` (one fan-out
    publish; the rank is in the reply) or ``{inbox}.{call}.h{index}`` (the health ask of a
    stage whose fan-out reply is late), and complete one future."""

    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        self._prefix = ""
        self._ready: asyncio.Future[None] | None = None
        self._calls: dict[str, _Call] = {}
        self._next_call = 0
        self._background: set[asyncio.Task[None]] = set()
        self.num_dropped_replies = 0  # replies whose tag did not verify (forged, or another key)

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

    async def call_fanout(
        self,
        clients: Sequence[NatsStageClient],
        payload: bytes,
        subject: str,
        *,
        reply_key: BusKey | None = None,
    ) -> list[bytes]:
        """``payload`` to every client's stage with one publish on ``subject``; sent again one
        publish per stage when nobody at all listens there (nobody received it)."""
        try:
            return await self.call(clients, payload, fanout=subject, reply_key=reply_key)
        except _NobodyListens:
            return await self.call(clients, payload, reply_key=reply_key)

    async def call(
        self,
        clients: Sequence[NatsStageClient],
        payload: bytes,
        *,
        fanout: str | None = None,
        reply_key: BusKey | None = None,
    ) -> list[bytes]:
        """``payload`` (an encoded ``KVBatch``) to ``clients``; their replies in their order.
        ``reply_key``: the replica's bus key: only replies tagged for this batch are taken.

        Raises:
            ValueError: ``reply_key`` with a payload that is not a batch (no owner and seq).
        """
        tag_prefix = b""
        if reply_key is not None:
            prefix = batch_reply_tag_prefix(payload)
            if prefix is None:
                raise ValueError("payload: not a KV batch (no owner and seq to check replies by)")
            tag_prefix = prefix
        if not self._prefix:
            await self._subscribe()
        self._next_call += 1
        key = str(self._next_call)
        loop = asyncio.get_running_loop()
        call = _Call(loop.create_future(), clients, fanout, reply_key, tag_prefix)
        self._calls[key] = call
        reply_prefix = f"{self._prefix}{key}"
        timeout_s = min(client.timeout_s for client in clients)
        call.timer = loop.call_later(timeout_s, self._time_out, key, timeout_s)
        try:
            if fanout is not None:
                check_s = min(client.liveness_check_s for client in clients)
                if check_s < timeout_s:
                    call.check = loop.call_later(check_s, self._check_liveness, key, check_s)
                await self.nc.publish(fanout, payload, reply=reply_prefix)
            else:
                for index, client in enumerate(clients):
                    await self.nc.publish(
                        client.batch_subject, payload, reply=f"{reply_prefix}.{index}"
                    )
            try:
                # a round lost with a dying server fails at the reconnect, as `_request` does
                return await fail_on_reconnect(self.nc, lambda: call.future)
            except ReconnectedError as exc:
                rank = clients[call.replies.index(None)].rank if None in call.replies else -1
                raise StageUnavailableError(
                    rank, "no reply to a batched round: NATS reconnected meanwhile"
                ) from exc
        finally:
            if call.timer is not None:
                call.timer.cancel()
            if call.check is not None:
                call.check.cancel()
            self._calls.pop(key, None)

    def _time_out(self, key: str, timeout_s: float) -> None:
        """Fail call ``key`` naming its first stage without a reply; unless this timer ran
        late (``LATE_S``: the caller's loop was blocked, a reply may be unread), then again
        after ``LIVENESS_CHECK_S``, at most ``timeout_s`` of such graces in all."""
        call = self._calls.get(key)
        if call is None or call.future.done():
            return
        loop = asyncio.get_running_loop()
        late = call.timer is not None and loop.time() - call.timer.when() > LATE_S
        if late and call.graces * LIVENESS_CHECK_S < timeout_s:
            call.graces += 1
            call.timer = loop.call_later(LIVENESS_CHECK_S, self._time_out, key, timeout_s)
            return
        index = call.replies.index(None)
        client = call.clients[index]
        subject = call.fanout or client.batch_subject
        detail = f"no reply on {subject} within {client.timeout_s}s"
        if call.graces:
            detail += (
                f" and {call.graces * LIVENESS_CHECK_S:g}s of graces (this caller's event loop"
                " ran its time-out late)"
            )
        if call.dropped is not None and call.dropped[index]:
            detail += (
                f" ({call.dropped[index]} dropped: tag missing or wrong; a stage of an earlier"
                " release or with another bus key, or a forger)"
            )
        call.future.set_exception(StageUnavailableError(client.rank, detail))

    def _check_liveness(self, key: str, every_s: float) -> None:
        """Ask each stage still missing from fan-out round ``key`` for its health on its own
        subject: a no-responders answer fails the round naming it (``_on_reply``)."""
        call = self._calls.get(key)
        if call is None or call.future.done():
            return
        for index, reply in enumerate(call.replies):
            if reply is None:
                task = asyncio.ensure_future(
                    self.nc.publish(
                        call.clients[index].subject, _HEALTH, reply=f"{self._prefix}{key}.h{index}"
                    )
                )
                self._background.add(task)
                task.add_done_callback(self._background.discard)
                task.add_done_callback(lambda t: t.cancelled() or t.exception())
        call.check = asyncio.get_running_loop().call_later(
            every_s, self._check_liveness, key, every_s
        )

    async def _on_reply(self, msg: Msg) -> None:
        key, _, tail = msg.subject[len(self._prefix) :].partition(".")
        call = self._calls.get(key)
        if call is None or call.future.done():
            return
        no_responders = bool(msg.headers) and msg.headers.get("Status") == _NO_RESPONDERS
        if not tail:  # a fan-out reply: the stage's rank is in it
            if no_responders:
                call.future.set_exception(_NobodyListens())
                return
            index = call.index_of.get(reply_rank(msg.data), -1)  # type: ignore[arg-type]
        elif tail[0] == "h":  # a late stage's health: only its absence matters
            if no_responders and tail[1:].isdigit() and int(tail[1:]) < len(call.clients):
                client = call.clients[int(tail[1:])]
                if call.replies[int(tail[1:])] is None:
                    call.future.set_exception(
                        StageUnavailableError(
                            client.rank,
                            f"no stage listens on {client.subject} (no reply on {call.fanout})",
                        )
                    )
            return
        elif tail.isdigit():
            index = int(tail)
            if no_responders and index < len(call.clients):
                client = call.clients[index]
                call.future.set_exception(
                    StageUnavailableError(
                        client.rank, f"no stage listens on {client.batch_subject}"
                    )
                )
                return
        else:
            return
        if not 0 <= index < len(call.replies) or call.replies[index] is not None:
            return  # not a stage of this call, or a second reply for one: the first stands
        if call.reply_key is not None and not verify_reply(
            msg.data, call.reply_key, call.tag_prefix, call.clients[index].rank
        ):
            self._drop(call, index)  # forged (or another key's): wait for the stage's own
            return
        call.replies[index] = msg.data
        call.missing -= 1
        if not call.missing:
            call.future.set_result(call.replies)  # type: ignore[arg-type]

    def _drop(self, call: _Call, index: int) -> None:
        self.num_dropped_replies += 1
        if call.dropped is None:
            call.dropped = [0] * len(call.clients)
            log.warning(
                "a reply naming stage %d on %s did not verify (tag missing or wrong: a stage "
                "with another bus key, or a forger answering for it); "
                "dropped, waiting for the stage's own (logged once per round)",
                call.clients[index].rank,
                call.fanout or call.clients[index].batch_subject,
            )
        call.dropped[index] += 1


_MUXES: weakref.WeakKeyDictionary[NATS, _BatchMux] = weakref.WeakKeyDictionary()


class NatsStageClient:
    """Request-reply to ``{prefix}.stage.{rank}.kv`` (and ``.kvb``) with a timeout.

    ``num_stages``: the replica's number of stages, when this client is one of a whole
    replica's (``for_replica``): ``call_batch_all`` over all of them then publishes once on
    ``{prefix}.stages.kvb``. ``liveness_check_s``: see ``LIVENESS_CHECK_S``.

    Raises:
        StageUnavailableError: nobody listens on the subject (a configuration fault, or a stage
            that died), no reply within ``timeout_s`` (a slow or dead stage), or NATS
            reconnected while it waited (the request or its reply may be lost with the server;
            the callers retry).
    """

    def __init__(
        self,
        nc: NATS,
        subject_prefix: str,
        rank: int,
        timeout_s: float = 10.0,
        *,
        num_stages: int | None = None,
        liveness_check_s: float = LIVENESS_CHECK_S,
    ) -> None:
        if num_stages is not None and not 0 <= rank < num_stages:
            raise ValueError(f"rank={rank}: must be in [0, num_stages={num_stages})")
        if not liveness_check_s > 0:
            raise ValueError(f"liveness_check_s={liveness_check_s}: must be > 0")
        self.nc = nc
        self.rank = rank
        subjects = ReplicaSubjects(subject_prefix)
        self.subject = subjects.stage_kv(rank)
        self.batch_subject = subjects.stage_kv_batch(rank)
        self.fanout_subject = subjects.stages_kv_batch
        self.num_stages = num_stages
        self.timeout_s = timeout_s
        self.liveness_check_s = liveness_check_s
        mux = _MUXES.get(nc)
        if mux is None:
            mux = _MUXES[nc] = _BatchMux(nc)
        self.batch_mux = mux  # shared by the clients of one connection

    @classmethod
    def for_replica(
        cls,
        nc: NATS,
        subject_prefix: str,
        num_stages: int,
        timeout_s: float = 10.0,
        *,
        liveness_check_s: float = LIVENESS_CHECK_S,
    ) -> list[NatsStageClient]:
        """One client per rank of a replica of ``num_stages`` stages, in rank order: a round to
        all of them is one publish (``call_batch_all``)."""
        return [
            cls(
                nc,
                subject_prefix,
                rank,
                timeout_s,
                num_stages=num_stages,
                liveness_check_s=liveness_check_s,
            )
            for rank in range(num_stages)
        ]

    async def call(self, msg: KVRequestMessage) -> KVReply:
        data = await self._request(self.subject, msg.model_dump_json().encode())
        return KVReply.model_validate_json(data)

    async def call_batch(self, payload: bytes, *, reply_key: BusKey | None = None) -> bytes:
        """Send one encoded ``KVBatch`` to this stage; its reply. ``reply_key``: see
        ``call_batch_all``."""
        return (await self.batch_mux.call([self], payload, reply_key=reply_key))[0]

    @staticmethod
    async def call_batch_all(
        clients: Sequence[NatsStageClient], payload: bytes, *, reply_key: BusKey | None = None
    ) -> list[bytes]:
        """``call_batch`` to every client at once; replies in the clients' order. Clients of one
        connection share one reply subscription, one future, one timer at the smallest
        ``timeout_s``; when they are every stage of one replica (``for_replica``), one publish
        on ``{prefix}.stages.kvb`` reaches them all. ``reply_key``: the replica's bus key (the
        one ``payload`` is signed with): a reply not tagged for this batch and the rank it names
        is dropped and the stage's own awaited (``kv_reply_tag.verify_reply``); None takes any.

        Raises:
            StageUnavailableError: naming the first stage that has no listener or did not answer
                in time (with a key: no reply tagged for it; the time-out names those dropped).
            ValueError: ``reply_key`` with a ``payload`` that is not a batch.
        """
        first = clients[0]
        mux = first.batch_mux
        if any(client.batch_mux is not mux for client in clients):
            return list(
                await asyncio.gather(
                    *(client.call_batch(payload, reply_key=reply_key) for client in clients)
                )
            )
        if _whole_replica(clients):
            return await mux.call_fanout(
                clients, payload, first.fanout_subject, reply_key=reply_key
            )
        return await mux.call(clients, payload, reply_key=reply_key)

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


def _whole_replica(clients: Sequence[NatsStageClient]) -> bool:
    """Whether ``clients`` are every stage of one replica, each once: a fan-out publish would
    reach exactly them."""
    first = clients[0]
    num_stages = first.num_stages
    return (
        num_stages == len(clients)
        and all(
            c.num_stages == num_stages and c.fanout_subject == first.fanout_subject for c in clients
        )
        and len({c.rank for c in clients}) == num_stages
    )
