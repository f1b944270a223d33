"""Pool router: which pipeline replica gets a request (pure; the gateway owns the I/O).

Each replica's stages publish KV events (``{p}.kv_events.{rank}``: block hashes stored and
removed). The router keeps, per replica and stage, the set of block hashes the stage holds (a
shadow index), so it can estimate a replica's reusable prefix for a prompt the same way the
agreement controller computes L*: the number of leading block hashes held on *every* stage.
The index of a stage holds at most that stage's block count (``stage_blocks``; a stage cannot
hold more): a stored hash past it evicts the oldest one, so a flood of KV events cannot grow it.

    choose(hashes): replicas in the pool
        -> longest reusable prefix (blocks), ties -> fewest requests outstanding,
           ties -> the replica after the last chosen one (round-robin among equals)

A replica is in the pool while it sends heartbeats (its admission service's) within
``timeout_s`` and its last one said ``ready`` (every stage formed, no re-form under way); one
that stops or turns not ready leaves the pool, and the gateway re-routes its pending requests,
unless it is *draining* (told to stop on a scale-down: not ready, but it finishes what it was
sent; ``is_finishing``): then the gateway waits for its answers, and re-routes only if it falls
silent. A request is routed to a draining replica only when no other replica is known.
Replicas may join (``add_replica``: a heartbeat of the pool from one not configured) and leave
(``forget``) while the gateway runs.
Policies ``round_robin`` and ``least_loaded`` ignore the index (for comparison and fallback).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

DEFAULT_STAGE_BLOCKS = 1 << 18
"""The index bound per stage when a replica's block counts are not given (hashes)."""

RoutingPolicy = Literal["prefix", "round_robin", "least_loaded"]


@dataclass
class ReplicaState:
    """What the router knows of one replica: per-stage held block hashes (oldest stored
    first, at most ``stage_blocks[r]`` each), load, liveness."""

    name: str
    num_stages: int
    stage_blocks: list[int] = field(default_factory=list)
    held: list[OrderedDict[bytes, None]] = field(default_factory=list)
    num_outstanding: int = 0
    last_heartbeat_s: float = -1.0
    is_ready: bool = False
    is_draining: bool = False

    def __post_init__(self) -> None:
        if not self.stage_blocks:
            self.stage_blocks = [DEFAULT_STAGE_BLOCKS] * self.num_stages
        if len(self.stage_blocks) != self.num_stages or min(self.stage_blocks) < 1:
            raise ValueError(
                f"stage_blocks={self.stage_blocks}: replica {self.name} needs one count >= 1 "
                f"per stage ({self.num_stages})"
            )
        if not self.held:
            self.held = [OrderedDict() for _ in range(self.num_stages)]

    def num_reusable_blocks(self, block_hashes: Sequence[bytes]) -> int:
        """Leading blocks of ``block_hashes`` held on every stage (the shadow L*)."""
        num = 0
        for block_hash in block_hashes:
            if not all(block_hash in held for held in self.held):
                break
            num += 1
        return num


class PoolRouter:
    """Chooses a replica per request; see the module docstring.

    Args:
        replicas: (name, num_stages) or (name, num_stages, blocks per stage) of each replica,
            in pool order; without block counts each stage's index holds at most
            ``DEFAULT_STAGE_BLOCKS`` hashes.
        policy: ``prefix`` (default), ``round_robin`` or ``least_loaded``.
        timeout_s: a replica without a heartbeat for this long is out of the pool.
    """

    def __init__(
        self,
        replicas: Sequence[tuple[str, int] | tuple[str, int, Sequence[int]]],
        *,
        policy: RoutingPolicy = "prefix",
        timeout_s: float = 3.0,
    ) -> None:
        if not replicas:
            raise ValueError("replicas: the pool needs at least one replica")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s}: must be > 0")
        self.replicas = [
            ReplicaState(r[0], r[1], list(r[2]) if len(r) > 2 else [])  # type: ignore[misc]
            for r in replicas
        ]
        self.by_name = {r.name: r for r in self.replicas}
        self.policy: RoutingPolicy = policy
        self.timeout_s = timeout_s
        self._next = 0

    # ---- inputs --------------------------------------------------------------------------

    def on_kv_events(
        self,
        replica: str,
        rank: int,
        stored: Sequence[Sequence[bytes]],
        removed: Sequence[Sequence[bytes]],
    ) -> None:
        """Apply one stage's KV event batch (stored first, then removed, as the pool emits).

        Raises:
            KeyError: unknown replica. ValueError: rank out of range.
        """
        state = self.by_name[replica]
        if not 0 <= rank < state.num_stages:
            raise ValueError(f"rank={rank}: replica {replica} has {state.num_stages} stages")
        held = state.held[rank]
        capacity = state.stage_blocks[rank]
        for hashes in stored:
            for block_hash in hashes:
                held[block_hash] = None
                held.move_to_end(block_hash)
                if len(held) > capacity:
                    held.popitem(last=False)
        for hashes in removed:
            for block_hash in hashes:
                held.pop(block_hash, None)

    def on_heartbeat(
        self, replica: str, now_s: float, *, is_ready: bool, is_draining: bool = False
    ) -> bool:
        """Take a heartbeat of ``replica``; True when it says the replica began to drain."""
        state = self.by_name[replica]
        began = is_draining and not state.is_draining
        state.last_heartbeat_s = now_s
        state.is_ready = is_ready and not is_draining
        state.is_draining = is_draining
        return began

    # ---- queries -------------------------------------------------------------------------

    def add_replica(self, name: str, num_stages: int) -> ReplicaState:
        """Start routing to a replica that joined at run time (idempotent).

        Raises:
            ValueError: ``num_stages`` < 1.
        """
        if name in self.by_name:
            return self.by_name[name]
        if num_stages < 1:
            raise ValueError(f"num_stages={num_stages}: replica {name} needs >= 1 stage")
        state = ReplicaState(name, num_stages)
        self.replicas.append(state)
        self.by_name[name] = state
        return state

    def forget(self, name: str) -> None:
        """Drop a replica (scaled away) and its shadow index; unknown names are ignored."""
        state = self.by_name.pop(name, None)
        if state is not None:
            self.replicas.remove(state)
            self._next = self._next % len(self.replicas) if self.replicas else 0

    def is_alive(self, replica: str, now_s: float) -> bool:
        """A heartbeat within ``timeout_s`` (ready or not)."""
        state = self.by_name.get(replica)
        if state is None:
            return False
        return state.last_heartbeat_s >= 0 and now_s - state.last_heartbeat_s <= self.timeout_s

    def in_pool(self, replica: str, now_s: float) -> bool:
        """Alive and ready: requests are routed to it."""
        return self.is_alive(replica, now_s) and self.by_name[replica].is_ready

    def is_finishing(self, replica: str, now_s: float) -> bool:
        """Alive and draining: it answers what it was sent (do not re-route those)."""
        return self.is_alive(replica, now_s) and self.by_name[replica].is_draining

    def pool(self, now_s: float) -> list[ReplicaState]:
        """Replicas in the pool now (a ready heartbeat within ``timeout_s``)."""
        return [r for r in self.replicas if self.in_pool(r.name, now_s)]

    def choose(
        self, block_hashes: Sequence[bytes], now_s: float, *, exclude: Sequence[str] = ()
    ) -> tuple[ReplicaState, int]:
        """The replica for a prompt with ``block_hashes`` (chained, the tenant's salt).

        Falls back to every replica not excluded when none is in the pool (intake is durable:
        the request waits in that replica's stream), draining ones last (they take nothing new).

        Returns:
            (replica, its reusable prefix in blocks by the shadow index).

        Raises:
            LookupError: every replica is excluded.
        """
        candidates = [r for r in self.pool(now_s) if r.name not in exclude]
        if not candidates:
            candidates = [r for r in self.replicas if r.name not in exclude and not r.is_draining]
        if not candidates:
            candidates = [r for r in self.replicas if r.name not in exclude]
        if not candidates:
            raise LookupError(f"no replica left to route to (excluded {list(exclude)})")
        order = {r.name: (i - self._next) % len(self.replicas) for i, r in enumerate(self.replicas)}
        if self.policy == "round_robin":
            chosen = min(candidates, key=lambda r: order[r.name])
        elif self.policy == "least_loaded":
            chosen = min(candidates, key=lambda r: (r.num_outstanding, order[r.name]))
        else:
            chosen = min(
                candidates,
                key=lambda r: (
                    -r.num_reusable_blocks(block_hashes),
                    r.num_outstanding,
                    order[r.name],
                ),
            )
        self._next = (self.replicas.index(chosen) + 1) % len(self.replicas)
        return chosen, chosen.num_reusable_blocks(block_hashes)
