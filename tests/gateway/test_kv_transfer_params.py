"""``/v1/completions``' ``kv_transfer_params`` (vLLM's disaggregated-serving protocol), pure:
what asks for a KV handoff, what is refused (400 naming the field), and where the answer
carries the parameters the decode request consumes."""

from __future__ import annotations

import pytest

from wavepp.api.prefill import IntakeRequest, PrefillResult
from wavepp.gateway.openai_api import completion_body
from wavepp.gateway.validation import (
    BadRequest,
    PromptLimits,
    parse_completion_batch,
    parse_kv_transfer,
)

LIMITS = PromptLimits(vocab_size=100, max_prompt_tokens=64, tenants=frozenset({"default"}))
# What vLLM's disaggregated proxies put in the prefill request for NixlConnector.
NIXL_PROXY = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def _body(**kw: object) -> dict[str, object]:
    return {"prompt": [1, 2, 3], "max_tokens": 1, **kw}


@pytest.mark.parametrize(
    ("value", "handoff"),
    [
        (None, False),
        ({}, False),
        ({"do_remote_decode": False}, False),
        ({"do_remote_decode": True}, True),
        ({"do_remote_decode": True, "do_remote_prefill": None}, True),
        (NIXL_PROXY, True),
    ],
)
def test_accepted_shapes(value: object, handoff: bool) -> None:
    assert parse_kv_transfer(value) is handoff
    batch = parse_completion_batch(_body(kv_transfer_params=value), LIMITS)
    assert [p.handoff for p in batch.prompts] == [handoff]


def test_absent_is_no_handoff() -> None:
    assert [p.handoff for p in parse_completion_batch(_body(), LIMITS).prompts] == [False]


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ("yes", "kv_transfer_params"),
        ([True], "kv_transfer_params"),
        ({"do_remote_decode": "true"}, "kv_transfer_params.do_remote_decode"),
        ({"do_remote_decode": 1}, "kv_transfer_params.do_remote_decode"),
        ({"do_remote_decode": True, "transfer_id": "t1"}, "kv_transfer_params.transfer_id"),
        ({"do_remote_prefill": True}, "kv_transfer_params.do_remote_prefill"),
        ({**NIXL_PROXY, "remote_host": "10.0.0.1"}, "kv_transfer_params.remote_host"),
        ({"wavepp_handoff": {}}, "kv_transfer_params.wavepp_handoff"),
    ],
)
def test_unknown_shapes_are_400_naming_the_field(value: object, field: str) -> None:
    with pytest.raises(BadRequest) as caught:
        parse_completion_batch(_body(kv_transfer_params=value), LIMITS)
    assert caught.value.status == 400
    assert caught.value.field == field
    assert caught.value.to_json()["error"]["param"] == field


def test_handoff_takes_one_prompt_not_streamed() -> None:
    with pytest.raises(BadRequest) as caught:
        parse_completion_batch(
            _body(prompt=[[1, 2], [3, 4]], kv_transfer_params={"do_remote_decode": True}), LIMITS
        )
    assert (caught.value.field, caught.value.limit) == ("prompt", 1)
    with pytest.raises(BadRequest) as caught:
        parse_completion_batch(
            _body(stream=True, kv_transfer_params={"do_remote_decode": True}), LIMITS
        )
    assert caught.value.field == "stream"
    # the same bodies without a handoff are served as before
    assert len(parse_completion_batch(_body(prompt=[[1, 2], [3, 4]]), LIMITS).prompts) == 2
    assert parse_completion_batch(_body(stream=True), LIMITS).stream


def test_the_flag_travels_in_the_intake_message() -> None:
    intake = IntakeRequest(
        key="default.r1", request_id="r1", tenant="default", cache_salt="s", token_ids=[1],
        arrival_s=0.0, handoff=True,
    )  # fmt: skip
    assert IntakeRequest.model_validate_json(intake.model_dump_json()).handoff is True
    plain = intake.model_copy(update={"handoff": False})
    assert IntakeRequest.model_validate_json(plain.model_dump_json()).handoff is False


def test_the_answer_carries_kv_transfer_params_top_level() -> None:
    params = {"do_remote_prefill": True, "do_remote_decode": False, "wavepp_handoff": {"x": 1}}
    handed = PrefillResult(request_id="r1", tenant="default", first_token_id=5,
                           num_prompt_tokens=3, kv_transfer_params=params)  # fmt: skip
    body = completion_body([handed], "m", 0, None)
    assert body["kv_transfer_params"] == params
    assert "kv_transfer_params" not in body["wavepp"]  # once, where vLLM's proxies read it
    plain = handed.model_copy(update={"kv_transfer_params": None})
    assert completion_body([plain], "m", 0, None)["kv_transfer_params"] is None
