"""The scheduler's record of published micro-batch plans and which stages reported them done.

Pure logic, no I/O. The scheduler keeps every plan here from publish until all S stages reported
it done (or it expired), so that

* a stage that missed a plan (a NATS reconnect) gets it resent (:meth:`PlanLedger.resend`),
* a done message that arrives twice (a resend answer and a late original) counts once
  (:meth:`PlanLedger.report`),
* a done message lost on the way is noticed: stages report micro-batches in id order, so when
  rank r reports m, every earlier outstanding micro-batch r has not reported is missing
  (:meth:`PlanLedger.missing_before`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Generic, TypeVar

P = TypeVar("P")


class Report(Enum):
    """What one done message meant to the ledger."""

    FIRST = "first"  # a new (micro-batch, rank) report; others still outstanding
    LAST = "last"  # a new report that completed the micro-batch on every stage
    DUPLICATE = "duplicate"  # this rank already reported it
    UNKNOWN = "unknown"  # not outstanding: completed earlier or expired


@dataclass
class _Entry(Generic[P]):
    plan: P
    owners: list[str]  # request id of each chunk, in plan order
    reported: set[int] = field(default_factory=set)


class PlanLedger(Generic[P]):
    """Outstanding micro-batches of one scheduler, in publish (id) order.

    Args:
        num_stages: S; a micro-batch completes when ranks 0..S-1 all reported it.
    """

    def __init__(self, num_stages: int) -> None:
        if num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {num_stages}")
        self.num_stages = num_stages
        self._entries: dict[int, _Entry[P]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, microbatch_id: object) -> bool:
        return microbatch_id in self._entries

    def published(self, microbatch_id: int, plan: P, owners: list[str]) -> None:
        """Record a plan at publish; ids must grow.

        Raises:
            ValueError: an id not above every outstanding id.
        """
        if self._entries and microbatch_id <= max(self._entries):
            raise ValueError(
                f"microbatch_id {microbatch_id} must exceed the outstanding {max(self._entries)}"
            )
        self._entries[microbatch_id] = _Entry(plan, list(owners))

    def owners(self, microbatch_id: int) -> list[str]:
        """Request id of each chunk of an outstanding micro-batch ([] when not outstanding)."""
        entry = self._entries.get(microbatch_id)
        return list(entry.owners) if entry is not None else []

    def plan(self, microbatch_id: int) -> P | None:
        """The plan of an outstanding micro-batch (None when not outstanding)."""
        entry = self._entries.get(microbatch_id)
        return entry.plan if entry is not None else None

    def num_reports(self, microbatch_id: int) -> int:
        entry = self._entries.get(microbatch_id)
        return len(entry.reported) if entry is not None else 0

    def report(self, microbatch_id: int, rank: int) -> Report:
        """Count rank's done for a micro-batch once; forget the plan when all S reported.

        Raises:
            ValueError: rank outside [0, S).
        """
        if not 0 <= rank < self.num_stages:
            raise ValueError(f"rank must be in [0, {self.num_stages}), got {rank}")
        entry = self._entries.get(microbatch_id)
        if entry is None:
            return Report.UNKNOWN
        if rank in entry.reported:
            return Report.DUPLICATE
        entry.reported.add(rank)
        if len(entry.reported) == self.num_stages:
            del self._entries[microbatch_id]
            return Report.LAST
        return Report.FIRST

    def report_pending(self, microbatch_id: int, rank: int) -> bool:
        """True when ``microbatch_id`` is outstanding and ``rank`` has not reported it."""
        entry = self._entries.get(microbatch_id)
        return entry is not None and rank not in entry.reported

    def drop(self, microbatch_id: int) -> None:
        """Forget a micro-batch (it expired); a later done for it is UNKNOWN."""
        self._entries.pop(microbatch_id, None)

    def missing_before(self, rank: int, microbatch_id: int) -> list[int]:
        """Outstanding ids below ``microbatch_id`` that ``rank`` has not reported, ascending."""
        missing = []
        for mb, entry in self._entries.items():
            if mb >= microbatch_id:
                break
            if rank not in entry.reported:
                missing.append(mb)
        return missing

    def unreported(self, rank: int) -> list[int]:
        """Every outstanding id ``rank`` has not reported, ascending."""
        return [mb for mb, entry in self._entries.items() if rank not in entry.reported]

    def resend(self, from_id: int, to_id: int | None = None) -> list[tuple[int, P]]:
        """The outstanding plans with ``from_id <= id < to_id`` (no bound when None), ascending."""
        return [
            (mb, entry.plan)
            for mb, entry in self._entries.items()
            if mb >= from_id and (to_id is None or mb < to_id)
        ]

    def clear(self) -> list[int]:
        """Forget every outstanding micro-batch (the stages re-formed); returns their ids."""
        ids = list(self._entries)
        self._entries.clear()
        return ids
