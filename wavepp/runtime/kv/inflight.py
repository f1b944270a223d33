"""Which block hashes live requests are computing right now (prefix-aware admission).

Async agreement admits a request early, often while an earlier request that shares its prefix
is still computing that prefix; agreeing then finds the prefix uncached on every stage and the
request computes it again. The scheduler records, for each admitted request, the hashes of the
full blocks it will compute (past its agreed prefix L*); a new request whose leading hashes
overlap those of a live request waits for that request to finish, then agrees and reuses its
blocks. Pure bookkeeping, no I/O: the scheduler owns the waiting.

Layout of a waiter's prompt against the owner's computing blocks::

    waiter hashes:  h0 h1 h2 h3 h4 h5 h6 ...
    owner computes:       h2 h3 h4            (owner's L* = 2)
    deepest overlap: index 4 -> wait for the owner, then L* can reach 5 blocks
"""

from __future__ import annotations

from collections.abc import Sequence


class InflightPrefixIndex:
    """block hash -> request id of the live request computing it (first owner wins)."""

    def __init__(self) -> None:
        self._owner_of: dict[bytes, str] = {}
        self._hashes_of: dict[str, list[bytes]] = {}

    def __len__(self) -> int:
        return len(self._hashes_of)

    def add(self, request_id: str, computing_hashes: Sequence[bytes]) -> None:
        """Record the full-block hashes ``request_id`` will compute (past its agreed prefix)."""
        owned = []
        for block_hash in computing_hashes:
            if block_hash not in self._owner_of:
                self._owner_of[block_hash] = request_id
                owned.append(block_hash)
        self._hashes_of[request_id] = owned

    def remove(self, request_id: str) -> None:
        """Forget a request (finished or failed); unknown ids are ignored."""
        for block_hash in self._hashes_of.pop(request_id, []):
            if self._owner_of.get(block_hash) == request_id:
                del self._owner_of[block_hash]

    def deepest_overlap(self, block_hashes: Sequence[bytes]) -> tuple[str | None, int]:
        """The owner of the deepest of ``block_hashes`` being computed, and that depth.

        Returns:
            ``(request_id, num_blocks)``: waiting for ``request_id`` can make the first
            ``num_blocks`` blocks reusable; ``(None, 0)`` when no block is being computed.
            Hashes are chained, so a match at index i means the whole prefix [0, i] is equal.
        """
        for index in range(len(block_hashes) - 1, -1, -1):
            owner = self._owner_of.get(block_hashes[index])
            if owner is not None:
                return owner, index + 1
        return None, 0
