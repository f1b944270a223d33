"""`wavepp up` over HTTP with real processes: tenants, bad input, APIs, and an admission restart."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time

import aiohttp
import pytest

from wavepp.api.subjects import prefill_subject
from wavepp.runtime.transport.natsio import connect, flush_in_order

pytestmark = pytest.mark.timeout(240)


def prompt(seed: int, num_tokens: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1024) for _ in range(num_tokens)]


async def post(
    session: aiohttp.ClientSession, url: str, body: object, **kwargs: object
) -> tuple[int, dict, dict]:
    data = body if isinstance(body, str) else json.dumps(body)
    async with session.post(url, data=data, **kwargs) as response:
        return response.status, await response.json(), dict(response.headers)


async def test_same_prompt_two_tenants_no_cross_tenant_hit(up_service) -> None:
    url = f"{up_service.endpoint}/v1/prefill"
    tokens = prompt(1, 80)  # 5 full blocks of 16
    async with aiohttp.ClientSession() as session:
        first_alice = await post(session, url, {"tenant": "alice", "token_ids": tokens})
        first_bob = await post(session, url, {"tenant": "bob", "token_ids": tokens})
        again_alice = await post(session, url, {"tenant": "alice", "token_ids": tokens})
        again_bob = await post(session, url, {"tenant": "bob", "token_ids": tokens})
    for status, body, _ in (first_alice, first_bob, again_alice, again_bob):
        assert status == 200, body
        assert body["num_prompt_tokens"] == 80
    # bob's first request follows alice's identical prompt: no hit across tenants
    assert first_alice[1]["num_cached_tokens"] == 0
    assert first_bob[1]["num_cached_tokens"] == 0
    # each tenant's repeat hits its own blocks (at most 4: L* is capped one token short)
    assert 0 < again_alice[1]["num_cached_tokens"] <= 64
    assert 0 < again_bob[1]["num_cached_tokens"] <= 64
    # same model, same tokens: same first token for both tenants
    assert first_alice[1]["first_token_id"] == first_bob[1]["first_token_id"]
    stages = again_alice[1]["stages"]
    assert [s["rank"] for s in stages] == [0, 1]
    assert all(s["execute_s"] > 0 for s in stages)
    assert again_alice[1]["ttft_s"] > 0


@pytest.mark.parametrize(
    ("route", "body", "status", "field"),
    [
        ("prefill", {"tenant": "alice", "token_ids": []}, 400, "token_ids"),
        ("prefill", {"tenant": "alice", "token_ids": [1] * 8193}, 400, "token_ids"),
        ("prefill", {"tenant": "alice", "token_ids": [1, 1024]}, 400, "token_ids[1]"),
        ("prefill", {"tenant": "alice", "token_ids": [1, -1]}, 400, "token_ids[1]"),
        ("prefill", {"tenant": "mallory", "token_ids": [1]}, 403, "tenant"),
        ("prefill", {"tenant": ["alice"], "token_ids": [1]}, 400, "tenant"),
        ("prefill", '{"tenant": "alice", "token_ids": [1,', 400, "body"),
        ("prefill", {"tenant": "alice", "token_ids": [1], "request_id": "a b"}, 400, "request_id"),
        ("prefill", {"tenant": "alice", "token_ids": [1], "text": "w1"}, 400, "token_ids"),
        ("completions", {"prompt": [1, 2], "max_tokens": 16, "user": "alice"}, 400, "max_tokens"),
        ("completions", {"prompt": [1, 2], "model": "gpt-4", "user": "alice"}, 404, "model"),
    ],
)
async def test_bad_input_is_a_4xx_naming_the_field(
    up_service, route: str, body: object, status: int, field: str
) -> None:
    async with aiohttp.ClientSession() as session:
        # an admitted request in flight is unaffected by the bad one
        good = asyncio.create_task(
            post(
                session,
                f"{up_service.endpoint}/v1/prefill",
                {"tenant": "alice", "token_ids": prompt(7, 40)},
            )
        )
        got_status, got, _ = await post(session, f"{up_service.endpoint}/v1/{route}", body)
        good_status, good_body, _ = await good
    assert got_status == status, got
    assert got["error"]["field"] == field
    assert field.split("[")[0] in got["error"]["message"]
    assert good_status == 200 and good_body["num_prompt_tokens"] == 40


async def test_over_long_prompt_names_the_limit(up_service) -> None:
    async with aiohttp.ClientSession() as session:
        status, body, _ = await post(
            session,
            f"{up_service.endpoint}/v1/prefill",
            {"tenant": "alice", "token_ids": [1] * 8193},
        )
    assert status == 400
    assert body["error"]["limit"] == 512 * 16  # kvBlocks x blockSize


async def test_text_prompt_completions_and_duplicate_request_id(up_service) -> None:
    text = " ".join(f"w{i % 150}" for i in range(40))
    async with aiohttp.ClientSession() as session:
        status, first, headers = await post(
            session,
            f"{up_service.endpoint}/v1/prefill",
            {"tenant": "bob", "text": text, "request_id": "dup-1"},
        )
        assert status == 200 and first["num_prompt_tokens"] == 40
        assert "X-WavePP-Duplicate" not in headers
        status, again, headers = await post(
            session,
            f"{up_service.endpoint}/v1/prefill",
            {"tenant": "bob", "text": text + " w3 w4", "request_id": "dup-1"},
        )
        assert status == 200 and headers.get("X-WavePP-Duplicate") == "true"
        assert again == first  # answered once: the stored answer, not a second run
        assert "mac" not in first  # the bus tag stays on the bus
        status, completion, _ = await post(
            session,
            f"{up_service.endpoint}/v1/completions",
            {"model": "tiny-llama", "prompt": text, "max_tokens": 1},
            headers={"X-WavePP-Tenant": "bob"},
        )
    assert status == 200, completion
    assert completion["object"] == "text_completion"
    assert completion["usage"]["prompt_tokens"] == 40
    # the text's 2 full blocks were cached by the first request (same tenant)
    assert completion["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, completion
    assert completion["choices"][0]["token_ids"] == [first["first_token_id"]]


async def test_nats_prefill_subject(up_service) -> None:
    info = up_service.processes()
    nc = await connect(
        info["nats_url"], name="test-client", creds=info["nats_creds"]["gateway-default"]
    )
    try:
        body = {"tenant": "alice", "token_ids": prompt(3, 33)}
        subject = prefill_subject("default", namespace="local")  # wavepp up's pool "default"
        reply = await nc.request(subject, json.dumps(body).encode(), timeout=30)
        bad = await nc.request(subject, b"{", timeout=30)
    finally:
        await nc.drain()
    answer = json.loads(reply.data)
    assert answer["status"] == 200 and answer["body"]["num_prompt_tokens"] == 33
    assert json.loads(bad.data)["status"] == 400


async def test_the_bus_refuses_anonymous_clients_and_confines_components(up_service) -> None:
    """Under `wavepp up` defaults: no credentials, no connection; a stage's credentials cannot
    publish on the gateway's prefill request path (the request never gets an answer)."""
    info = up_service.processes()
    with pytest.raises(Exception, match="Authorization Violation"):
        await connect(info["nats_url"], name="anonymous", allow_reconnect=False)
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    stage = await connect(
        info["nats_url"],
        name="stage-creds",
        creds=info["nats_creds"]["stage-default-r0-0"],
        error_cb=on_error,
    )
    try:
        body = json.dumps({"tenant": "alice", "token_ids": prompt(4, 20)}).encode()
        await stage.publish("wavepp.local.default.prefill", body)
        await flush_in_order(stage)
        deadline = time.monotonic() + 10
        while not errors and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    finally:
        await stage.close()
    assert any("permissions violation for publish" in e.lower() for e in errors), errors


async def test_token_rate_limit_is_429_with_retry_after(up_service) -> None:
    url = f"{up_service.endpoint}/v1/prefill"
    async with aiohttp.ClientSession() as session:
        ok = await post(session, url, {"tenant": "carol", "token_ids": prompt(5, 64)})
        limited = await post(session, url, {"tenant": "carol", "token_ids": prompt(6, 64)})
        other = await post(session, url, {"tenant": "alice", "token_ids": prompt(6, 64)})
    assert ok[0] == 200
    status, body, headers = limited
    assert status == 429, body
    assert body["error"]["field"] == "tokens_per_s" and body["error"]["limit"] == 10
    # 100-token burst, 64 taken: 28 more at 10 tokens/s
    assert 1 <= int(headers["Retry-After"]) <= 3
    assert other[0] == 200  # another tenant is not limited


async def test_probes_and_per_tenant_metrics(up_service) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{up_service.endpoint}/healthz") as r:
            assert r.status == 200
        async with session.get(f"{up_service.endpoint}/readyz") as r:
            ready = await r.json()
            assert r.status == 200 and ready["replicas"]["default-r0"]["ready"]
        await post(
            session, f"{up_service.endpoint}/v1/prefill", {"tenant": "bob", "token_ids": [1, 2]}
        )
        async with session.get(f"{up_service.endpoint}/metrics") as r:
            text = await r.text()
    assert 'wavepp_gateway_requests_total{code="200",tenant="bob"}' in text
    assert 'wavepp_gateway_ttft_seconds_count{tenant="bob"}' in text
    assert 'wavepp_gateway_cached_tokens_total{tenant="alice"}' in text


@pytest.mark.slow
async def test_admission_restart_mid_load_answers_every_request_once(
    up_service,
) -> None:
    """SIGKILL the admission service while 24 requests are in flight; `up` restarts it, the
    unacked requests are redelivered from JetStream, and every request is answered once.

    The clients behave as documented: the gateway answers a request whose replica stays out of
    the pool for ``replica_timeout_s`` + ``replica_unready_fail_s`` (3 + 3 s: a restart slower
    than that, as on a loaded machine) 503 with ``Retry-After``, and the client sends it again
    with the same request id; it then gets the one run's answer (stored or awaited)."""
    url = f"{up_service.endpoint}/v1/prefill"
    num_requests = 24
    ids = [f"restart-{i}" for i in range(num_requests)]
    answered: list[float] = []
    refusals: list[str] = []

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=150)) as session:

        async def one(i: int) -> tuple[int, dict, dict]:
            body = {"tenant": "alice", "token_ids": prompt(100 + i, 400), "request_id": ids[i]}
            deadline = time.monotonic() + 150
            while True:
                result = await post(session, url, body)
                status, answer, headers = result
                if status != 503 or time.monotonic() > deadline:
                    break
                # The replica left the pool while the restarted admission was not beating yet.
                assert "left the pool" in answer["error"]["message"], answer
                refusals.append(answer["error"]["message"])
                await asyncio.sleep(int(headers["Retry-After"]))
            answered.append(time.monotonic())
            return result

        tasks = [asyncio.create_task(one(i)) for i in range(num_requests)]
        deadline = time.monotonic() + 60
        while len(answered) < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        num_before_kill = len(answered)
        before = up_service.processes()
        os.kill(before["pids"]["admission-default-r0"], signal.SIGKILL)
        results = await asyncio.gather(*tasks)
        after = up_service.processes()
        # the same ids again: every one is answered from the stored result, none runs twice
        repeats = await asyncio.gather(
            *(
                post(session, url, {"tenant": "alice", "token_ids": [1], "request_id": rid})
                for rid in ids
            )
        )
    print(f"{len(refusals)} answers 503 (replica out of the pool) retried with the same id")
    assert 0 < num_before_kill < num_requests, "kill must land mid-load"
    assert after["restarts"].get("admission-default-r0", 0) >= 1
    assert after["pids"]["admission-default-r0"] != before["pids"]["admission-default-r0"]
    assert [r[0] for r in results] == [200] * num_requests, [r[1] for r in results if r[0] != 200]
    assert sorted(r[1]["request_id"] for r in results) == sorted(ids)
    assert all(r[1]["num_prompt_tokens"] == 400 for r in results)
    # answered once: every later ask gets the answer its client got, marked as a duplicate (a
    # second run would have stored its own timings over it)
    for (status, body, headers), (_, first, _) in zip(repeats, results, strict=True):
        assert status == 200 and headers.get("X-WavePP-Duplicate") == "true"
        assert body == first


@pytest.mark.slow
async def test_heavy_tenant_does_not_starve_light_tenant(up_service) -> None:
    """alice floods 48 concurrent 400-token prompts; bob sends 6 short prompts one after the
    other meanwhile. The gateway's fair-share queue (8 outstanding per replica) lets each of
    bob's requests pass alice's backlog: bob's p99 TTFT stays below alice's median."""
    url = f"{up_service.endpoint}/v1/prefill"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=150)) as session:

        async def timed(tenant: str, tokens: list[int]) -> float:
            start = time.monotonic()
            status, body, _ = await post(session, url, {"tenant": tenant, "token_ids": tokens})
            assert status == 200, body
            return time.monotonic() - start

        heavy = [asyncio.create_task(timed("alice", prompt(500 + i, 400))) for i in range(48)]
        await asyncio.sleep(0.3)  # alice's backlog is queued
        light = [await timed("bob", prompt(900 + i, 32)) for i in range(6)]
        heavy_ttft = await asyncio.gather(*heavy)
    heavy_p50 = sorted(heavy_ttft)[len(heavy_ttft) // 2]
    light_p99 = max(light)  # 6 samples: p99 is the max
    print(
        f"light p99 TTFT {light_p99:.3f} s, heavy p50 {heavy_p50:.3f} s, max {max(heavy_ttft):.3f} s"
    )
    assert light_p99 < heavy_p50


@pytest.mark.slow
async def test_gateway_restart_mid_load_loses_no_request(up_service) -> None:
    """SIGKILL the gateway while 16 requests are in flight; `up` restarts it. Clients retry
    with the same request id (their connection broke): each request, already in JetStream, is
    answered, and every later ask of the same id gets that same answer."""
    url = f"{up_service.endpoint}/v1/prefill"
    num_requests = 16
    answered: list[str] = []
    num_retries = [0]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=150)) as session:

        async def one(i: int) -> dict:
            body = {"tenant": "bob", "token_ids": prompt(700 + i, 400), "request_id": f"gw-{i}"}
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                try:
                    status, answer, _ = await post(session, url, body)
                except (TimeoutError, aiohttp.ClientError):
                    num_retries[0] += 1
                    await asyncio.sleep(0.2)
                    continue
                if status == 200:
                    answered.append(answer["request_id"])
                    return answer
                assert status == 503, answer  # only while the new gateway starts
                await asyncio.sleep(0.2)
            raise AssertionError(f"gw-{i} not answered")

        tasks = [asyncio.create_task(one(i)) for i in range(num_requests)]
        deadline = time.monotonic() + 60
        while len(answered) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        num_before_kill = len(answered)
        before = up_service.processes()
        os.kill(before["pids"]["gateway"], signal.SIGKILL)
        results = await asyncio.gather(*tasks)
        repeats = await asyncio.gather(
            *(
                post(session, url, {"tenant": "bob", "token_ids": [1], "request_id": f"gw-{i}"})
                for i in range(num_requests)
            )
        )
    after = up_service.processes()
    assert 0 < num_before_kill < num_requests, "kill must land mid-load"
    assert num_retries[0] > 0, "some clients lost their connection and retried"
    assert after["restarts"].get("gateway", 0) >= 1
    assert sorted(r["request_id"] for r in results) == sorted(f"gw-{i}" for i in range(16))
    for (status, body, headers), first in zip(repeats, results, strict=True):
        assert status == 200 and headers.get("X-WavePP-Duplicate") == "true"
        assert body == first


async def test_open_mode_says_so_and_a_4xx_counts_under_the_named_tenant(up_service) -> None:
    """Without API keys `wavepp up` says it is open; a 400 of a known tenant is that tenant's."""
    assert any("authentication off (open local mode)" in line for line in up_service.lines)
    async with aiohttp.ClientSession() as session:
        status, _, _ = await post(
            session,
            f"{up_service.endpoint}/v1/prefill",
            {"tenant": "carol", "token_ids": [1, 10**6]},
        )
        async with session.get(f"{up_service.endpoint}/metrics") as r:
            text = await r.text()
    assert status == 400
    assert 'wavepp_gateway_requests_total{code="400",tenant="carol"}' in text
