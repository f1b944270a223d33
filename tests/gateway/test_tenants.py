"""Tenants, limits and fair share (pure, fake clock); router and spec conversion units."""

from __future__ import annotations

import heapq
import math
from collections import deque

import pytest

from wavepp.api.spec import SpecError, WavePipelineSpec
from wavepp.gateway.router import PoolRouter
from wavepp.gateway.tenants import (
    FairShareQueue,
    LimitExceeded,
    TenantLimiter,
    TenantPolicy,
    TokenBucket,
    default_cache_salt,
)
from wavepp.gateway.validation import (
    BadRequest,
    PromptLimits,
    parse_completion_batch,
    parse_prefill,
)
from wavepp.launch.runtime_config import runtime_configs_from_spec
from wavepp.runtime.kv import hash_prompt_blocks

# ---------------------------------------------------------------------------- fair share


def _simulate(
    queue_kind: str, *, num_slots: int = 4, s_per_token: float = 1e-4
) -> dict[str, list[float]]:
    """Discrete-event run of a server with ``num_slots`` slots fed from a queue.

    heavy: 200 requests of 1024 tokens, all at t=0 (a batch job).
    light: 20 requests of 64 tokens, one every 0.25 s.
    Service time = tokens x s_per_token. Returns TTFT (finish - arrival) per tenant.
    """
    arrivals = [(0.0, "heavy", 1024)] * 200 + [(0.25 * i, "light", 64) for i in range(20)]
    arrivals.sort(key=lambda a: a[0])
    fair: FairShareQueue[tuple[float, int]] = FairShareQueue({"heavy": 1, "light": 1})
    fifo: deque[tuple[str, tuple[float, int]]] = deque()
    events: list[tuple[float, int, str, tuple]] = []  # (time, order, kind, payload)
    for i, (t, tenant, num_tokens) in enumerate(arrivals):
        heapq.heappush(events, (t, i, "arrive", (tenant, num_tokens)))
    order = len(arrivals)
    free = num_slots
    ttft: dict[str, list[float]] = {"heavy": [], "light": []}
    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "arrive":
            tenant, num_tokens = payload
            if queue_kind == "fair":
                fair.push(tenant, (now, num_tokens), cost=num_tokens)
            else:
                fifo.append((tenant, (now, num_tokens)))
        else:
            tenant, arrival = payload
            ttft[tenant].append(now - arrival)
            free += 1
        while free and (len(fair) if queue_kind == "fair" else fifo):
            tenant, (arrival, num_tokens) = fair.pop() if queue_kind == "fair" else fifo.popleft()
            free -= 1
            order += 1
            heapq.heappush(
                events, (now + num_tokens * s_per_token, order, "done", (tenant, arrival))
            )
    return ttft


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


def test_heavy_tenant_does_not_starve_a_light_one() -> None:
    fair = _simulate("fair")
    fifo = _simulate("fifo")
    assert len(fair["light"]) == len(fifo["light"]) == 20
    assert len(fair["heavy"]) == len(fifo["heavy"]) == 200
    # bound: one heavy request's service time (a slot frees within it) + its own service time
    bound_s = 1024 * 1e-4 + 64 * 1e-4
    print(f"light p99 TTFT: fair {_p99(fair['light']):.4f} s, FIFO {_p99(fifo['light']):.4f} s")
    assert _p99(fair["light"]) <= bound_s + 1e-9
    assert _p99(fifo["light"]) > 10 * bound_s  # the same arrivals starve under FIFO
    # the heavy tenant still gets the rest: its total work finishes no later than under FIFO
    assert max(fair["heavy"]) <= max(fifo["heavy"]) + 20 * 64 * 1e-4


def test_fair_share_follows_weights_and_priority() -> None:
    queue: FairShareQueue[str] = FairShareQueue({"a": 3, "b": 1})
    for i in range(8):
        queue.push("a", f"a{i}", cost=100)
        queue.push("b", f"b{i}", cost=100)
    served = [queue.pop()[0] for _ in range(8)]
    assert served.count("a") == 6 and served.count("b") == 2
    queue = FairShareQueue({"a": 1})
    queue.push("a", "low", cost=1)
    queue.push("a", "high", cost=1, priority=5)
    assert queue.pop() == ("a", "high")
    assert queue.remove("a", "low") and len(queue) == 0
    with pytest.raises(IndexError):
        queue.pop()


def test_idle_tenant_earns_no_credit() -> None:
    queue: FairShareQueue[int] = FairShareQueue({"a": 1, "b": 1})
    for i in range(10):
        queue.push("a", i, cost=10)
    for _ in range(10):
        queue.pop()
    for i in range(4):
        queue.push("a", i, cost=10)
        queue.push("b", i, cost=10)
    served = [queue.pop()[0] for _ in range(4)]
    assert served.count("b") == 2  # b, idle until now, alternates with a instead of catching up


# ---------------------------------------------------------------------------- limits


def test_token_bucket_and_limiter() -> None:
    bucket = TokenBucket(rate_per_s=10, capacity=100)
    assert bucket.try_take(64, now_s=0.0) == 0.0
    assert bucket.try_take(64, now_s=0.0) == pytest.approx(2.8)
    assert bucket.try_take(64, now_s=2.8) == 0.0
    assert bucket.try_take(101, now_s=100.0) == math.inf
    limiter = TenantLimiter(
        [TenantPolicy(name="a", cache_salt="s", max_concurrency=2)], max_prompt_tokens=10
    )
    limiter.acquire("a", 5, 0.0)
    limiter.acquire("a", 5, 0.0)
    with pytest.raises(LimitExceeded) as info:
        limiter.acquire("a", 5, 0.0)
    assert info.value.field == "max_concurrency" and info.value.limit == 2
    limiter.release("a")
    limiter.acquire("a", 5, 0.0)
    with pytest.raises(KeyError):
        limiter.acquire("nobody", 1, 0.0)


def test_default_salts_differ_per_tenant() -> None:
    tokens = list(range(64))
    a = hash_prompt_blocks(tokens, 16, "m", default_cache_salt("a"))
    b = hash_prompt_blocks(tokens, 16, "m", default_cache_salt("b"))
    assert not set(a) & set(b)


# ---------------------------------------------------------------------------- validation

LIMITS = PromptLimits(vocab_size=100, max_prompt_tokens=32, tenants=frozenset({"a", "default"}))


@pytest.mark.parametrize(
    ("body", "field", "limit"),
    [
        ([], "body", None),
        ({"tenant": "a"}, "token_ids", None),
        ({"tenant": "a", "token_ids": [1] * 33}, "token_ids", 32),
        ({"tenant": "a", "token_ids": [1, 100]}, "token_ids[1]", 100),
        ({"tenant": "a", "token_ids": [True]}, "token_ids[0]", 100),
        ({"tenant": "a", "token_ids": [1], "priority": 1000}, "priority", 100),
        ({"tenant": "a", "token_ids": [1], "extra": 1}, "extra", None),
        ({"tenant": "a", "text": "hello"}, "text", None),
    ],
)
def test_parse_prefill_names_field_and_limit(body: object, field: str, limit: object) -> None:
    with pytest.raises(BadRequest) as info:
        parse_prefill(body, LIMITS)
    assert info.value.field == field and info.value.limit == limit


def test_parse_completion() -> None:
    (parsed,) = parse_completion_batch({"prompt": [1, 2]}, LIMITS, model_name="m").prompts
    assert parsed.tenant == "default" and parsed.token_ids == [1, 2]
    batch = parse_completion_batch({"prompt": ["x y"]}, LIMITS, lambda t: [3, 4], tenant_header="a")
    (parsed,) = batch.prompts
    assert parsed.tenant == "a" and parsed.token_ids == [3, 4]
    with pytest.raises(BadRequest) as info:
        parse_completion_batch({"prompt": [1], "max_tokens": 2}, LIMITS)
    assert info.value.field == "max_tokens" and info.value.limit == 1


# ---------------------------------------------------------------------------- router


def _router(policy: str = "prefix") -> PoolRouter:
    router = PoolRouter([("r0", 2), ("r1", 2)], policy=policy, timeout_s=3.0)  # type: ignore[arg-type]
    router.on_heartbeat("r0", 0.0, is_ready=True)
    router.on_heartbeat("r1", 0.0, is_ready=True)
    return router


def test_router_prefers_the_replica_holding_the_prefix_on_every_stage() -> None:
    router = _router()
    hashes = [b"h0", b"h1", b"h2"]
    router.on_kv_events("r1", 0, [hashes], [])
    router.on_kv_events("r1", 1, [hashes[:2]], [])
    router.on_kv_events("r0", 0, [hashes[:1]], [])
    router.on_kv_events("r0", 1, [hashes[:1]], [])
    replica, num_blocks = router.choose(hashes, 1.0)
    assert (replica.name, num_blocks) == ("r1", 2)  # stage 1 of r1 holds 2: L* = 2
    router.on_kv_events("r1", 1, [], [[b"h0"]])  # evicted on one stage: no longer reusable
    replica, num_blocks = router.choose(hashes, 1.0)
    assert (replica.name, num_blocks) == ("r0", 1)


def test_router_ties_go_to_least_loaded_and_dead_replicas_leave() -> None:
    router = _router()
    router.replicas[0].num_outstanding = 3
    assert router.choose([b"x"], 1.0)[0].name == "r1"
    router.on_heartbeat("r0", 5.0, is_ready=True)  # r1 silent since 0.0
    assert [r.name for r in router.pool(5.0)] == ["r0"]
    assert router.choose([b"x"], 5.0)[0].name == "r0"
    assert router.choose([b"x"], 5.0, exclude=["r0"])[0].name == "r1"  # durable fallback
    with pytest.raises(LookupError):
        router.choose([b"x"], 5.0, exclude=["r0", "r1"])


def test_round_robin_alternates() -> None:
    router = _router("round_robin")
    assert [router.choose([], 1.0)[0].name for _ in range(4)] == ["r0", "r1", "r0", "r1"]


# ---------------------------------------------------------------------------- spec


def test_spec_to_runtime_configs() -> None:
    spec = WavePipelineSpec.model_validate(
        {
            "model": {"name": "tiny-llama"},
            "stages": 2,
            "replicas": 3,
            "cache": {"blockSize": 32, "memoryPerStageBytes": 1 << 20},
            "scheduler": {"mode": "sync", "chunkTokens": 512},
            "resources": {"gpusPerStage": 0},  # CPU: float32 (4 bytes below)
        }
    )
    configs = runtime_configs_from_spec(spec, pool="p")
    assert [c.pipeline for c in configs] == ["p-r0", "p-r1", "p-r2"]
    config = configs[0]
    assert (config.num_stages, config.block_size, config.mode) == (2, 32, "sync")
    # 4 layers x 2 (K, V) x 2 heads x 32 dims x 4 bytes x 32 tokens = 65536 bytes per block
    assert config.num_kv_blocks == [16, 16]
    with pytest.raises(ValueError, match="engine"):  # refused by the spec, before any config
        WavePipelineSpec.model_validate(spec.to_wire() | {"engine": "tensorrt_llm"})
    emulated = spec.model_copy(update={"engine": "emulated", "engine_options": {"emulate": "x"}})
    with pytest.raises(SpecError) as info:
        runtime_configs_from_spec(emulated, pool="p")
    assert info.value.field == "engineOptions.emulate"
