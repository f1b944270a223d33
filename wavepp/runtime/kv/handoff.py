"""Handoff leases: a prefilled request's blocks stay pinned on a stage until a decode engine has
pulled them, or the lease ends.

When a request that asks for a handoff finishes its last chunk on a stage, the stage takes one
more reference on each of the request's blocks (``BlockPool.pin``): the scheduler's own release
of the request then leaves them pinned, so neither eviction nor reuse can touch them while the
decode side reads. ``release`` (the decode side is done, or gave up) and ``expire`` (the lease's
time passed: decode gone or never came) drop that reference; cached blocks stay cached.

Invariant: each lease holds exactly one reference on each of its blocks; after every lease is
released the pool's free and pinned counts are what they would be without handoffs.
Pure: no I/O, no clock but the ``now`` its callers pass.
"""

from __future__ import annotations

from dataclasses import dataclass

from wavepp.runtime.kv.pool import BlockPool


@dataclass(frozen=True)
class HandoffLease:
    """One request's pinned KV on this stage.

    ``block_ids``: its blocks, block order, covering tokens ``[0, num_tokens)``; ``expires``:
    the caller's clock seconds when the lease ends.
    """

    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    expires: float


class HandoffLeases:
    """The handoff leases of one stage over its block pool. See the module docstring.

    Args:
        pool: the stage's block pool (the same one its ``StageKVManager`` owns).
        max_leases: most leases held at once (each pins its request's blocks), > 0.
    """

    def __init__(self, pool: BlockPool, *, max_leases: int = 4096) -> None:
        if max_leases < 1:
            raise ValueError(f"max_leases={max_leases} must be >= 1")
        self.pool = pool
        self.max_leases = max_leases
        self._leases: dict[str, HandoffLease] = {}
        self.num_expired = 0

    def __len__(self) -> int:
        return len(self._leases)

    def get(self, request_id: str) -> HandoffLease | None:
        return self._leases.get(request_id)

    def hold(
        self, request_id: str, block_ids: tuple[int, ...], num_tokens: int, expires: float
    ) -> HandoffLease:
        """Pin ``block_ids`` (the request's blocks, still pinned by the request itself) for a
        handoff ending at ``expires``.

        Raises:
            ValueError: the request already has a lease, ``max_leases`` are held, the blocks do
                not cover ``num_tokens`` (``ceil(num_tokens / block_size)`` needed), or the pool
                refuses a block (free and uncached: not this request's). Nothing changes then.
        """
        if request_id in self._leases:
            raise ValueError(f"request_id={request_id!r} already has a handoff lease")
        if len(self._leases) >= self.max_leases:
            raise ValueError(f"{self.max_leases} handoff leases held (max_leases); refused")
        needed = -(-num_tokens // self.pool.block_size)
        if num_tokens < 1 or len(block_ids) < needed:
            raise ValueError(
                f"block_ids: {len(block_ids)} blocks cannot hold num_tokens={num_tokens} "
                f"({needed} blocks of {self.pool.block_size} needed)"
            )
        blocks = tuple(block_ids[:needed])
        self.pool.pin(blocks)
        lease = HandoffLease(request_id, blocks, num_tokens, expires)
        self._leases[request_id] = lease
        return lease

    def release(self, request_id: str) -> bool:
        """Drop the request's lease (its pins); False when it holds none."""
        lease = self._leases.pop(request_id, None)
        if lease is None:
            return False
        self.pool.free(lease.block_ids)
        return True

    def expire(self, now: float) -> list[str]:
        """Release every lease whose ``expires`` <= ``now``; their request ids."""
        ended = [rid for rid, lease in self._leases.items() if lease.expires <= now]
        for request_id in ended:
            self.release(request_id)
            self.num_expired += 1
        return ended

    def release_all(self) -> list[str]:
        """Release every lease (the stage leaves its group); their request ids."""
        ended = list(self._leases)
        for request_id in ended:
            self.release(request_id)
        return ended

    def num_pinned_blocks(self) -> int:
        """References the leases hold (one per block per lease)."""
        return sum(len(lease.block_ids) for lease in self._leases.values())
