"""Gap-free, in-order, exactly-once delivery of micro-batch plans to a stage (pure logic, no I/O).

Plans travel on core NATS (at most once): a plan in flight when the server restarts, or published
while a stage reconnects, is lost for that stage. Every stage must run every plan in the same
order, or the activations on the wire between two stages belong to the wrong micro-batch. So a
stage runs plans through a :class:`PlanSequencer`:

* plans carry the scheduler's ``epoch`` (one per scheduler instance) and an id that grows by one
  per plan within the epoch;
* a plan is handed to the compute thread only when every earlier id of its epoch was handed over
  or is known to be gone; a later plan is held meanwhile;
* a hole (``gap()``) is filled by asking the scheduler to resend it: the scheduler retains each
  plan until every stage reported it done (or it expired), so the reply is authoritative — an id
  below the scheduler's next id that the reply does not carry is gone (:meth:`settle`);
* duplicates (a republished or resent plan) are dropped.

A new epoch (a new scheduler) resets the sequence to id 0, so the first plan of an epoch opens
a gap ``[0, first id)`` that one resend settles (normally with no plans).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Generic, TypeVar

T = TypeVar("T")


class PlanSequencer(Generic[T]):
    """Orders items by ``(epoch, id)``; see the module docstring.

    Attributes:
        epoch: the current epoch ("" before the first plan).
        next_id: the lowest id not yet handed over or settled as gone.
        num_duplicates: items dropped as already handed over or held.
        num_skipped: ids settled as gone after this epoch's first delivery (expired at the
            scheduler before this stage got them); the ids below an epoch's first plan are not
            counted.
    """

    def __init__(self) -> None:
        self.epoch = ""
        self.next_id = 0
        self._held: dict[int, T] = {}
        self.num_duplicates = 0
        self.num_skipped = 0
        self._delivered_in_epoch = False

    @property
    def num_held(self) -> int:
        return len(self._held)

    def offer(self, epoch: str, item_id: int, item: T) -> list[T]:
        """Take one item; return the items now deliverable, in id order (maybe empty).

        An item of a new epoch drops everything held of the old one and restarts at id 0.

        Raises:
            ValueError: ``item_id`` < 0.
        """
        if item_id < 0:
            raise ValueError(f"microbatch_id must be >= 0, got {item_id}")
        if epoch != self.epoch:
            self.epoch = epoch
            self.next_id = 0
            self._held.clear()
            self._delivered_in_epoch = False
        if item_id < self.next_id or item_id in self._held:
            self.num_duplicates += 1
            return []
        self._held[item_id] = item
        return self._drain(limit=self.next_id)

    def gap(self) -> tuple[int, int] | None:
        """The first hole ``[next_id, lowest held id)``, or None when nothing waits on one."""
        if not self._held:
            return None
        lowest = min(self._held)
        return (self.next_id, lowest) if lowest > self.next_id else None

    def settle(self, epoch: str, limit: int, items: Iterable[tuple[int, T]]) -> list[T]:
        """Apply an authoritative resend: ``items`` are all the plans the scheduler still holds
        in the resent range, and every other id below ``limit`` is gone.

        Returns the items now deliverable, in id order. A reply for another epoch changes
        nothing (the stage moved on).
        """
        if epoch != self.epoch:
            return []
        for item_id, item in items:
            if item_id >= self.next_id:
                self._held.setdefault(item_id, item)
        return self._drain(limit=limit)

    def flush_held(self) -> list[T]:
        """Give up on the holes: hand over everything held, in id order, skipping the ids not
        held (used when the epoch's scheduler is gone and nobody can resend them)."""
        if not self._held:
            return []
        return self._drain(limit=max(self._held) + 1)

    def _drain(self, *, limit: int) -> list[T]:
        out: list[T] = []
        while True:
            if self.next_id in self._held:
                out.append(self._held.pop(self.next_id))
                self.next_id += 1
                self._delivered_in_epoch = True
            elif self.next_id < limit:
                later = [i for i in self._held if i > self.next_id]
                target = min([limit, *later])
                if self._delivered_in_epoch:
                    self.num_skipped += target - self.next_id
                self.next_id = target
            else:
                return out
