"""The stage side of prefix agreement: a pure handler over one stage's ``StageKVManager``.

``handle_kv_batch`` answers one admission round (probe-reserves, with the releases riding
along, or releases alone) in one binary message (``wavepp.api.kv_batch``); ``handle_kv_request``
answers the JSON Renew and Health messages (``wavepp.api.messages``). The stage process owns
the NATS I/O around both. No I/O here. The manager is the one record of each request on the
stage (its pins, block table, prompt hashes and L*); this handler keeps no state of its own.

Trust nothing on the bus: with a bus key (``wavepp.api.signing``) a message whose tag is
missing or wrong is refused before it touches the manager; the manager refuses a lease past the
replica's ``lease_s`` and a reserve, renew or release by an owner that did not probe the
request (see ``StageKVManager``).
"""

from __future__ import annotations

from functools import lru_cache

from pydantic import ValidationError

from wavepp.api.kv_batch import (
    BatchOp,
    KVBatch,
    KVWireError,
    ReserveEntry,
    UnresolvedEntry,
    decode_batch,
)
from wavepp.api.kv_reply import EntryResult, EntryStatus, KVBatchReply, encode_reply
from wavepp.api.kv_reply_tag import reply_tag_prefix, tag_reply
from wavepp.api.messages import KV_REQUEST_ADAPTER, Health, KVReply, Renew
from wavepp.api.signing import BusKey
from wavepp.runtime.kv import CacheHit, StageKVManager

_OK = EntryResult(EntryStatus.OK)
_UNRESOLVED = EntryResult(EntryStatus.UNRESOLVED)


@lru_cache(maxsize=4096)
def _ok(value: int, host: int = 0) -> EntryResult:
    """An OK result (immutable, so shared: one per value, not one per entry)."""
    return EntryResult(EntryStatus.OK, value, "", host)


def handle_kv_request(
    manager: StageKVManager, rank: int, payload: bytes, *, bus_key: BusKey | None = None
) -> KVReply:
    """Apply one JSON KV op (renew or health) to a stage's manager and return the reply. Never
    raises on bad input.

    Args:
        manager: the stage's KV manager (its single owner calls this).
        rank: the stage's rank, echoed in the reply.
        payload: a JSON ``KVRequest``.
        bus_key: the replica's key; None: unsigned messages are accepted (insecure mode). A
            health probe changes nothing and is never checked.

    Returns:
        ``KVReply`` with ``ok=False`` and ``error`` naming the field for an invalid, unsigned
        or repeated message; the manager's state is unchanged by a rejected message.
    """
    pool = manager.pool
    try:
        msg = KV_REQUEST_ADAPTER.validate_json(payload)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        return KVReply(rank=rank, ok=False, error=f"invalid KV request: {where}: {first['msg']}")
    if isinstance(msg, Renew):
        if bus_key is not None and not bus_key.verify(msg):
            return KVReply(
                rank=rank,
                ok=False,
                error="Renew: mac: missing or wrong (not signed with this replica's bus key); "
                "refused",
            )
        if bus_key is not None and not manager.accept_seq(msg.owner, msg.seq):
            return KVReply(
                rank=rank,
                ok=False,
                error=f"Renew: seq={msg.seq}: not above owner {msg.owner!r}'s last op on this "
                "stage (a repeated message); refused",
            )
        try:
            manager.renew(msg.request_ids, msg.lease_s, owner=msg.owner)
        except ValueError as exc:
            return KVReply(rank=rank, ok=False, error=f"Renew: {exc}")
    else:
        assert isinstance(msg, Health)
    return KVReply(rank=rank, num_free_blocks=pool.num_free_blocks, num_blocks=pool.num_blocks)


def handle_kv_batch(
    manager: StageKVManager,
    rank: int,
    payload: bytes,
    *,
    refuse: str = "",
    bus_key: BusKey | None = None,
) -> bytes:
    """Apply one admission round (a binary ``KVBatch``) to a stage's manager and return the
    encoded ``KVBatchReply``. Never raises on bad input.

    A probe-reserve batch's ``releases`` (the controller's finished requests, riding along with
    the round) are released first, so their blocks are free for the round's reservations. Its
    entries then run in two passes: every entry pins its local hit h_s first
    (``StageKVManager.probe_pin_hit``; an entry sharing its leading hashes with an earlier one
    of the batch starts its walk of the block table where that one's ended,
    ``BlockPool.pin_cache_hit``), then every entry reserves the blocks after its hit
    (``StageKVManager.reserve``; refused: nothing held for it), so an entry's reservation never
    evicts a block a later entry of the round would have hit, and walks sharing a prefix stay
    valid (no eviction between them); the reply's value is h_s and its ``host`` the part of
    h_s in the stage's host tier (pinned there by the probe). A malformed batch changes
    nothing and is answered with the batch-level ``error``; a bad entry is answered INVALID and
    holds nothing (what it pinned in the first pass is released), the other entries are
    applied. A release batch releases its entries (each answered OK).

    Prefix references: an entry naming its leading hashes by reference is resolved against the
    prefixes this stage remembers for the batch's owner (``manager.recent_prefixes``); one that
    does not resolve (this stage restarted, or dropped it) is answered UNRESOLVED and holds
    nothing (the controller sends it again in full), the others are applied. Once a
    probe-reserve batch is accepted (tag and op number checked), each resolved entry's hashes
    are remembered for its owner, in entry order, whatever the entry's outcome (the controller
    mirrors every entry it sends).

    Args:
        manager: the stage's KV manager (its single owner calls this).
        rank: the stage's rank, echoed in the reply.
        payload: ``wavepp.api.kv_batch.encode_batch`` bytes.
        refuse: non-empty while the stage is out of service (re-forming its group): a release
            batch (and a probe-reserve batch's releases) is applied, every probe-reserve entry
            answered INVALID with this reason and applied to nothing.
        bus_key: the replica's key: a batch it did not sign, or a repeated one (its owner's op
            number seen before), is refused whole; None accepts unsigned batches (insecure
            mode). Entries act for the batch's owner only (``StageKVManager``'s owner checks).
            The reply to a batch it signed is tagged for that batch and this rank
            (``kv_reply_tag.tag_reply``: the controller takes no untagged reply); the refusal of
            one it did not sign is not (nothing for a forger to repeat into a round to come).
    """
    pool = manager.pool
    try:
        batch = decode_batch(payload, bus_key, resolve=manager.recent_prefixes.resolve)
    except KVWireError as exc:
        reply = KVBatchReply(
            BatchOp.PROBE_RESERVE,
            rank,
            pool.num_free_blocks,
            pool.num_blocks,
            error=f"invalid batch: {exc}",
        )
        return encode_reply(reply)
    reply_bytes = _apply_batch(manager, rank, batch, refuse, bus_key)
    if bus_key is None:
        return reply_bytes
    return tag_reply(reply_bytes, bus_key, reply_tag_prefix(batch.owner, batch.seq))


def _apply_batch(
    manager: StageKVManager, rank: int, batch: KVBatch, refuse: str, bus_key: BusKey | None
) -> bytes:
    """``handle_kv_batch`` for a batch that decoded (and, with ``bus_key``, verified): the
    encoded reply, untagged."""
    pool = manager.pool
    if bus_key is not None and not manager.accept_seq(batch.owner, batch.seq):
        reply = KVBatchReply(
            batch.op,
            rank,
            pool.num_free_blocks,
            pool.num_blocks,
            error=f"seq={batch.seq}: not above owner {batch.owner!r}'s last op on this stage "
            "(a repeated batch); refused",
        )
        return encode_reply(reply)
    if batch.op is BatchOp.RELEASE:
        for request_id in batch.entries:
            manager.release(request_id, owner=batch.owner)  # type: ignore[arg-type]
        released = (_OK,) * len(batch.entries)
        return encode_reply(
            KVBatchReply(batch.op, rank, pool.num_free_blocks, pool.num_blocks, released)
        )
    for request_id in batch.releases:  # the finished requests first: their blocks free
        manager.release(request_id, owner=batch.owner)
    remember = manager.recent_prefixes.remember  # what the controller's mirror now holds
    for entry in batch.entries:
        if isinstance(entry, ReserveEntry):
            remember(batch.owner, entry.block_hashes)
    if refuse:
        results = tuple(
            EntryResult(EntryStatus.INVALID, 0, f"{refuse}; probe_reserve refused")
            for _ in batch.entries
        )
    else:
        results = _probe_reserve(manager, batch)
    return encode_reply(
        KVBatchReply(batch.op, rank, pool.num_free_blocks, pool.num_blocks, results)
    )


def _probe_reserve(manager: StageKVManager, batch: KVBatch) -> tuple[EntryResult, ...]:
    """A probe-reserve batch's results: pin every entry's hit, then reserve after each hit."""
    entries = batch.entries
    results: list[EntryResult | None] = [None] * len(entries)
    walks: list[CacheHit | None] = [None] * len(entries)
    newly_pinned = [False] * len(entries)  # not held before this batch: release on a fault
    shares = batch.shares or ((-1, 0),) * len(entries)
    for index, entry in enumerate(entries):
        if isinstance(entry, UnresolvedEntry):  # its hashes are unknown here: nothing held
            results[index] = _UNRESOLVED
            continue
        assert isinstance(entry, ReserveEntry)
        shared_from, num_shared = shares[index]
        try:
            hit, walks[index] = manager.probe_pin_hit(
                entry.request_id,
                entry.block_hashes,
                batch.lease_s,
                owner=batch.owner,
                prior=walks[shared_from] if shared_from >= 0 else None,
                num_shared=num_shared,
            )
        except (ValueError, KeyError) as exc:
            results[index] = EntryResult(EntryStatus.INVALID, 0, f"probe_reserve: {exc}")
            continue
        newly_pinned[index] = walks[index] is not None
        results[index] = _ok(hit, manager.num_host_hit_blocks(entry.request_id))
    for index, entry in enumerate(entries):
        result = results[index]
        assert result is not None
        if not result.ok:
            continue
        assert isinstance(entry, ReserveEntry)
        try:
            table = manager.reserve(
                entry.request_id,
                entry.num_total_blocks,
                batch.lease_s,
                owner=batch.owner,
                copy=False,
            )
        except (ValueError, KeyError) as exc:
            if newly_pinned[index]:
                manager.release(entry.request_id, owner=batch.owner)
            results[index] = EntryResult(EntryStatus.INVALID, 0, f"probe_reserve: {exc}")
            continue
        if table is None:
            need = entry.num_total_blocks - result.value
            results[index] = _refused(manager, batch.owner, need)
    return tuple(r for r in results if r is not None)


def _refused(manager: StageKVManager, owner: str, need: int) -> EntryResult:
    """A batch entry's refused reservation of ``need`` blocks: the pool's free blocks and, with
    an owner cap, what the owner holds (a reservation the cap refused reads as one the pool
    refused otherwise)."""
    pool = manager.pool
    text = (
        f"reservation refused: needs {need} blocks, {pool.num_free_blocks} free of "
        f"{pool.num_blocks}"
    )
    if manager.max_blocks_per_owner is not None:
        text += (
            f", owner holds {manager.num_owner_blocks(owner)} of max_blocks_per_owner="
            f"{manager.max_blocks_per_owner}"
        )
    return EntryResult(EntryStatus.REFUSED, 0, text)
