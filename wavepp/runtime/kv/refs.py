"""The reference mechanics under a ``BlockPool``: the only places ref counts move.

``BlockRefs`` owns what ``BlockPool``'s operations rest on: block id checks, one reference more
or less per block (``_incr_refs``, ``_release``), shared-prefix spans (``_pin_span``,
``_unspan``: one holder count for a prefix many requests pin), taking cached blocks off the LRU
front (``_evict``, spilling them to the host tier), and the structural invariants all of these
keep (``check_invariants``). The state itself (``BlockPool.__init__``) and its meaning are
documented on ``BlockPool`` (``wavepp.runtime.kv.pool``). Pure: no I/O, no torch, no clock.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence

from wavepp.runtime.kv.hashing import BlockHash
from wavepp.runtime.kv.host import HostTier, _invariant

_INT_TYPES = frozenset((int, bool))


class BlockRefs:
    """Ref counts, spans and the free queue of a ``BlockPool`` (its base class; the state is
    set by ``BlockPool.__init__``, whose docstring states each field's invariant)."""

    num_blocks: int
    host: HostTier | None
    _ref: list[int]
    _hash: list[BlockHash | None]
    _hash_to_id: dict[BlockHash, int]
    _uncached: list[int]
    _lru: OrderedDict[int, None]
    _spans: set[tuple[int, ...]]
    _span_of: list[tuple[int, ...] | None]
    _holders: list[int]
    _evictions: int

    def check_invariants(self) -> None:
        """Check every structural invariant; for tests.

        Raises:
            AssertionError: naming the first invariant that does not hold.
        """
        uncached, lru = self._uncached, list(self._lru)
        queued = set(uncached) | set(lru)
        _invariant(len(queued) == len(uncached) + len(lru), "free queue: a block is queued twice")
        for block_id in uncached:
            _invariant(self._hash[block_id] is None, f"block {block_id}: uncached part, hashed")
        for block_id in lru:
            _invariant(self._hash[block_id] is not None, f"block {block_id}: LRU part, no hash")
        in_spans = {}
        span_heads = {span[0] for span in self._spans}
        for block_id, holders in enumerate(self._holders):
            _invariant(
                (holders >= 1) == (block_id in span_heads),
                f"block {block_id}: {holders} span holders, a span's first block: "
                f"{block_id in span_heads}",
            )
        for span in self._spans:
            for block_id in span:
                _invariant(block_id not in in_spans, f"block {block_id}: in two spans")
                in_spans[block_id] = span
        for block_id in range(self.num_blocks):
            ref_cnt = self._ref[block_id]
            _invariant(ref_cnt >= 0, f"block {block_id}: ref count {ref_cnt}")
            _invariant(
                (block_id in queued) == (ref_cnt == 0),
                f"block {block_id}: queued={block_id in queued} but ref count {ref_cnt}",
            )
            _invariant(
                self._span_of[block_id] == in_spans.get(block_id),
                f"block {block_id}: span index disagrees with the spans",
            )
            block_hash = self._hash[block_id]
            if block_hash is not None:
                _invariant(
                    self._hash_to_id.get(block_hash) == block_id,
                    f"block {block_id}: its hash maps to another block",
                )
        num_hashed = sum(block_hash is not None for block_hash in self._hash)
        _invariant(num_hashed == len(self._hash_to_id), "hash map holds unhashed blocks")
        for block_hash, block_id in self._hash_to_id.items():
            _invariant(self._hash[block_id] == block_hash, f"hash map entry for block {block_id}")

    def _check_id(self, block_id: int, field: str) -> int:
        if type(block_id) is int and 0 <= block_id < self.num_blocks:
            return block_id
        if not isinstance(block_id, int) or not 0 <= block_id < self.num_blocks:
            raise ValueError(
                f"{field}: block id {block_id!r} is not in [0, {self.num_blocks}) "
                "(this pool's capacity)"
            )
        return int(block_id)

    def _check_ids(self, block_ids: Sequence[int]) -> None:
        """``_check_id`` of each id; one C-level pass when they are all ints in range."""
        try:
            if (
                not block_ids
                or min(block_ids) >= 0
                and max(block_ids) < self.num_blocks
                and set(map(type, block_ids)) <= _INT_TYPES
            ):
                return
        except TypeError:
            pass
        for block_id in block_ids:
            self._check_id(block_id, "block_ids")

    def _incr_refs(self, block_ids: Sequence[int]) -> None:
        """One reference more on each block (checked ids; free ones must be cached)."""
        ref, lru = self._ref, self._lru
        for block_id in block_ids:
            if not ref[block_id]:
                del lru[block_id]
            ref[block_id] += 1

    def _pin_span(self, span: tuple[int, ...]) -> bool:
        """One holder more of ``span`` (pinned blocks, chain order); False (nothing done) when
        it overlaps another span or repeats a block: pin it per block instead."""
        span_of = self._span_of
        held = span_of[span[0]]
        if held is not None and held == span:
            self._holders[span[0]] += 1
            return True
        if any([span_of[block_id] is not None for block_id in span]) or len(set(span)) < len(span):
            return False
        self._incr_refs(span)
        for block_id in span:
            span_of[block_id] = span
        self._spans.add(span)
        self._holders[span[0]] = 1
        return True

    def _unspan(self, span: tuple[int, ...], as_refs: bool = False) -> None:
        """Forget ``span``; with ``as_refs`` its holders become per-block references (each
        block then carries one reference per holder), else its one reference stays to drop."""
        self._spans.remove(span)
        holders, self._holders[span[0]] = self._holders[span[0]], 0
        span_of, ref = self._span_of, self._ref
        for block_id in span:
            span_of[block_id] = None
            if as_refs:
                ref[block_id] += holders - 1

    def _release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference per occurrence, reversed (checked ids); ValueError, nothing
        changed, if one is released more often than referenced."""
        if not block_ids:
            return
        ref, span_of = self._ref, self._span_of
        # a block's own references: its ref count less the one of its span
        if (
            len(set(block_ids)) != len(block_ids)
            or 0 in [ref[block_id] for block_id in block_ids]
            or self._spans
            and any([ref[block_id] <= (span_of[block_id] is not None) for block_id in block_ids])
        ):
            releases = Counter(block_ids)
            for block_id in releases:
                if span_of[block_id] is not None:  # cut into a span: per-block refs first
                    self._unspan(span_of[block_id], as_refs=True)
            for block_id, num_releases in releases.items():
                if num_releases > ref[block_id]:
                    raise ValueError(
                        f"block_ids: block {block_id} released {num_releases} time(s) but its "
                        f"ref count is {ref[block_id]}; free only blocks you pinned or "
                        "allocated, once each"
                    )
        uncached, lru, hashes = self._uncached, self._lru, self._hash
        for block_id in reversed(block_ids):
            ref_cnt = ref[block_id] - 1
            ref[block_id] = ref_cnt
            if not ref_cnt:
                if hashes[block_id] is None:
                    uncached.append(block_id)
                else:
                    lru[block_id] = None

    def _evict(self, num_blocks: int, taken: list[int]) -> list[BlockHash]:
        """Take ``num_blocks`` cached blocks from the LRU front onto ``taken``, dropping their
        hashes; returns the hashes, eviction order."""
        lru, hashes, hash_to_id = self._lru, self._hash, self._hash_to_id
        evicted: list[BlockHash] = []
        for _ in range(num_blocks):
            block_id = lru.popitem(last=False)[0]
            block_hash = hashes[block_id]
            assert block_hash is not None, f"block {block_id}: in the LRU without a hash"
            del hash_to_id[block_hash]
            hashes[block_id] = None
            evicted.append(block_hash)
            taken.append(block_id)
        self._evictions += num_blocks
        if self.host is not None:
            spill = self.host.spill
            for block_id, block_hash in zip(taken[-num_blocks:], evicted, strict=True):
                spill(block_id, block_hash)
        return evicted
