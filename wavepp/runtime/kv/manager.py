"""The per-stage KV manager (policy): speaks in requests, calls the pool.

``StageKVManager`` turns agreement steps (probe/pin, reserve, mark computed, release, lease
expiry) into ``BlockPool`` calls, keyed by request id. Pure: no I/O, no torch; the clock is
injected. Ideas follow vLLM (vllm/v1/core/kv_cache_manager.py); no code is copied.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from wavepp.api.hash_chain import common_prefix
from wavepp.runtime.kv.hashing import BlockHash
from wavepp.runtime.kv.held import HeldRequest, check_lease
from wavepp.runtime.kv.pool import BlockPool, CacheHit, KVEvent
from wavepp.runtime.kv.recent import RecentPrefixes


class StageKVManager:
    """Per-stage admission state: pins, reservations, leases, per-request block tables.

    The one owner of a stage's per-request state: what each held request pinned and reserved,
    its prompt's block hashes (from ``probe_pin``) and its L* (from its first chunk).

    A request moves probed -> reserved -> released (``probe_pin`` then ``reserve`` in the same
    message), or probed -> released. Block table of a reserved request, h_s = this stage's
    local hit::

        [ cached_0 ... cached_{h_s-1} | fresh_{h_s} ... fresh_{num_total_blocks-1} ]
          pinned by probe_pin           allocated by reserve (the reservation)

    It does not depend on L* (token p lives in block p // block_size either way). The plan's
    first chunk starts at L* <= h_s blocks (``start_chunk`` records it); a stage whose hit
    exceeds L* computes tokens [L* B, h_s B) again for its successors but writes none of their
    KV (``num_hit_blocks``: the engine skips those slots), and caching starts at block h_s, so a
    cached block is never written or hashed again.

    With a host tier (``pool.host``), h_s = d_s + m_s: the device hit d_s (pinned device
    blocks) plus the contiguous run of m_s blocks after it that the host tier holds (host
    slots, pinned against host eviction by the probe). ``reserve`` allocates device blocks for
    everything after d_s (what will be loaded and what will be computed). The first chunk's
    L* decides: the table's blocks [d_s, max(d_s, L*)) are loaded from their pinned slots
    (``BlockPool.load_blocks``, logged for the engine before the chunk runs) and count as hit;
    the rest of the host run is computed, and every host pin is released then. A host slot is
    pinned from the probe to that point, so the bytes a plan loads are the bytes probed.

    Every held request has a lease (``clock()`` seconds); ``expire`` releases any request
    whose lease passed, reserved or not, so a dead controller leaks no pins.

    Bounds against a misbehaving or forged owner: a lease is at most ``max_lease_s`` (a longer
    one is refused, never clamped), an owner holds at most ``max_blocks_per_owner`` blocks
    (pinned and reserved; a reservation past it is refused like a full pool), and only the
    owner that probed a request may reserve, renew or release it.

    Args:
        pool: The stage's block pool; this manager is its only user.
        clock: Monotonic time in seconds (inject a fake in tests).
        max_lease_s: The longest lease a request may hold, seconds (the replica's
            ``lease_s``); None: no bound but the wire format's 3600 s.
        max_blocks_per_owner: Blocks one owner may hold at once; None: the whole pool.

    Raises:
        ValueError: ``max_lease_s`` not a finite number > 0, or ``max_blocks_per_owner`` < 1.
    """

    def __init__(
        self,
        pool: BlockPool,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_lease_s: float | None = None,
        max_blocks_per_owner: int | None = None,
    ) -> None:
        if max_lease_s is not None:
            check_lease(max_lease_s)
        if max_blocks_per_owner is not None and max_blocks_per_owner < 1:
            raise ValueError(f"max_blocks_per_owner={max_blocks_per_owner}: must be >= 1")
        self.pool = pool
        self._clock = clock
        self.max_lease_s = max_lease_s
        self.max_blocks_per_owner = max_blocks_per_owner
        # owner -> (highest op number, op numbers seen within seq_window of it)
        self._owner_seqs: OrderedDict[str, tuple[int, set[int]]] = OrderedDict()
        self._requests: dict[str, HeldRequest] = {}
        # owner -> blocks its requests hold (pinned and reserved, as num_owner_blocks counts
        # them), kept as they change: the cap's check is O(1), not a pass over every request
        self._owner_blocks: dict[str, int] = {}
        self._num_admitted = 0
        # first block hash -> (hashes, walk) of the latest probe starting with it: a later probe
        # of the same prefix starts its walk there (BlockPool.pin_cache_hit)
        self._recent_walks: dict[BlockHash, tuple[tuple[BlockHash, ...], CacheHit]] = {}
        self._accepted_lease: tuple[float, float | None] | None = None  # see _check_lease
        # per owner and root, its latest probe-reserve entry's hashes (kv_batch prefix references)
        self.recent_prefixes = RecentPrefixes()
        # called with the id of each request ``release`` released (a bus message, a lease's
        # expiry, a re-form), after its blocks are freed; None: nobody is told (the stage
        # worker passes the ids on to its engine's ``drop_requests``)
        self.on_release: Callable[[str], None] | None = None

    recent_walks_kept = 1024
    """Prefix roots whose latest probe walk ``probe_pin`` remembers (oldest dropped)."""

    @property
    def num_requests(self) -> int:
        """Requests holding blocks (probed or reserved)."""
        return len(self._requests)

    def probe_pin(
        self,
        request_id: str,
        block_hashes: Sequence[BlockHash],
        lease_s: float,
        *,
        owner: str = "",
    ) -> int:
        """Pin the longest cached prefix of ``block_hashes`` for ``request_id``: ``probe_pin_hit``
        without a prior walk; returns the local hit in blocks."""
        return self.probe_pin_hit(request_id, block_hashes, lease_s, owner=owner)[0]

    def probe_pin_hit(
        self,
        request_id: str,
        block_hashes: Sequence[BlockHash],
        lease_s: float,
        *,
        owner: str = "",
        prior: CacheHit | None = None,
        num_shared: int = 0,
    ) -> tuple[int, CacheHit | None]:
        """Pin the longest cached prefix of ``block_hashes`` for ``request_id``.

        Idempotent by request id: for a request already held it pins nothing more and returns
        the held length; the lease is extended to at least
        ``clock() + lease_s``, and the hashes of the first probe are kept.

        Args:
            request_id: Non-empty id.
            block_hashes: The prompt's full-block hashes (``hash_prompt_blocks``); kept for
                ``mark_computed``.
            lease_s: Seconds until ``expire`` may release the request, > 0, <= ``max_lease_s``.
            owner: Who holds it (the admission instance); only it may reserve, renew, release.
            prior: The walk of an earlier request of the same round whose first ``num_shared``
                hashes are this one's (``BlockPool.pin_cache_hit``): not looked up again.
                None: the latest probe of a prompt with the same first block, if its walk is
                still exact, and the hashes the two have in common (compared).
            num_shared: See ``prior``.

        Returns:
            The local hit in blocks (number of leading hashes this stage holds, now pinned) and
            the pool's walk (None when the request was already held: nothing walked).

        Raises:
            ValueError: on an empty ``request_id``, a bad ``lease_s``, or a request another
                owner holds.
        """
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        self._check_lease(lease_s)
        held = self._requests.get(request_id)
        if held is not None:
            self._check_owner(held, owner)
            held.lease_expiry_s = max(held.lease_expiry_s, self._clock() + lease_s)
            return len(held.hit_block_ids) + len(held.host_slots), None
        block_hashes = tuple(block_hashes)
        recent = self._recent_walks
        if prior is None and block_hashes:
            latest = recent.pop(block_hashes[0], None)
            if latest is not None:
                prior, num_shared = latest[1], common_prefix(latest[0], block_hashes)
        hit = self.pool.pin_cache_hit(block_hashes, prior, num_shared)
        host_slots: tuple[int, ...] = ()
        host = self.pool.host
        if host is not None and host.num_cached:
            host_slots = tuple(host.find_run(block_hashes, len(hit.block_ids)))
            host.pin(host_slots)
        if block_hashes:
            recent[block_hashes[0]] = (block_hashes, hit)
            if len(recent) > self.recent_walks_kept:
                del recent[next(iter(recent))]
        self._num_admitted += 1
        self._count_owner_blocks(owner, len(hit.block_ids))
        self._requests[request_id] = HeldRequest(
            request_id,
            hit.block_ids,
            self._clock() + lease_s,
            self._num_admitted,
            block_hashes,
            owner=owner,
            host_slots=host_slots,
        )
        return len(hit.block_ids) + len(host_slots), hit

    def reserve(
        self,
        request_id: str,
        num_total_blocks: int,
        lease_s: float,
        *,
        owner: str = "",
        copy: bool = True,
    ) -> Sequence[int] | None:
        """Keep the whole pinned device hit (d_s blocks; h_s without a host tier) and reserve
        the ``num_total_blocks - d_s`` blocks after it, for what will be loaded from the host
        tier and what will be computed: the agreement's stage step, after ``probe_pin``.

        Args:
            request_id: A probed request.
            num_total_blocks: Blocks the whole prompt needs (ceil(num_tokens / block_size)),
                >= the probed hashes and >= 1.
            lease_s: New lease, seconds from now, > 0, <= ``max_lease_s``.
            owner: The owner that probed it.
            copy: False: return the manager's own table, a tuple (the caller only reads it).

        Returns:
            The block table (h_s cached ids, then fresh ids), or None when the pool cannot
            give the fresh blocks or the owner would hold more than ``max_blocks_per_owner``:
            then all of this request's pins are released and it is forgotten (a refused
            reservation leaves no pins). Idempotent: the same table again.

        Raises:
            KeyError: if ``request_id`` is not held (never probed, released or expired).
            ValueError: a bad ``lease_s``, ``num_total_blocks`` below the probed hashes, a
                repeated reserve with another total, or another owner's request. Nothing
                changes then.
        """
        self._check_lease(lease_s)
        held = self._held(request_id)
        self._check_owner(held, owner)
        if held.block_table is not None:
            if num_total_blocks != len(held.block_table):
                raise ValueError(
                    f"request {request_id!r} is already reserved with num_total_blocks="
                    f"{len(held.block_table)}; got {num_total_blocks}"
                )
            held.lease_expiry_s = max(held.lease_expiry_s, self._clock() + lease_s)
            return list(held.block_table) if copy else held.block_table
        num_hit_blocks = len(held.hit_block_ids)
        if not isinstance(num_total_blocks, int) or num_total_blocks < max(
            num_hit_blocks, len(held.block_hashes), 1
        ):
            raise ValueError(
                f"num_total_blocks = {num_total_blocks!r} must be an int >= 1 and >= the "
                f"{len(held.block_hashes)} probed block hashes of request {request_id!r}"
            )
        if not self._allocate_table(held, owner, num_total_blocks - num_hit_blocks):
            return None
        held.num_hashed_blocks = num_hit_blocks  # cached already: never hashed again
        held.num_agreed_blocks = -1  # L* arrives with the first chunk (start_chunk)
        held.lease_expiry_s = self._clock() + lease_s
        return list(held.block_table) if copy else held.block_table

    def start_chunk(self, request_id: str, context_offset: int) -> int:
        """A chunk of ``request_id`` starting at token ``context_offset`` is about to run here:
        a reserved request's first chunk names its L* (``context_offset // block_size``).

        The first chunk also loads the host blocks L* needs (table blocks [d_s, L*) from
        their pinned slots, ``BlockPool.load_blocks``) and releases every host pin.

        Returns ``num_hit_blocks`` in tokens: positions below it are in this stage's cached
        or loaded blocks (computed, but none of their KV or state written:
        ``ChunkSpec.num_cached_tokens``).
        Raises KeyError if the request is not reserved here, ValueError for a
        reserved request's first chunk off a block boundary or past the stage's hit.
        """
        held = self._requests.get(request_id)
        if held is None or held.block_table is None:
            raise KeyError(f"request {request_id!r} is not reserved on this stage")
        block_size = self.pool.block_size
        num_device = len(held.hit_block_ids)
        if held.num_agreed_blocks < 0:
            num_hit_tokens = (num_device + len(held.host_slots)) * block_size
            if context_offset % block_size or not 0 <= context_offset <= num_hit_tokens:
                raise ValueError(
                    f"request {request_id!r}: first chunk at context_offset={context_offset}; "
                    f"L* must be a whole number of {block_size}-token blocks <= this stage's "
                    f"hit of {num_hit_tokens} tokens"
                )
            held.num_agreed_blocks = context_offset // block_size
            self._load_host_run(held)
        return (num_device + held.num_loaded_blocks) * block_size

    def _load_host_run(self, held: HeldRequest) -> None:
        """The first chunk's loads: host run blocks below L*, then every host pin released."""
        slots = held.host_slots
        if not slots:
            return
        num_device = len(held.hit_block_ids)
        num_loads = max(0, held.num_agreed_blocks - num_device)
        host = self.pool.host
        assert host is not None, "host slots held without a host tier"
        if num_loads:
            end = num_device + num_loads
            self.pool.load_blocks(
                held.block_table[num_device:end],  # type: ignore[index]
                slots[:num_loads],
                held.block_hashes[num_device:end],
                held.block_hashes[num_device - 1] if num_device else None,
            )
            held.num_loaded_blocks = num_loads
            held.num_hashed_blocks = end
        held.host_slots = ()
        host.release(slots)

    def num_loaded_blocks(self, request_id: str) -> int:
        """Blocks the request's first chunk loaded from the host tier here (0 if none, not
        held, or not started)."""
        held = self._requests.get(request_id)
        return held.num_loaded_blocks if held is not None else 0

    def num_host_hit_blocks(self, request_id: str) -> int:
        """m_s: the host run after the device hit that the request pins here (0 once its first
        chunk started, or if not held)."""
        held = self._requests.get(request_id)
        return len(held.host_slots) if held is not None else 0

    def num_hit_blocks(self, request_id: str) -> int:
        """The leading blocks of the request's table that are this stage's own cached hit,
        pinned by the probe and never written by this request (h_s); 0 if not held."""
        held = self._requests.get(request_id)
        return len(held.hit_block_ids) + held.num_loaded_blocks if held is not None else 0

    def mark_computed(
        self,
        request_id: str,
        num_computed_tokens: int,
        block_hashes: Sequence[BlockHash] | None = None,
    ) -> None:
        """After a chunk ran, give hashes to the request's blocks that are now full and computed.

        Block i (i >= the local hit h_s: the blocks before are cached already) is full and
        computed when num_computed_tokens >= (i + 1) *
        block_size.
        Calls with a smaller or equal count than before change nothing.

        Args:
            request_id: A reserved request.
            num_computed_tokens: Prompt tokens whose KV is now in this stage's blocks
                (cached prefix included), in [0, num_total_blocks * block_size].
            block_hashes: The prompt's full-block hashes (``hash_prompt_blocks``); None: the
                hashes given to ``probe_pin``.

        Raises:
            KeyError: if ``request_id`` is not held.
            ValueError: if the request is not reserved, ``num_computed_tokens`` is out of
                range, or ``block_hashes`` has fewer hashes than there are full computed blocks.
        """
        held = self._held(request_id)
        if held.block_table is None:
            raise ValueError(f"request {request_id!r} is not reserved; reserve before computing")
        block_size = self.pool.block_size
        num_table_tokens = len(held.block_table) * block_size
        if not isinstance(num_computed_tokens, int) or not (
            0 <= num_computed_tokens <= num_table_tokens
        ):
            raise ValueError(
                f"num_computed_tokens = {num_computed_tokens!r} must be in "
                f"[0, {num_table_tokens}] (request {request_id!r}'s block table, in tokens)"
            )
        num_full_blocks = num_computed_tokens // block_size
        if num_full_blocks <= held.num_hashed_blocks:
            return
        if block_hashes is None:
            block_hashes = held.block_hashes
        if len(block_hashes) < num_full_blocks:
            raise ValueError(
                f"block_hashes has {len(block_hashes)} hashes but {num_full_blocks} blocks are "
                f"full and computed ({num_computed_tokens} tokens); pass the prompt's "
                "full-block hashes"
            )
        first = held.num_hashed_blocks
        parent_block_hash = block_hashes[first - 1] if first > 0 else None
        self.pool.cache_full_blocks(
            held.block_table[first:num_full_blocks],
            block_hashes[first:num_full_blocks],
            parent_block_hash,
        )
        held.num_hashed_blocks = num_full_blocks

    def block_table(self, request_id: str) -> list[int]:
        """The reserved request's block table (a copy).

        Raises:
            KeyError: if ``request_id`` is not reserved.
        """
        held = self._requests.get(request_id)
        if held is None or held.block_table is None:
            raise KeyError(f"request {request_id!r} is not reserved on this stage")
        return list(held.block_table)

    def num_agreed_blocks(self, request_id: str) -> int:
        """L* of a reserved request on this stage, once its first chunk started; -1 if not
        held, not reserved, or L* not known yet."""
        held = self._requests.get(request_id)
        if held is None or held.block_table is None:
            return -1
        return held.num_agreed_blocks

    def block_hashes(self, request_id: str) -> tuple[BlockHash, ...]:
        """The prompt's full-block hashes given to ``probe_pin``; () if not held."""
        held = self._requests.get(request_id)
        return held.block_hashes if held is not None else ()

    def request_ids(self) -> list[str]:
        """The held requests (probed or reserved), in admission order."""
        return list(self._requests)

    def held_blocks(self, request_id: str) -> tuple[int, ...]:
        """The blocks ``request_id`` holds now (pins, then its reservation), block order; ()
        when it holds nothing here."""
        held = self._requests.get(request_id)
        return () if held is None else tuple(self._held_block_ids(held))

    def held_request_ids(self) -> list[str]:
        """Ids of the requests held (pinned or reserved), oldest first."""
        return list(self._requests)

    def release(self, request_id: str, *, owner: str | None = None) -> bool:
        """Drop everything the request holds, tail first; cached blocks stay cached for reuse.

        Args:
            request_id: The request's id.
            owner: Release only if this owner holds it (a message from the bus); None: the
                stage itself (lease expiry), whoever holds it.

        Returns:
            True if the request was held (now released), False otherwise (no effect; also when
            another owner holds it).
        """
        held = self._requests.get(request_id)
        if held is None or (owner is not None and held.owner != owner):
            return False
        del self._requests[request_id]
        block_ids = self._held_block_ids(held)
        self._count_owner_blocks(held.owner, -len(block_ids))
        self.pool.free(block_ids, validate=False)
        self._release_host(held)
        if self.on_release is not None:
            self.on_release(request_id)
        return True

    def renew(self, request_ids: Iterable[str], lease_s: float, *, owner: str | None = None) -> int:
        """Set the lease of each held request to ``clock() + lease_s``; unknown ids (and, with
        ``owner``, another owner's) are skipped.

        Returns:
            How many leases were renewed.

        Raises:
            ValueError: on a bad ``lease_s``.
        """
        self._check_lease(lease_s)
        lease_expiry_s = self._clock() + lease_s
        num_renewed = 0
        for request_id in request_ids:
            held = self._requests.get(request_id)
            if held is not None and (owner is None or held.owner == owner):
                held.lease_expiry_s = lease_expiry_s
                num_renewed += 1
        return num_renewed

    owners_kept = 64
    """Owners whose last op number ``accept_seq`` remembers (least recently seen dropped)."""

    seq_window = 4096
    """How far below an owner's highest op number a late op is still accepted (once)."""

    def accept_seq(self, owner: str, seq: int) -> bool:
        """Record op number ``seq`` of ``owner``; False (a repeat) when this stage accepted it
        before or it is ``seq_window`` or more below the highest accepted. A sliding window (as
        IPsec's): ops of one owner may overtake each other a little on the way."""
        high, seen = self._owner_seqs.get(owner, (-1, set()))
        if seq in seen or seq <= high - self.seq_window:
            return False
        seen.add(seq)
        high = max(high, seq)
        if len(seen) > 2 * self.seq_window:
            seen = {s for s in seen if s > high - self.seq_window}
        self._owner_seqs[owner] = (high, seen)
        self._owner_seqs.move_to_end(owner)
        while len(self._owner_seqs) > self.owners_kept:
            self._owner_seqs.popitem(last=False)
        return True

    def num_owner_blocks(self, owner: str) -> int:
        """Blocks ``owner``'s requests hold now (pinned and reserved; a cached block pinned by
        two of its requests counts twice). O(1): kept as they change."""
        return self._owner_blocks.get(owner, 0)

    def expire(self) -> list[str]:
        """Release every request whose lease passed (expiry <= clock()), reserved or not.

        Returns:
            Their ids, earliest expiry first.
        """
        now_s = self._clock()
        expired = sorted(
            (held for held in self._requests.values() if held.lease_expiry_s <= now_s),
            key=lambda held: (held.lease_expiry_s, held.seq),
        )
        for held in expired:
            self.release(held.request_id)
        return [held.request_id for held in expired]

    def take_events(self) -> list[KVEvent]:
        """Drain the pool's pending events (see ``BlockPool.take_events``)."""
        return self.pool.take_events()

    def _check_lease(self, lease_s: float) -> None:
        # NOTE: a round's entries all carry the batch's lease: the last one accepted (a float,
        # under the same max_lease_s) is not checked again
        if type(lease_s) is float and self._accepted_lease == (lease_s, self.max_lease_s):
            return
        check_lease(lease_s)
        if self.max_lease_s is not None and lease_s > self.max_lease_s:
            raise ValueError(
                f"lease_s={lease_s!r} exceeds this stage's max_lease_s={self.max_lease_s} "
                "(the replica's lease_s)"
            )
        self._accepted_lease = (lease_s, self.max_lease_s)

    @staticmethod
    def _check_owner(held: HeldRequest, owner: str) -> None:
        if held.owner != owner:
            raise ValueError(
                f"request {held.request_id!r} is held by another owner; only its owner may "
                "reserve, renew or release it"
            )

    def _allocate_table(self, held: HeldRequest, owner: str, num_fresh: int) -> bool:
        """Table = the held hit + ``num_fresh`` fresh blocks; False (all of the request's pins
        released and the request forgotten: a refusal holds nothing) when the pool or the
        owner's cap cannot give them."""
        fresh_block_ids = None
        if self._fits_owner_cap(owner, num_fresh):
            fresh_block_ids = self.pool.allocate(num_fresh)
        if fresh_block_ids is None:
            self.pool.free(held.hit_block_ids, validate=False)
            self._release_host(held)
            self._count_owner_blocks(held.owner, -len(held.hit_block_ids))
            del self._requests[held.request_id]
            return False
        held.block_table = held.hit_block_ids + tuple(fresh_block_ids)
        self._count_owner_blocks(held.owner, num_fresh)
        return True

    def _release_host(self, held: HeldRequest) -> None:
        if held.host_slots:
            slots, held.host_slots = held.host_slots, ()
            self.pool.host.release(slots)  # type: ignore[union-attr]

    def _fits_owner_cap(self, owner: str, num_fresh: int) -> bool:
        if self.max_blocks_per_owner is None:
            return True
        return self.num_owner_blocks(owner) + num_fresh <= self.max_blocks_per_owner

    def _count_owner_blocks(self, owner: str, delta: int) -> None:
        num_blocks = self._owner_blocks.get(owner, 0) + delta
        if num_blocks:
            self._owner_blocks[owner] = num_blocks
        else:  # an owner holding nothing is forgotten (owners come and go with restarts)
            self._owner_blocks.pop(owner, None)

    def _held(self, request_id: str) -> HeldRequest:
        held = self._requests.get(request_id)
        if held is None:
            raise KeyError(
                f"request {request_id!r} holds nothing on this stage (never probed, released, "
                "or its lease expired); probe_pin first"
            )
        return held

    @staticmethod
    def _held_block_ids(held: HeldRequest) -> tuple[int, ...]:
        return held.block_table if held.block_table is not None else held.hit_block_ids
