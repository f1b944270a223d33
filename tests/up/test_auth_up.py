"""API keys through the whole service: `wavepp up --config examples/up.yaml` (its tenants and key
files, keys generated here; emulated engine and 1 replica to keep CI fast) as real processes,
called over HTTP, with the real `openai` client and over NATS.

Pinned: tenant B's key claiming tenant A gets none of A's cached tokens over 100
probes of A's prefixes; the openai client works with its api_key and gets 401 without; a key
rotated in the file works without a restart and the old one stops after the window; failures
are rate-limited per client and counted, with no key material in metrics or logs.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from wavepp.api.permissions import gateway_user_name
from wavepp.cmd.api_key import new_key, rotate
from wavepp.runtime.transport.natsio import connect

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parents[2]
BLOCK = 16
NUM_PROBES = 100
ROTATION_WINDOW_S = 6.0


def _prompt(seed: int, num_tokens: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1024) for _ in range(num_tokens)]


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory, serving: Any) -> Iterator[dict[str, Any]]:
    """examples/up.yaml with keys for its tenants (and one more, rate-limited, tenant)."""
    tmp = tmp_path_factory.mktemp("auth-up")
    spec = yaml.safe_load((REPO / "examples" / "up.yaml").read_text())
    spec.update(engine="emulated", replicas=1)  # CI: the example's tenants, a lighter engine
    spec["tenants"].append(
        {"name": "limited", "apiKeysFile": "keys/limited.keys", "tokensPerSecond": 1.0,
         "burstTokens": 100},
    )  # fmt: skip
    (tmp / "keys").mkdir()
    keys: dict[str, str] = {}
    for tenant in spec["tenants"]:
        keys[tenant["name"]] = new_key()
        path = tmp / tenant["apiKeysFile"]
        rotate(path, keys[tenant["name"]], None, datetime.now(UTC))
        assert keys[tenant["name"]] not in path.read_text()  # only the hash is stored
    service = serving.start_up(tmp, spec, [])  # writes tmp/pipeline.yaml: keys/ beside it
    try:
        yield {"service": service, "keys": keys, "dir": tmp}
    finally:
        assert serving.stop_up(service.proc) == 0, "".join(service.lines[-40:])


async def _post(
    session: aiohttp.ClientSession, url: str, body: dict, key: str | None, **kw: Any
) -> tuple[int, dict, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    headers.update(kw.pop("headers", {}))
    async with session.post(url, data=json.dumps(body), headers=headers, **kw) as response:
        return response.status, await response.json(), dict(response.headers)


def _url(keyed: dict[str, Any], route: str = "/v1/prefill") -> str:
    return f"{keyed['service'].endpoint}{route}"


async def test_another_tenants_key_gets_no_cached_tokens_over_100_probes(keyed) -> None:
    """acme = A, default = B; acme-batch shares acme's cacheSalt on purpose (the control)."""
    keys, url = keyed["keys"], _url(keyed)
    prompts = [_prompt(i, 3 * BLOCK) for i in range(NUM_PROBES)]
    probes = [p[: 2 * BLOCK] + _prompt(1000 + i, BLOCK) for i, p in enumerate(prompts)]
    limit = asyncio.Semaphore(16)

    async def post(session: aiohttp.ClientSession, body: dict, key: str) -> tuple[int, dict]:
        async with limit:
            status, answer, _ = await _post(session, url, body, key)
            return status, answer

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        own = await asyncio.gather(
            *(post(session, {"tenant": "acme", "token_ids": p}, keys["acme"]) for p in prompts)
        )
        assert all(status == 200 for status, _ in own), own[:3]
        # B's key, claiming A in the body: refused, so nothing of A's cache can come back
        claimed = await asyncio.gather(
            *(post(session, {"tenant": "acme", "token_ids": p}, keys["default"]) for p in probes)
        )
        # B's key, naming no tenant: served as B, under B's salt
        as_b = await asyncio.gather(
            *(post(session, {"token_ids": p}, keys["default"]) for p in probes)
        )
        # controls: A's own probe hits; acme-batch (same salt, by the spec) hits too
        control_a = await post(session, {"token_ids": probes[0]}, keys["acme"])
        control_shared = await post(session, {"token_ids": probes[1]}, keys["acme-batch"])
    statuses = [status for status, _ in claimed]
    cross_hits = sum(
        1 for status, body in claimed + as_b if status == 200 and body["num_cached_tokens"] > 0
    )
    print(
        f"{NUM_PROBES} probes of A's prefixes with B's key: claiming A -> "
        f"{statuses.count(403)} x 403; as B -> {sum(s == 200 for s, _ in as_b)} x 200; "
        f"cross-tenant cached-token hits: {cross_hits}; control A: "
        f"{control_a[1]['num_cached_tokens']} cached, shared salt: "
        f"{control_shared[1]['num_cached_tokens']} cached"
    )
    assert statuses == [403] * NUM_PROBES, claimed[:3]
    body = claimed[0][1]
    assert body["error"]["type"] == "permission_error" and "acme" not in json.dumps(body)
    assert all(status == 200 and b["tenant"] == "default" for status, b in as_b), as_b[:3]
    assert cross_hits == 0
    assert control_a[0] == 200 and control_a[1]["num_cached_tokens"] == 2 * BLOCK
    assert control_shared[0] == 200 and control_shared[1]["num_cached_tokens"] == 2 * BLOCK
    assert control_shared[1]["tenant"] == "acme-batch"


async def test_header_claim_refused_and_400_counted_under_the_keys_tenant(keyed) -> None:
    keys = keyed["keys"]
    async with aiohttp.ClientSession() as session:
        status, body, _ = await _post(
            session,
            _url(keyed, "/v1/completions"),
            {"prompt": [1, 2, 3], "max_tokens": 1},
            keys["default"],
            headers={"X-WavePP-Tenant": "acme"},
        )
        assert status == 403, body
        # the same header on /v1/prefill is checked too
        status, body, _ = await _post(
            session, _url(keyed), {"token_ids": [1, 2, 3]}, keys["default"],
            headers={"X-WavePP-Tenant": "acme"},
        )  # fmt: skip
        assert status == 403, body
        # malformed beyond the JSON parser's limits: a 400 in the error shape, not a 500
        for raw in ("[" * 100_000, '{"token_ids": [' + "9" * 5000 + "]}"):
            headers = {"Authorization": f"Bearer {keys['default']}"}
            async with session.post(_url(keyed), data=raw, headers=headers) as response:
                assert response.status == 400, await response.text()
                assert (await response.json())["error"]["field"] == "body"
        # `user` is the end user's id under keys: served as the key's tenant
        status, body, _ = await _post(
            session,
            _url(keyed, "/v1/completions"),
            {"prompt": [1, 2, 3], "max_tokens": 1, "user": "acme"},
            keys["default"],
        )
        assert status == 200 and body["wavepp"]["tenant"] == "default", body
        status, body, _ = await _post(
            session, _url(keyed), {"token_ids": [1, 10**6]}, keys["acme-batch"]
        )
        assert status == 400 and body["error"]["field"] == "token_ids[1]", body
        # the spec's tokensPerSecond of tenant `limited` (burst 100): a 3rd prompt of 48 waits
        limited = [
            (await _post(session, _url(keyed), {"token_ids": _prompt(i, 48)}, keys["limited"]))
            for i in range(3)
        ]
        async with session.get(_url(keyed, "/metrics")) as response:
            metrics = await response.text()
    assert [s for s, _, _ in limited] == [200, 200, 429], limited
    assert limited[2][1]["error"]["field"] == "tokens_per_s" and "Retry-After" in limited[2][2]
    assert 'wavepp_gateway_requests_total{code="400",tenant="acme-batch"} 1.0' in metrics
    assert 'wavepp_gateway_requests_total{code="403",tenant="default"}' in metrics


async def test_openai_client_with_api_key_works_and_without_gets_401(keyed) -> None:
    import openai

    base_url = _url(keyed, "/v1")
    client = openai.OpenAI(base_url=base_url, api_key=keyed["keys"]["acme"], max_retries=0)
    tokens = _prompt(7, 3 * BLOCK)
    first = await asyncio.to_thread(
        client.completions.create, model="tiny-llama", prompt=tokens, max_tokens=1
    )
    again = await asyncio.to_thread(
        client.completions.create, model="tiny-llama", prompt=tokens, max_tokens=1
    )
    assert first.usage.prompt_tokens == 3 * BLOCK and first.choices[0].finish_reason == "length"
    assert again.usage.prompt_tokens_details.cached_tokens == 2 * BLOCK
    wrong = openai.OpenAI(base_url=base_url, api_key="wpp-not-a-key-at-all", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        await asyncio.to_thread(
            wrong.completions.create, model="tiny-llama", prompt=[1], max_tokens=1
        )
    assert info.value.status_code == 401
    async with aiohttp.ClientSession() as session:
        async with session.post(
            _url(keyed, "/v1/completions"), json={"prompt": [1], "max_tokens": 1}
        ) as response:
            status, body = response.status, await response.json()
            challenge = response.headers.get("WWW-Authenticate")
    assert (status, challenge) == (401, "Bearer")
    assert body["error"]["type"] == "authentication_error"
    text = json.dumps(body)
    assert not any(t in text for t in ("acme", "default", "limited")), text  # no tenant named


async def test_nats_requests_need_a_key_too(keyed) -> None:
    service = keyed["service"]
    info = service.processes()
    # The NATS request path is the gateway's own subject: with bus auth on (the default), only a
    # holder of the gateway's NATS credentials may publish there; the API key is checked on top.
    nc = await connect(
        info["nats_url"], name="auth-test", creds=info["nats_creds"][gateway_user_name("default")]
    )
    try:
        body = json.dumps({"tenant": "acme", "token_ids": [1, 2, 3]}).encode()
        no_key = json.loads(
            (await nc.request("wavepp.local.default.prefill", body, timeout=30)).data
        )
        with_key = json.loads(
            (
                await nc.request(
                    "wavepp.local.default.prefill",
                    body,
                    timeout=30,
                    headers={"Authorization": f"Bearer {keyed['keys']['acme']}"},
                )
            ).data
        )
        other = json.loads(
            (
                await nc.request(
                    "wavepp.local.default.prefill",
                    body,
                    timeout=30,
                    headers={"Authorization": f"Bearer {keyed['keys']['default']}"},
                )
            ).data
        )
    finally:
        await nc.close()
    assert no_key["status"] == 401, no_key
    assert with_key["status"] == 200 and with_key["body"]["tenant"] == "acme", with_key
    assert other["status"] == 403, other


async def test_rotation_in_the_file_without_restart_old_key_ends_after_window(keyed) -> None:
    service, keys = keyed["service"], keyed["keys"]
    pid_before = service.processes()["pids"]["gateway"]
    old, new = keys["acme-batch"], new_key()
    url = _url(keyed)

    async def status_of(session: aiohttp.ClientSession, key: str) -> int:
        return (await _post(session, url, {"token_ids": _prompt(3, BLOCK)}, key))[0]

    async with aiohttp.ClientSession() as session:
        assert await status_of(session, old) == 200
        rotated_at = time.monotonic()
        rotate(keyed["dir"] / "keys" / "acme-batch.keys", new, ROTATION_WINDOW_S, datetime.now(UTC))
        while await status_of(session, new) != 200:  # picked up at the next poll (1 s)
            assert time.monotonic() - rotated_at < 4.0, "the new key was not picked up"
            await asyncio.sleep(0.2)
        picked_up_s = time.monotonic() - rotated_at
        assert await status_of(session, old) == 200  # inside the window (>= 2 s left): both work
        await asyncio.sleep(max(0.0, ROTATION_WINDOW_S + 0.5 - (time.monotonic() - rotated_at)))
        old_after, new_after = await status_of(session, old), await status_of(session, new)
    print(f"rotation: new key served {picked_up_s:.2f} s after the file changed; after the "
          f"{ROTATION_WINDOW_S:g} s window old key -> {old_after}, new key -> {new_after}")  # fmt: skip
    assert (old_after, new_after) == (401, 200)
    assert service.processes()["pids"]["gateway"] == pid_before  # no restart
    assert service.processes()["restarts"] == {}
    keys["acme-batch"] = new


async def test_failures_from_one_client_are_rate_limited_and_counted_without_key_text(
    keyed,
) -> None:
    """From 127.0.0.2 (another client for the gateway; the other tests use 127.0.0.1)."""
    service, keys = keyed["service"], keyed["keys"]
    guesses = [new_key() for _ in range(12)]
    connector = aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))
    async with aiohttp.ClientSession(connector=connector) as other_client:
        answers = [await _post(other_client, _url(keyed), {"token_ids": [1]}, g) for g in guesses]
        right_key_meanwhile = await _post(
            other_client, _url(keyed), {"token_ids": [1]}, keys["acme"]
        )
    async with aiohttp.ClientSession() as session:
        unaffected = await _post(session, _url(keyed), {"token_ids": [1]}, keys["acme"])
        async with session.get(_url(keyed, "/metrics")) as response:
            metrics = await response.text()
    statuses = [s for s, _, _ in answers]
    print(f"12 wrong keys from one client: {statuses.count(401)} x 401, "
          f"{statuses.count(429)} x 429")  # fmt: skip
    assert statuses == [401] * 10 + [429] * 2, statuses
    assert int(answers[-1][2]["Retry-After"]) >= 1
    assert right_key_meanwhile[0] == 429 and unaffected[0] == 200
    invalid = re.search(r'wavepp_gateway_auth_failures_total\{reason="invalid"\} (\S+)', metrics)
    limited = re.search(
        r'wavepp_gateway_auth_failures_total\{reason="rate_limited"\} (\S+)', metrics
    )
    assert invalid and float(invalid.group(1)) >= 10
    assert limited and float(limited.group(1)) == 3
    logs = "".join(p.read_text(errors="replace") for p in (service.state_dir / "logs").glob("*"))
    logs += "".join(service.lines)
    from wavepp.gateway.auth import hash_key

    secrets = [*guesses, *keys.values()]
    secrets += [hash_key(k).hex() for k in secrets]
    for text in (metrics, logs):
        assert not any(s in text for s in secrets)


def test_api_key_cli_prints_the_key_and_stores_its_hash(tmp_path: Path) -> None:
    path = tmp_path / "t.keys"
    out = subprocess.run(
        [sys.executable, "-m", "wavepp.cli", "api-key", "--append", str(path)],
        capture_output=True, text=True, check=True, cwd=REPO,
    ).stdout.strip()  # fmt: skip
    from wavepp.gateway.auth import key_line

    assert out.startswith("wpp-") and path.read_text() == key_line(out) + "\n"
