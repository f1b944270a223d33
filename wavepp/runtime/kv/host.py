"""One stage's host-memory KV tier (mechanism): bounded slots, hash -> slot index, ref counts,
LRU, and the ordered transfer log its engine applies.

The device pool (``BlockPool``) spills each block it evicts here with its hash; a probe pins
the host run after its device hit; the plan loads what it agreed back into device blocks. Pure:
no I/O, no torch, no clock reads. Ideas follow SGLang's HiCache (a host tier below the radix
cache) and vLLM's offloading connector; no code is copied.

Tier invariant (exclusive tiers): a block hash is in at most one tier's index, the device
pool's or this one's. A spill enters a hash the device just dropped; a load removes the hash
from this index as the device block takes it; a hash the device caches by computing it leaves
this index at once (``discard``). A slot whose hash left the index while a probe still pins it
(an *orphan*) keeps its bytes until its last pin is released (the loader reads them), then is
free. So a lookup over both tiers sees each hash once and reads one copy.

Transfer order: every spill (device block -> slot) and load (slot -> device block) is appended
to one log (``take_transfers``), and the engine applies the log in order before it runs any
chunk queued after it. A spill is logged when its device block is handed to a new owner and
before anything can write that block; a load of a slot is logged before any later spill can
reuse it. Applied in order, every copy reads the bytes its bookkeeping says are there, though
the bookkeeping never waits for a copy (asynchronous eviction).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from wavepp.runtime.kv.events import KVEvent
from wavepp.runtime.kv.hashing import BlockHash


@dataclass(frozen=True, slots=True)
class Transfer:
    """One copy between a stage's device pool and its host tier, in log order.

    Attributes:
        kind: "spill" (device block ``block_id`` -> host slot ``slot``) or "load" (slot ->
            device block).
        block_id: The device block.
        slot: The host slot.
    """

    kind: Literal["spill", "load"]
    block_id: int
    slot: int


def _invariant(condition: bool, message: str) -> None:
    # NOTE: explicit raise, not `assert`, so check_invariants still checks under `python -O`.
    if not condition:
        raise AssertionError(message)


class HostTier:
    """One stage's host tier: ``num_slots`` block-sized slots of host memory.

    State per slot (plain lists by slot id): the hash whose bytes it holds (or None), a ref
    count (probes pinning it), and whether its hash is indexed. Indexed slots at ref count 0
    sit in the LRU (least recently spilled or released first); unindexed slots at ref count 0
    are free. A pinned slot (ref count > 0) is never evicted or reused.

    Args:
        num_slots: Capacity in blocks, >= 0 (0: a tier that holds nothing; every spill is
            dropped).

    Raises:
        ValueError: ``num_slots`` not an int >= 0.
    """

    def __init__(self, num_slots: int) -> None:
        if not isinstance(num_slots, int) or num_slots < 0:
            raise ValueError(f"num_slots must be an int >= 0, got {num_slots!r}")
        self.num_slots = num_slots
        self._hash: list[BlockHash | None] = [None] * num_slots
        self._ref = [0] * num_slots
        self._index: dict[BlockHash, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # indexed, ref 0; first = evicted first
        self._free = list(range(num_slots - 1, -1, -1))  # unindexed, ref 0; last = used first
        self._transfers: list[Transfer] = []
        self._events: list[tuple[str, list[BlockHash]]] = []  # (kind, hashes), merged runs
        self.num_spills = 0  # hashes entered by a spill
        self.num_evictions = 0  # hashes that left by LRU eviction
        self.num_loads = 0  # slots loaded into device blocks

    # ---- counters and inspection --------------------------------------------------------

    @property
    def num_cached(self) -> int:
        """Hashes indexed here."""
        return len(self._index)

    @property
    def num_pinned(self) -> int:
        """Slots with ref count > 0."""
        return self.num_slots - len(self._lru) - len(self._free)

    def cached_block_hashes(self) -> frozenset[BlockHash]:
        """Every hash indexed here."""
        return frozenset(self._index)

    def slot_of(self, block_hash: BlockHash) -> int | None:
        """The slot indexed under ``block_hash``, or None."""
        return self._index.get(block_hash)

    def slot_hash(self, slot: int) -> BlockHash | None:
        """The hash whose bytes slot ``slot`` holds (indexed or orphan), or None (free)."""
        return self._hash[slot]

    def ref_cnt(self, slot: int) -> int:
        """Pins on slot ``slot``."""
        return self._ref[slot]

    def pending_transfers(self) -> tuple[Transfer, ...]:
        """The transfer log not taken yet, oldest first (a copy; ``take_transfers`` drains)."""
        return tuple(self._transfers)

    # ---- operations ---------------------------------------------------------------------

    def find_run(self, block_hashes: Sequence[BlockHash], start: int) -> list[int]:
        """Slots of the longest run ``block_hashes[start:start + k]`` indexed here; no side
        effects (the host half of a stage's hit: it starts where the device hit ends)."""
        slots: list[int] = []
        get = self._index.get
        for index in range(start, len(block_hashes)):
            slot = get(block_hashes[index])
            if slot is None:
                break
            slots.append(slot)
        return slots

    def pin(self, slots: Sequence[int]) -> None:
        """One pin more on each slot (indexed slots from ``find_run``, or pinned ones).

        Raises:
            ValueError: a slot out of range, or free (nothing to pin). Nothing changes then.
        """
        self._check_slots(slots)
        for slot in slots:
            if self._ref[slot] == 0 and slot not in self._lru:
                raise ValueError(f"slots: slot {slot} is free; pin only slots from find_run")
        for slot in slots:
            if self._ref[slot] == 0:
                del self._lru[slot]
            self._ref[slot] += 1

    def release(self, slots: Sequence[int]) -> None:
        """Drop one pin from each slot, last first: at 0 an indexed slot joins the LRU's back
        (its chain's tail before its prefix), an orphan becomes free.

        Raises:
            ValueError: a slot released more often than pinned. Nothing changes then.
        """
        self._check_slots(slots)
        for slot in set(slots):
            if list(slots).count(slot) > self._ref[slot]:
                raise ValueError(f"slots: slot {slot} released more often than pinned")
        for slot in reversed(slots):
            self._ref[slot] -= 1
            if self._ref[slot] == 0:
                block_hash = self._hash[slot]
                if block_hash is not None and self._index.get(block_hash) == slot:
                    self._lru[slot] = None
                else:
                    self._hash[slot] = None
                    self._free.append(slot)

    def spill(self, block_id: int, block_hash: BlockHash) -> int | None:
        """Take the bytes of evicted device block ``block_id`` (hash ``block_hash``): a free
        slot, else the LRU slot's (its hash evicted); logs the spill. None (dropped)
        when every slot is pinned or the tier is empty. A hash indexed here already (cannot
        happen while the tiers stay exclusive) is refreshed, not copied twice."""
        held = self._index.get(block_hash)
        if held is not None:
            if self._ref[held] == 0:
                self._lru.move_to_end(held)
            return held
        if self._free:
            slot = self._free.pop()
        elif self._lru:
            slot = self._lru.popitem(last=False)[0]
            evicted = self._hash[slot]
            assert evicted is not None, f"slot {slot}: in the LRU without a hash"
            del self._index[evicted]
            self.num_evictions += 1
            self._event("removed", evicted)
        else:
            return None
        self._hash[slot] = block_hash
        self._index[block_hash] = slot
        self._lru[slot] = None
        self._event("stored", block_hash)
        self._transfers.append(Transfer("spill", block_id, slot))
        self.num_spills += 1
        return slot

    def load(self, slot: int, block_id: int) -> None:
        """Log a copy of pinned slot ``slot`` into device block ``block_id``; the slot's hash
        leaves the index (the device block takes it: exclusive tiers). The caller's pin stays
        until it releases the slot.

        Raises:
            ValueError: the slot is not pinned.
        """
        if not (isinstance(slot, int) and 0 <= slot < self.num_slots) or self._ref[slot] == 0:
            raise ValueError(f"slot {slot!r}: not a pinned slot; pin it before loading it")
        self.discard(self._hash[slot])
        self._transfers.append(Transfer("load", block_id, slot))
        self.num_loads += 1

    def discard(self, block_hash: BlockHash | None) -> None:
        """``block_hash`` leaves the index (the device tier holds it now). Its slot is free at
        once if unpinned; a pinned one is an orphan until its last release."""
        if block_hash is None:
            return
        slot = self._index.pop(block_hash, None)
        if slot is None:
            return
        self._event("removed", block_hash)
        if self._ref[slot] == 0:
            del self._lru[slot]
            self._hash[slot] = None
            self._free.append(slot)

    def invalidate(self, slots: Sequence[int]) -> None:
        """Slots whose bytes are not what their hash says (a copy into them failed): each
        one's hash leaves the index (a "removed" event) and the slot keeps no hash. An unpinned
        slot is free at once; a pinned one stays pinned, holding nothing, so a load of it is
        refused (``BlockPool.load_blocks`` checks the slot's hash) and its last release frees
        it. A free slot is left alone.

        Raises:
            ValueError: a slot out of range. Nothing changes then.
        """
        self._check_slots(slots)
        for slot in dict.fromkeys(slots):
            block_hash = self._hash[slot]
            if block_hash is None:
                continue
            self._hash[slot] = None
            if self._index.get(block_hash) == slot:
                del self._index[block_hash]
                self._event("removed", block_hash)
                if self._ref[slot] == 0:
                    del self._lru[slot]
                    self._free.append(slot)

    def _check_slots(self, slots: Sequence[int]) -> None:
        """Raises ValueError naming the first of ``slots`` that is not a slot index."""
        for slot in slots:
            if not (isinstance(slot, int) and 0 <= slot < self.num_slots):
                raise ValueError(f"slots: {slot!r} is not in [0, {self.num_slots})")

    def take_events(self) -> list[KVEvent]:
        """Drain this tier's events (tier "host"; oldest first): "stored" on a spill, "removed"
        when a hash leaves the index (evicted, loaded, or computed on the device)."""
        events, self._events = self._events, []
        return [KVEvent(kind, tuple(hashes), None, "host") for kind, hashes in events]  # type: ignore[arg-type]

    def _event(self, kind: str, block_hash: BlockHash) -> None:
        """Queue one hash's change, merged into the last event when it is of the same kind."""
        events = self._events
        if events and events[-1][0] == kind:
            events[-1][1].append(block_hash)
        else:
            events.append((kind, [block_hash]))

    def take_transfers(self) -> list[Transfer]:
        """Drain the transfer log, oldest first (apply in this order)."""
        transfers, self._transfers = self._transfers, []
        return transfers

    def check_invariants(self) -> None:
        """Every structural invariant; for tests. Raises AssertionError naming the first that
        does not hold."""
        lru, free = set(self._lru), set(self._free)
        _invariant(not lru & free, "a slot is both free and in the LRU")
        _invariant(len(free) == len(self._free), "a free slot is listed twice")
        for slot in range(self.num_slots):
            ref, block_hash = self._ref[slot], self._hash[slot]
            indexed = block_hash is not None and self._index.get(block_hash) == slot
            _invariant(ref >= 0, f"slot {slot}: ref count {ref}")
            _invariant((slot in lru) == (ref == 0 and indexed), f"slot {slot}: LRU membership")
            _invariant((slot in free) == (ref == 0 and not indexed), f"slot {slot}: free list")
            _invariant(
                slot not in free or block_hash is None, f"slot {slot}: free but holds a hash"
            )
        for block_hash, slot in self._index.items():
            _invariant(self._hash[slot] == block_hash, f"index entry of slot {slot}")
