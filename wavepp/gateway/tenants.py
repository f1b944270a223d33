"""Tenants: cache salts, per-tenant limits, and the weighted fair-share queue (pure, no I/O).

Every function takes the time as an argument (``now_s``, seconds on any monotonic clock), so
tests drive it with a fake clock.

- Cache salt: a tenant's block hashes are seeded by its salt (docs/design.md 'block hash'), so two
  tenants share no cached block unless the spec gives them the same ``cacheSalt`` explicitly.
  Default salt: ``tenant:{name}``.
- Limits: at most ``max_concurrency`` requests queued or running per tenant, and a token bucket
  of ``tokens_per_s`` prompt tokens with ``burst_tokens`` capacity. A request over a limit is
  refused with the seconds after which a retry can succeed (HTTP 429 + Retry-After).
- Fair share: start-time fair queuing over prompt tokens. Each backlogged tenant t carries a
  virtual time v_t; the queue serves the tenant with the smallest v_t and advances it by
  cost / weight_t. A tenant that becomes backlogged starts at max(v_t, V), V = the virtual time
  of the last served request, so idling earns no credit (Goyal et al., SFQ, SIGCOMM'96).
  Within a tenant: higher request ``priority`` first, then arrival order.
- Tenant priority: strict between tenants. A backlogged tenant of higher ``priority`` is
  served before any tenant of lower priority (an interactive tenant over a batch one); tenants
  of equal priority share by weight as above. A low-priority tenant can wait as long as
  higher-priority ones keep the gateway busy: that is the point of the setting.
- Queue limit: at most ``max_queued`` requests of a tenant wait for a slot (the gateway checks
  it, :meth:`FairShareQueue.num_queued`); past it 429.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from wavepp.api.spec import TenantSpec

T = TypeVar("T")


def default_cache_salt(tenant: str) -> str:
    """The salt of a tenant whose spec gives none: unique per tenant name."""
    return f"tenant:{tenant}"


class TenantPolicy(BaseModel):
    """One tenant as the gateway enforces it.

    ``max_concurrency``: requests queued or running at once (None: unlimited).
    ``max_queued``: requests waiting for a slot (None: unlimited; 0: never wait).
    ``tokens_per_s`` / ``burst_tokens``: prompt-token rate limit (None: unlimited); the burst
    defaults to one second's worth, at least ``max_prompt_tokens`` of the gateway.
    ``priority``: strict priority between tenants (higher first; module docstring).
    ``api_keys_file``: the tenant's key file (``wavepp.gateway.auth``); None: no keys.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=63)
    cache_salt: str
    weight: int = Field(1, ge=1)
    max_concurrency: int | None = Field(None, ge=1)
    tokens_per_s: float | None = Field(None, gt=0)
    burst_tokens: int | None = Field(None, ge=1)
    max_queued: int | None = Field(None, ge=0)
    priority: int = Field(0, ge=-100, le=100)
    api_keys_file: str | None = None


def policy_from_spec(tenant: TenantSpec, *, api_keys_file: str | None = None) -> TenantPolicy:
    """The policy the gateway enforces for a spec's tenant (every limit the spec sets).

    ``api_keys_file``: where the gateway reads the tenant's keys (the Secret's mount or the
    ``wavepp up`` file); the spec's own key fields are not read here.
    """
    return TenantPolicy(
        name=tenant.name,
        cache_salt=tenant.cache_salt or default_cache_salt(tenant.name),
        weight=tenant.weight,
        priority=tenant.priority,
        max_concurrency=tenant.max_concurrency,
        max_queued=tenant.max_queued,
        tokens_per_s=tenant.tokens_per_s,
        burst_tokens=tenant.burst_tokens,
        api_keys_file=api_keys_file,
    )


class LimitExceeded(Exception):
    """A request over a tenant limit: ``field`` names the limit, ``retry_after_s`` when to retry."""

    def __init__(self, field: str, limit: float, retry_after_s: float, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.limit = limit
        self.retry_after_s = retry_after_s


@dataclass
class TokenBucket:
    """Token bucket: ``rate_per_s`` tokens refill per second up to ``capacity`` tokens."""

    rate_per_s: float
    capacity: float
    num_tokens: float = math.nan
    last_s: float = math.nan

    def try_take(self, num_tokens: float, now_s: float) -> float:
        """Take ``num_tokens`` if available.

        Returns:
            0.0 when taken; else the seconds until they would be available (nothing taken).
            A request larger than the capacity gets ``inf``.
        """
        if math.isnan(self.num_tokens):
            self.num_tokens, self.last_s = self.capacity, now_s
        elapsed = max(0.0, now_s - self.last_s)
        self.num_tokens = min(self.capacity, self.num_tokens + elapsed * self.rate_per_s)
        self.last_s = now_s
        if num_tokens > self.capacity:
            return math.inf
        if num_tokens <= self.num_tokens:
            self.num_tokens -= num_tokens
            return 0.0
        return (num_tokens - self.num_tokens) / self.rate_per_s


class TenantLimiter:
    """Per-tenant concurrency and token-rate limits. ``acquire`` then ``release`` once."""

    def __init__(self, policies: Iterable[TenantPolicy], *, max_prompt_tokens: int) -> None:
        self.policies = {p.name: p for p in policies}
        self.num_active: dict[str, int] = dict.fromkeys(self.policies, 0)
        self._buckets: dict[str, TokenBucket] = {}
        for p in self.policies.values():
            if p.tokens_per_s is not None:
                burst = p.burst_tokens or max(p.tokens_per_s, max_prompt_tokens)
                self._buckets[p.name] = TokenBucket(p.tokens_per_s, float(burst))

    def acquire(self, tenant: str, num_tokens: int, now_s: float) -> None:
        """Count one request of ``num_tokens`` prompt tokens against ``tenant``'s limits.

        Raises:
            KeyError: unknown tenant.
            LimitExceeded: over ``max_concurrency`` or ``tokens_per_s`` (nothing is counted).
        """
        policy = self.policies[tenant]
        if policy.max_concurrency is not None and self.num_active[tenant] >= policy.max_concurrency:
            raise LimitExceeded(
                "max_concurrency",
                policy.max_concurrency,
                1.0,
                f"tenant {tenant!r} has {self.num_active[tenant]} requests in flight; "
                f"limit max_concurrency={policy.max_concurrency}",
            )
        bucket = self._buckets.get(tenant)
        if bucket is not None:
            wait_s = bucket.try_take(num_tokens, now_s)
            if wait_s > 0:
                raise LimitExceeded(
                    "tokens_per_s",
                    bucket.rate_per_s,
                    wait_s if math.isfinite(wait_s) else 60.0,
                    f"tenant {tenant!r}: {num_tokens} prompt tokens exceed the rate limit "
                    f"tokens_per_s={bucket.rate_per_s:g} (burst {bucket.capacity:g})",
                )
        self.num_active[tenant] += 1

    def release(self, tenant: str) -> None:
        assert self.num_active[tenant] > 0, f"release without acquire for tenant {tenant!r}"
        self.num_active[tenant] -= 1


@dataclass(order=True)
class _Entry(Generic[T]):
    neg_priority: int
    seq: int
    cost: float = field(compare=False)
    item: T = field(compare=False)


class FairShareQueue(Generic[T]):
    """Weighted fair queue over tenants (start-time fair queuing; module docstring).

    Stores, per tenant, a heap of entries ordered by (-priority, arrival) and the tenant's
    virtual time. ``pop`` serves, among the backlogged tenants of the highest tenant priority
    (``priorities``, default 0), the one with the smallest virtual time (ties: the tenant whose
    head arrived first).
    """

    def __init__(self, weights: dict[str, int], priorities: dict[str, int] | None = None) -> None:
        if any(w < 1 for w in weights.values()):
            raise ValueError(f"weights={weights}: every weight must be >= 1")
        self.weights = dict(weights)
        self.priorities = {t: (priorities or {}).get(t, 0) for t in weights}
        self._queues: dict[str, list[_Entry[T]]] = {t: [] for t in weights}
        self._vtime: dict[str, float] = dict.fromkeys(weights, 0.0)
        self._virtual_now = 0.0
        self._seq = itertools.count()

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def num_queued(self, tenant: str) -> int:
        return len(self._queues[tenant])

    def push(self, tenant: str, item: T, *, cost: float, priority: int = 0) -> None:
        """Queue ``item`` of ``tenant`` with ``cost`` (prompt tokens, > 0).

        Raises:
            KeyError: unknown tenant. ValueError: cost <= 0.
        """
        if cost <= 0:
            raise ValueError(f"cost={cost}: must be > 0")
        queue = self._queues[tenant]
        if not queue:
            self._vtime[tenant] = max(self._vtime[tenant], self._virtual_now)
        heapq.heappush(queue, _Entry(-priority, next(self._seq), cost, item))

    def pop(self) -> tuple[str, T]:
        """The next (tenant, item) in fair-share order.

        Raises:
            IndexError: the queue is empty.
        """
        backlogged = [
            (-self.priorities[t], self._vtime[t], q[0].seq, t) for t, q in self._queues.items() if q
        ]
        if not backlogged:
            raise IndexError("pop from an empty FairShareQueue")
        _, vtime, _, tenant = min(backlogged)
        entry = heapq.heappop(self._queues[tenant])
        self._virtual_now = max(self._virtual_now, vtime)
        self._vtime[tenant] = vtime + entry.cost / self.weights[tenant]
        return tenant, entry.item

    def remove(self, tenant: str, item: T) -> bool:
        """Drop a queued item (a client that went away). Returns whether it was queued."""
        queue = self._queues[tenant]
        for i, entry in enumerate(queue):
            if entry.item is item:
                queue.pop(i)
                heapq.heapify(queue)
                return True
        return False
