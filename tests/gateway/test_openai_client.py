"""The real `openai` client against a running gateway (`wavepp up`): models, one and several
prompts, streaming, and every error kind in the documented JSON shape, counted per tenant."""

from __future__ import annotations

import re
import urllib.request

import openai
import pytest

MODEL = "tiny-llama"
PROMPT = list(range(1, 19))  # 18 token ids


@pytest.fixture(scope="module")
def client(up_service) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{up_service.endpoint}/v1", api_key="unused", max_retries=0)


def _count(endpoint: str, tenant: str, code: int) -> float:
    text = urllib.request.urlopen(f"{endpoint}/metrics", timeout=10).read().decode()
    pattern = rf'wavepp_gateway_requests_total\{{code="{code}",tenant="{tenant}"\}} (\S+)'
    match = re.search(pattern, text)
    return float(match.group(1)) if match else 0.0


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].object == "model" and models.data[0].owned_by == "wavepp"


def test_one_prompt_and_a_list_of_prompts(client: openai.OpenAI) -> None:
    one = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, user="alice")
    assert len(one.choices) == 1 and one.choices[0].finish_reason == "length"
    assert one.usage.prompt_tokens == 18 and one.usage.completion_tokens == 1
    assert one.usage.prompt_tokens_details.cached_tokens >= 0
    batch = client.completions.create(
        model=MODEL, prompt=[PROMPT, PROMPT + [40, 41, 42], [7, 8]], max_tokens=1, user="alice"
    )
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert batch.usage.prompt_tokens == 18 + 21 + 2 and batch.usage.completion_tokens == 3
    # PROMPT was answered before: its first block (16 tokens) is reused in the batch.
    assert batch.usage.prompt_tokens_details.cached_tokens >= 16
    texts = client.completions.create(model=MODEL, prompt=["w1 w2 w3", "w4 w5"], max_tokens=1)
    assert [len(c.token_ids) for c in texts.choices] == [1, 1]  # type: ignore[attr-defined]
    assert texts.usage.prompt_tokens == 3 + 2


def test_stream_yields_one_chunk_per_prompt_then_usage(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=[PROMPT, [9, 10, 11]],
            max_tokens=1,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert [c.choices[0].index for c in chunks[:2]] == [0, 1]
    assert all(c.choices[0].finish_reason == "length" for c in chunks[:2])
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == 21
    plain = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, stream=True))
    assert len(plain) == 1 and plain[0].choices[0].index == 0


def test_errors_are_the_documented_shape_and_counted(up_service, client: openai.OpenAI) -> None:
    endpoint = up_service.endpoint
    before = _count(endpoint, "alice", 400)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, user="alice")
    assert bad.value.body["field"] == "max_tokens" and bad.value.body["limit"] == 1
    with pytest.raises(openai.BadRequestError) as bad_stream:
        client.completions.create(model=MODEL, prompt=[], max_tokens=1, stream=True, user="alice")
    assert bad_stream.value.body["field"] == "prompt"
    assert _count(endpoint, "alice", 400) == before + 2  # the tenant, not "unknown"

    with pytest.raises(openai.NotFoundError) as wrong_model:
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=1)
    assert wrong_model.value.body["field"] == "model"

    with pytest.raises(openai.PermissionDeniedError) as unknown:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, user="mallory")
    assert unknown.value.body["field"] == "tenant"
    for other in ("alice", "bob", "carol", "default"):
        assert other not in unknown.value.body["message"], "a 403 lists the tenants"

    before = _count(endpoint, "bob", 413)
    with pytest.raises(openai.APIStatusError) as too_big:
        client.completions.create(
            model=MODEL,
            prompt="w1 " * (6 * 1024 * 1024),  # 18 MiB of JSON
            max_tokens=1,
            extra_headers={"X-WavePP-Tenant": "bob"},
        )
    assert too_big.value.status_code == 413
    assert too_big.value.body["field"] == "body" and too_big.value.body["limit"] == 16 * 2**20
    assert _count(endpoint, "bob", 413) == before + 1

    with pytest.raises(openai.NotFoundError) as no_route:
        client.embeddings.create(model=MODEL, input="w1")
    assert no_route.value.body["field"] == "path"
