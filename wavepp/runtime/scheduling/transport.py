"""How the scheduler reaches the stages: a small protocol, and its implementation over a bus.

    scheduler --publish_plan-->  {p}.plan            (every stage)
    scheduler <--on_done-------  {p}.done            (each stage, each micro-batch)
    scheduler <--on_plan_resend- {p}.plan.resend     (a stage that missed plans asks)
    scheduler <--on_resync-----  {p}.resync          (a stage reconnected)
    scheduler --request_dones--> {p}.stage.{r}.dones (ask a stage for done messages again)
    scheduler <--on_reconnected- the connection came back

``BusPlanTransport`` speaks this over anything with the nats.py client's surface
(``subscribe(subject, cb=)``, ``publish``, ``request``, ``flush``): the simulator's ``SimBus``
as is; ``nats_transport.NatsPlanTransport`` adds NATS's reconnect callback. This module imports
no NATS module (the simulator uses it).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel

from wavepp.api.messages import (
    DoneResend,
    DoneResendReply,
    MicroBatchDone,
    MicroBatchPlan,
    PlanResend,
    PlanResendReply,
    StageResync,
)
from wavepp.api.subjects import ReplicaSubjects

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)


class PlanHandlers(Protocol):
    """What the scheduler offers its transport (messages already decoded)."""

    async def on_done(self, done: MicroBatchDone) -> None: ...

    def on_plan_resend(self, ask: PlanResend) -> PlanResendReply: ...

    def on_resync(self, notice: StageResync) -> None: ...

    async def on_reconnected(self) -> None: ...


class PlanTransport(Protocol):
    """The scheduler's side of plan and done delivery; see the module docstring."""

    async def start(self, handlers: PlanHandlers) -> None:
        """Subscribe to done, plan-resend and resync messages; call back on reconnect."""
        ...

    async def publish_plan(
        self, plan: MicroBatchPlan, headers: dict[str, str] | None, data: bytes | None = None
    ) -> None:
        """Send one plan to every stage (``headers``: trace context, may be None; ``data``:
        the plan's JSON when the caller has it already, else the transport serialises it)."""
        ...

    async def request_dones(self, rank: int, ask: DoneResend, timeout_s: float) -> DoneResendReply:
        """Ask stage ``rank`` for done messages again.

        Raises:
            Exception: no answer (the caller logs it; the stage resyncs when it reconnects).
        """
        ...

    async def subscribe(self, subject: str, cb: Callable[[Any], Awaitable[None]]) -> Any:
        """A raw subscription for side listeners (the telemetry's KV events)."""
        ...

    async def close(self) -> None:
        """Unsubscribe everything ``start`` and ``subscribe`` opened."""
        ...


def decode(model: type[M], data: bytes, what: str) -> M | None:
    """``model`` from JSON, or None (logged) for an invalid message."""
    try:
        return model.model_validate_json(data)
    except ValueError as exc:
        log.error("invalid %s dropped: %s", what, exc)
        return None


class BusPlanTransport:
    """``PlanTransport`` over a bus with the nats.py client's surface.

    Args:
        bus: a connected client (owned by the caller).
        subjects: the replica's subject names.
    """

    def __init__(self, bus: Any, subjects: ReplicaSubjects) -> None:
        self.bus = bus
        self.subjects = subjects
        self._subs: list[Any] = []

    async def start(self, handlers: PlanHandlers) -> None:
        async def on_done(msg: Any) -> None:
            done = decode(MicroBatchDone, msg.data, "done message")
            if done is not None:
                await handlers.on_done(done)

        async def on_plan_resend(msg: Any) -> None:
            ask = decode(PlanResend, msg.data, "plan resend ask")
            if ask is not None:
                reply = handlers.on_plan_resend(ask)
                await msg.respond(reply.model_dump_json().encode())

        async def on_resync(msg: Any) -> None:
            notice = decode(StageResync, msg.data, "resync notice")
            if notice is not None:
                handlers.on_resync(notice)

        self._subs.append(await self.bus.subscribe(self.subjects.done, cb=on_done))
        self._subs.append(await self.bus.subscribe(self.subjects.plan_resend, cb=on_plan_resend))
        self._subs.append(await self.bus.subscribe(self.subjects.resync, cb=on_resync))
        self._on_reconnect(handlers.on_reconnected)
        # twice: nats-py writes a flush's PING ahead of the SUBs still pending, so one PONG does
        # not prove them live (natsio.flush_in_order, which the simulator may not import)
        await self.bus.flush()
        await self.bus.flush()

    def _on_reconnect(self, cb: Callable[[], Awaitable[None]]) -> None:
        """A bus that never disconnects (the simulator's) never calls back."""

    async def publish_plan(
        self, plan: MicroBatchPlan, headers: dict[str, str] | None, data: bytes | None = None
    ) -> None:
        if data is None:
            data = plan.model_dump_json().encode()
        await self.bus.publish(self.subjects.plan, data, headers=headers)

    async def request_dones(self, rank: int, ask: DoneResend, timeout_s: float) -> DoneResendReply:
        msg = await self.bus.request(
            self.subjects.stage_dones(rank), ask.model_dump_json().encode(), timeout=timeout_s
        )
        return DoneResendReply.model_validate_json(msg.data)

    async def subscribe(self, subject: str, cb: Callable[[Any], Awaitable[None]]) -> Any:
        sub = await self.bus.subscribe(subject, cb=cb)
        self._subs.append(sub)
        return sub

    async def close(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs = []
