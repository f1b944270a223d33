"""Memory pressure through the whole service: `wavepp up` with a KV pool so small
that one long prompt nearly fills a stage, and a gateway queue limit of 4. A burst of 16 long
prompts: the stages admit one at a time (the rest wait: backpressure), the gateway refuses what is
past its queue limit with 429 + Retry-After naming the limit, every accepted request is answered
correctly, nothing deadlocks, and the service serves again after the burst."""

from __future__ import annotations

import asyncio
import json
import random
import re
import time

import aiohttp
import pytest

pytestmark = pytest.mark.timeout(180)

BLOCK_SIZE = 16
KV_BLOCKS = 16  # per stage: 256 tokens
NUM_PROMPT_TOKENS = 14 * BLOCK_SIZE  # 14 of the 16 blocks: one prompt at a time fits
MAX_QUEUED = 4
NUM_BURST = 16

SPEC = {
    "model": {"name": "tiny-llama"},
    "stages": 2,
    "engineOptions": {"kvBlocks": KV_BLOCKS},
    "cache": {"blockSize": BLOCK_SIZE},
    "tenants": [{"name": "default"}, {"name": "ref"}],
}


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1024) for _ in range(NUM_PROMPT_TOKENS)]


async def _post(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict, dict]:
    async with session.post(url, data=json.dumps(body)) as response:
        return response.status, await response.json(), dict(response.headers)


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


async def test_burst_past_queue_limit_is_429_and_accepted_requests_finish(
    tmp_path,  # noqa: ANN001
    serving,  # noqa: ANN001
) -> None:
    service = serving.start_up(tmp_path, SPEC, ["--max-queued", str(MAX_QUEUED)])
    try:
        url = f"{service.endpoint}/v1/prefill"
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            started = time.monotonic()
            burst = await asyncio.wait_for(
                asyncio.gather(
                    *(
                        _post(
                            session,
                            url,
                            {"tenant": "default", "token_ids": _prompt(i), "request_id": f"b{i}"},
                        )
                        for i in range(NUM_BURST)
                    )
                ),
                timeout=45,
            )
            burst_s = time.monotonic() - started
            # Reference: each accepted prompt again, alone, as another tenant (another cache
            # salt: a cold prefill, no block shared with the burst). Also shows that the
            # service admits new requests after the burst.
            references = {}
            for i, (status, _, _) in enumerate(burst):
                if status == 200:
                    references[i] = await _post(
                        session, url, {"tenant": "ref", "token_ids": _prompt(i)}
                    )
            # a refused request, retried after the burst, is served
            refused = [i for i, (status, _, _) in enumerate(burst) if status == 429]
            retried = [
                await _post(session, url, {"tenant": "default", "token_ids": _prompt(i)})
                for i in refused[:2]
            ]
            async with session.get(f"{service.endpoint}/metrics") as response:
                metrics = await response.text()
    finally:
        code = serving.stop_up(service.proc)
    assert code == 0, "".join(service.lines[-40:])

    statuses = [status for status, _, _ in burst]
    num_ok, num_refused = statuses.count(200), statuses.count(429)
    print(f"queue limit {MAX_QUEUED}, burst of {NUM_BURST} x {NUM_PROMPT_TOKENS} tokens: "
          f"{num_ok} x 200, {num_refused} x 429, {burst_s:.2f} s")  # fmt: skip
    assert num_ok + num_refused == NUM_BURST, [b for b in burst if b[0] not in (200, 429)]
    # the 4 requests holding the queue are always served; the burst outruns the stages
    assert num_ok >= MAX_QUEUED and num_refused > 0, statuses
    for status, body, headers in burst:
        if status == 429:
            assert body["error"]["field"] == "queue", body
            assert body["error"]["limit"] == MAX_QUEUED, body
            assert "max_queued_requests" in body["error"]["message"], body
            assert int(headers["Retry-After"]) >= 1, headers
    for i, (ref_status, ref, _) in references.items():
        status, body, _ = burst[i]
        assert ref_status == 200, ref
        assert body["request_id"] == f"b{i}"
        assert body["num_prompt_tokens"] == NUM_PROMPT_TOKENS
        assert ref["num_cached_tokens"] == 0
        assert body["first_token_id"] == ref["first_token_id"], (i, body, ref)
    assert retried and all(status == 200 for status, _, _ in retried), retried
    assert burst_s < 45
    assert _metric(metrics, "wavepp_gateway_max_queued_requests") == MAX_QUEUED
    assert _metric(metrics, "wavepp_gateway_requests_in_gateway") == 0
    assert (
        _metric(metrics, 'wavepp_gateway_requests_total{code="429",tenant="default"}')
        == num_refused
    )
