"""The stage side of prefix agreement: a pure handler over one stage's ``StageKVManager``.

``handle_kv_request`` answers ProbePin, Commit, Release, Renew and Health messages (wire types in
``wavepp.api.messages``); ``handle_kv_batch`` answers one admission round's probe-reserves (the
one-round-trip agreement; probes and commits of the two-phase one from an older controller) or
releases in one binary message (``wavepp.api.kv_batch``). The stage process owns the NATS I/O
around both. No I/O here. The
manager is the one record of each request on the stage (its pins, block table, prompt hashes
and L*); this handler keeps no state of its own.

Trust nothing on the bus: with a bus key (``wavepp.api.signing``) a message whose tag is
missing or wrong is refused before it touches the manager; the manager refuses a lease past the
replica's ``lease_s`` and a commit, renew or release by an owner that did not probe the request
(see ``StageKVManager``).
"""

from __future__ import annotations

from functools import lru_cache

from pydantic import ValidationError

from wavepp.api.kv_batch import (
    BatchOp,
    CommitEntry,
    KVBatch,
    KVWireError,
    ProbeEntry,
    ReserveEntry,
    UnresolvedEntry,
    decode_batch,
)
from wavepp.api.kv_reply import EntryResult, EntryStatus, KVBatchReply, encode_reply
from wavepp.api.kv_reply_tag import reply_tag_prefix, tag_reply
from wavepp.api.messages import (
    KV_REQUEST_ADAPTER,
    Commit,
    Health,
    KVReply,
    ProbePin,
    Release,
    Renew,
)
from wavepp.api.signing import BusKey
from wavepp.runtime.kv import CacheHit, StageKVManager

_OK = EntryResult(EntryStatus.OK)
_UNRESOLVED = EntryResult(EntryStatus.UNRESOLVED)


@lru_cache(maxsize=4096)
def _ok(value: int) -> EntryResult:
    """An OK result (immutable, so shared: one per value, not one per entry)."""
    return EntryResult(EntryStatus.OK, value)


def handle_kv_request(
    manager: StageKVManager, rank: int, payload: bytes, *, bus_key: BusKey | None = None
) -> KVReply:
    """Apply one KV op to a stage's manager and return the reply. Never raises on bad input.

    Args:
        manager: the stage's KV manager (its single owner calls this).
        rank: the stage's rank, echoed in the reply.
        payload: a JSON ``KVRequest``. ``probe_pin`` hands the prompt's block hashes to the
            manager, which keeps them (with L* from ``commit``) until ``release``; the stage
            needs them to cache blocks once they are computed.
        bus_key: the replica's key; None: unsigned messages are accepted (insecure mode).

    Returns:
        ``KVReply`` with ``ok=False`` and ``error`` naming the field for an invalid message or a
        refused reservation; the manager's state is unchanged by a rejected message.
    """
    pool = manager.pool
    try:
        msg = KV_REQUEST_ADAPTER.validate_json(payload)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        return KVReply(rank=rank, ok=False, error=f"invalid KV request: {where}: {first['msg']}")
    if bus_key is not None and not isinstance(msg, Health) and not bus_key.verify(msg):
        return KVReply(
            rank=rank,
            ok=False,
            error=f"{type(msg).__name__}: mac: missing or wrong (not signed with this replica's "
            "bus key); refused",
        )
    if (
        bus_key is not None
        and not isinstance(msg, Health)
        and not manager.accept_seq(msg.owner, msg.seq)
    ):
        return KVReply(
            rank=rank,
            ok=False,
            error=f"{type(msg).__name__}: seq={msg.seq}: not above owner {msg.owner!r}'s last "
            "op on this stage (a replayed message); refused",
        )
    try:
        if isinstance(msg, ProbePin):
            hashes = [bytes.fromhex(h) for h in msg.block_hashes]
            num_hit = manager.probe_pin(msg.request_id, hashes, msg.lease_s, owner=msg.owner)
            return KVReply(
                rank=rank,
                num_hit_blocks=num_hit,
                num_free_blocks=pool.num_free_blocks,
                num_blocks=pool.num_blocks,
            )
        if isinstance(msg, Commit):
            table = manager.commit(
                msg.request_id,
                msg.num_agreed_blocks,
                msg.num_total_blocks,
                msg.lease_s,
                owner=msg.owner,
            )
            if table is None:
                return KVReply(
                    rank=rank,
                    ok=False,
                    error=(
                        f"reservation refused: needs {msg.num_total_blocks - msg.num_agreed_blocks}"
                        f" blocks, {pool.num_free_blocks} free of {pool.num_blocks}, owner holds"
                        f" {manager.num_owner_blocks(msg.owner)} of max_blocks_per_owner="
                        f"{manager.max_blocks_per_owner}"
                    ),
                    num_free_blocks=pool.num_free_blocks,
                    num_blocks=pool.num_blocks,
                )
            return KVReply(
                rank=rank,
                num_reserved_blocks=len(table) - msg.num_agreed_blocks,
                num_free_blocks=pool.num_free_blocks,
                num_blocks=pool.num_blocks,
            )
        if isinstance(msg, Release):
            for request_id in msg.request_ids:
                manager.release(request_id, owner=msg.owner)
        elif isinstance(msg, Renew):
            manager.renew(msg.request_ids, msg.lease_s, owner=msg.owner)
        elif isinstance(msg, Health):
            pass
        return KVReply(rank=rank, num_free_blocks=pool.num_free_blocks, num_blocks=pool.num_blocks)
    except (ValueError, KeyError) as exc:
        return KVReply(rank=rank, ok=False, error=f"{type(msg).__name__}: {exc}")


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

    A probe entry that shares its leading hashes with an earlier one of the batch starts its
    walk of the block table where that one's ended (``BlockPool.pin_cache_hit``): one lookup
    per new block, not per block of the prompt.

    A probe-reserve batch's ``releases`` (the controller's finished requests, riding along with
    the round) are released first, so their blocks are free for the round's reservations.

    Entries are applied in order, each as its single-request counterpart in
    ``handle_kv_request`` (probe: pin the local hit; commit: unpin past L*, reserve the rest, or
    refuse and hold nothing; release). A probe-reserve batch runs in two passes: every entry
    pins its local hit h_s first (``StageKVManager.probe_pin_hit``), then every entry reserves
    the blocks after its hit (``StageKVManager.reserve``; refused: nothing held for it), so an
    entry's reservation never evicts a block a later entry of the round would have hit, and walks
    sharing a prefix stay valid (no eviction between them); the reply's value is h_s. A
    malformed batch changes nothing and is answered with the batch-level ``error``; a bad entry
    is answered INVALID and holds nothing (what it pinned in the first pass is released), the
    other entries are applied.

    Prefix references (``kv_batch`` version 5): an entry naming its leading hashes by reference
    is resolved against the prefixes this stage remembers for the batch's owner
    (``manager.recent_prefixes``); one that does not resolve (this stage restarted, or dropped
    it) is answered UNRESOLVED and holds nothing (the controller sends it again in full), the
    others are applied. Once a probe-reserve batch is accepted (tag and op number checked), each
    resolved entry's hashes are remembered for its owner, in entry order, whatever the entry's
    outcome (the controller mirrors every entry it sends).

    Args:
        manager: the stage's KV manager (its single owner calls this).
        rank: the stage's rank, echoed in the reply.
        payload: ``wavepp.api.kv_batch.encode_batch`` bytes.
        refuse: non-empty while the stage is out of service (re-forming its group): a release
            batch (and a probe-reserve batch's releases) is applied, any other entry
            (probe-reserve, probe, commit) answered INVALID with this reason and applied to
            nothing.
        bus_key: the replica's key: a batch it did not sign, or a replayed one (its owner's op
            number seen before), is refused whole; None accepts unsigned batches (insecure
            mode). Entries act for the batch's owner only (``StageKVManager``'s owner checks).
            The reply to a batch it signed is tagged for that batch and this rank
            (``kv_reply_tag.tag_reply``: the controller takes no untagged reply); the refusal of one
            it did not sign is not (nothing for a forger to replay into a round to come).
    """
    pool = manager.pool
    try:
        batch = decode_batch(payload, bus_key, resolve=manager.recent_prefixes.resolve)
    except KVWireError as exc:
        reply = KVBatchReply(
            BatchOp.PROBE,
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
            "(a replayed batch); refused",
        )
        return encode_reply(reply)
    for request_id in batch.releases:  # the finished requests first: their blocks free
        manager.release(request_id, owner=batch.owner)
    if batch.op is BatchOp.PROBE_RESERVE:  # what the controller's mirror now holds
        remember = manager.recent_prefixes.remember
        for entry in batch.entries:
            if isinstance(entry, ReserveEntry):
                remember(batch.owner, entry.block_hashes)
    if refuse and batch.op is not BatchOp.RELEASE:
        refused = tuple(
            EntryResult(EntryStatus.INVALID, 0, f"{refuse}; {batch.op.name.lower()} refused")
            for _ in batch.entries
        )
        return encode_reply(
            KVBatchReply(batch.op, rank, pool.num_free_blocks, pool.num_blocks, refused)
        )
    if batch.op is BatchOp.PROBE_RESERVE:
        reserved = _probe_reserve(manager, batch)
        return encode_reply(
            KVBatchReply(batch.op, rank, pool.num_free_blocks, pool.num_blocks, reserved)
        )
    results: list[EntryResult] = []
    # each probe's walk: a later entry sharing its leading hashes starts from it
    walks: list[CacheHit | None] = []
    shares = batch.shares or ((-1, 0),) * len(batch.entries)
    for index, entry in enumerate(batch.entries):
        try:
            if isinstance(entry, ProbeEntry):
                walks.append(None)
                shared_from, num_shared = shares[index]
                hit, walks[index] = manager.probe_pin_hit(
                    entry.request_id,
                    entry.block_hashes,
                    batch.lease_s,
                    owner=batch.owner,
                    prior=walks[shared_from] if shared_from >= 0 else None,
                    num_shared=num_shared,
                )
                results.append(_ok(hit))
            elif isinstance(entry, CommitEntry):
                table = manager.commit(
                    entry.request_id,
                    entry.num_agreed_blocks,
                    entry.num_total_blocks,
                    batch.lease_s,
                    owner=batch.owner,
                    copy=False,
                )
                if table is None:
                    need = entry.num_total_blocks - entry.num_agreed_blocks
                    results.append(_refused(manager, batch.owner, need))
                else:
                    results.append(_ok(len(table) - entry.num_agreed_blocks))
            else:
                manager.release(entry, owner=batch.owner)
                results.append(_OK)
        except (ValueError, KeyError) as exc:
            results.append(EntryResult(EntryStatus.INVALID, 0, f"{batch.op.name.lower()}: {exc}"))
    return encode_reply(
        KVBatchReply(batch.op, rank, pool.num_free_blocks, pool.num_blocks, tuple(results))
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
        results[index] = _ok(hit)
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
