"""The pure half of whole completions (``gateway.decode``) and the fields the gateway validates
for them (``validation.parse_completion_batch`` with and without decode endpoints)."""

from __future__ import annotations

import hashlib
import json

import pytest

from wavepp.api.prefill import PrefillResult
from wavepp.gateway.decode import (
    DecodePool,
    chat_answer,
    chat_chunk,
    completion_answer,
    decode_body,
    decode_error_message,
    pd_usage,
    stream_chunk,
)
from wavepp.gateway.validation import (
    BadRequest,
    PromptLimits,
    Sampling,
    parse_chat,
    parse_completion_batch,
)

PREFILL_ONLY = PromptLimits(vocab_size=100, max_prompt_tokens=64, tenants=frozenset({"default"}))
WITH_DECODE = PromptLimits(
    vocab_size=100, max_prompt_tokens=64, tenants=frozenset({"default"}), max_new_tokens=256
)
TRANSFER = {"do_remote_prefill": True, "do_remote_decode": False, "wavepp_handoff": {"x": 1}}


def _result(cached: int = 32) -> PrefillResult:
    return PrefillResult(
        request_id="r1",
        tenant="default",
        first_token_id=7,
        num_prompt_tokens=40,
        num_cached_tokens=cached,
        kv_transfer_params=TRANSFER,
    )


def test_pool_orders_least_loaded_then_least_recently_chosen_and_skips_down_ones() -> None:
    pool = DecodePool(["http://a:1", "http://b:2/", "http://c:3"], down_s=5.0)
    assert pool.order(0.0) == ["http://a:1", "http://b:2", "http://c:3"]
    pool.begin("http://a:1")
    pool.begin("http://b:2")
    assert pool.order(0.0)[0] == "http://c:3"
    pool.end("http://a:1")
    pool.end("http://b:2")
    # all idle: the least recently chosen first (c never, then a, then b)
    assert pool.order(0.0) == ["http://c:3", "http://a:1", "http://b:2"]
    pool.mark_down("http://c:3", now_s=10.0)
    assert pool.order(12.0)[-1] == "http://c:3"  # down, still tried last
    assert pool.order(15.5)[0] == "http://c:3"  # back after down_s
    assert pool.num_in_flight("http://a:1") == 0
    with pytest.raises(ValueError, match="urls is empty"):
        DecodePool([])


def test_decode_body_carries_the_prompt_the_handoff_and_only_the_stated_sampling() -> None:
    sampling = Sampling(max_tokens=16, temperature=0.0, seed=3, stop=("\n",))
    body = decode_body(
        _result(), [1, 2, 3], model="m", sampling=sampling, stream=True, cache_salt="tenant:a/b@"
    )
    assert body["prompt"] == [1, 2, 3] and body["max_tokens"] == 16
    assert body["kv_transfer_params"] == TRANSFER
    assert (body["temperature"], body["seed"], body["stop"]) == (0.0, 3, ["\n"])
    assert body["stream_options"] == {"include_usage": True} and body["return_token_ids"] is True
    assert body["cache_salt"] == hashlib.sha256(b"tenant:a/b@").hexdigest()[:32]
    plain = decode_body(
        _result(), [1], model="m", sampling=Sampling(4), stream=False, cache_salt="s"
    )
    assert not {"temperature", "seed", "stop", "stream_options"} & set(plain)
    with pytest.raises(ValueError, match="no kv_transfer_params"):
        decode_body(
            PrefillResult(request_id="r", tenant="t"),
            [1],
            model="m",
            sampling=Sampling(4),
            stream=False,
            cache_salt="s",
        )


def test_answer_and_usage_count_the_agreed_prefix_as_cached() -> None:
    assert pd_usage(_result(cached=32), 16) == {
        "prompt_tokens": 40,
        "completion_tokens": 16,
        "total_tokens": 56,
        "prompt_tokens_details": {"cached_tokens": 32},
    }
    vllm_answer = {
        "id": "cmpl-x",
        "model": "other",
        "choices": [{"index": 0, "text": "", "token_ids": [5, 6], "finish_reason": "length"}],
        "usage": {"prompt_tokens": 40, "completion_tokens": 2, "prompt_tokens_details": None},
    }
    answer = completion_answer(vllm_answer, _result(), model="tiny", created=9)
    assert answer["id"] == "cmpl-r1" and answer["model"] == "tiny"
    assert answer["choices"][0]["token_ids"] == [5, 6]
    assert answer["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    assert answer["usage"]["completion_tokens"] == 2
    assert "kv_transfer_params" not in answer["wavepp"]  # the pull token stays in the gateway


def test_stream_chunks_are_renamed_counted_and_the_usage_chunk_rewritten() -> None:
    token, usage, count = stream_chunk(
        {"choices": [{"index": 0, "text": "a", "token_ids": [9], "finish_reason": None}]},
        _result(),
        model="tiny",
        created=1,
        num_tokens_so_far=2,
    )
    assert token is not None and token["choices"][0]["token_ids"] == [9] and usage is None
    assert count == 3 and token["id"] == "cmpl-r1" and token["model"] == "tiny"
    token, usage, count = stream_chunk(
        {"choices": [], "usage": {"completion_tokens": 3}},
        _result(),
        model="tiny",
        created=1,
        num_tokens_so_far=3,
    )
    assert token is None and usage is not None and count == 3
    assert usage["usage"]["completion_tokens"] == 3
    assert usage["usage"]["prompt_tokens_details"]["cached_tokens"] == 32


def test_decode_error_message_reads_vllms_shape() -> None:
    message = decode_error_message(400, {"error": {"message": "max_tokens too large"}})
    assert message == "decode endpoint answered 400: max_tokens too large"
    assert "503" in decode_error_message(503, "down")


def test_without_decode_endpoints_max_tokens_over_1_is_refused_naming_the_field() -> None:
    with pytest.raises(BadRequest) as exc:
        parse_completion_batch({"prompt": [1, 2], "max_tokens": 16}, PREFILL_ONLY)
    assert exc.value.field == "max_tokens" and exc.value.limit == 1
    assert "no decode endpoints" in str(exc.value)
    for field, value in (("temperature", 0.7), ("seed", 1), ("stop", "x")):
        with pytest.raises(BadRequest) as exc:
            parse_completion_batch({"prompt": [1], field: value}, PREFILL_ONLY)
        assert exc.value.field == field
    greedy = parse_completion_batch({"prompt": [1], "temperature": 0}, PREFILL_ONLY)
    assert greedy.sampling is None and not greedy.prompts[0].handoff


def test_with_decode_endpoints_a_completion_is_decoded() -> None:
    batch = parse_completion_batch(
        {"prompt": [1, 2], "max_tokens": 16, "temperature": 0.5, "seed": 4, "stop": ["a", "b"]},
        WITH_DECODE,
    )
    assert batch.sampling == Sampling(16, 0.5, 4, ("a", "b"))
    assert batch.prompts[0].handoff  # the prefill hands its KV to the decode engine
    default = parse_completion_batch({"prompt": [1]}, WITH_DECODE)
    assert default.sampling is not None and default.sampling.max_tokens == 16
    one = parse_completion_batch({"prompt": [1], "max_tokens": 1, "stream": True}, WITH_DECODE)
    assert one.sampling is not None and one.stream
    # a P/D proxy's own prefill request is still the prefill side's: first token, no decode
    proxy = parse_completion_batch(
        {"prompt": [1], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
        WITH_DECODE,
    )
    assert proxy.sampling is None and proxy.prompts[0].handoff
    bad = [
        ({"max_tokens": 257}, "max_tokens", 256),
        ({"max_tokens": 0}, "max_tokens", 256),
        ({"max_tokens": True}, "max_tokens", 256),
        ({"temperature": 2.5}, "temperature", 2.0),
        ({"temperature": "hot"}, "temperature", 2.0),
        ({"seed": 1.5}, "seed", None),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", 4),
        ({"stop": [""]}, "stop", 4),
        ({"prompt": [[1], [2]]}, "prompt", 1),
    ]
    for extra, field, limit in bad:
        with pytest.raises(BadRequest) as exc:
            parse_completion_batch({"prompt": [1], **extra}, WITH_DECODE)
        assert (exc.value.field, exc.value.limit) == (field, limit), extra
    with pytest.raises(BadRequest) as exc:
        parse_completion_batch(
            {"prompt": [1], "max_tokens": 2, "kv_transfer_params": {"do_remote_decode": True}},
            WITH_DECODE,
        )
    assert exc.value.field == "max_tokens" and "KV handoff" in str(exc.value)


def test_chat_is_a_decoded_completion_of_the_templated_conversation() -> None:
    def template(messages: list[dict[str, str]]) -> list[int]:
        return [len(m["content"]) for m in messages] + [99]

    body = {
        "messages": [
            {"role": "system", "content": "abc"},
            {"role": "user", "content": [{"type": "text", "text": "de"}]},
        ],
        "max_completion_tokens": 8,
        "temperature": 0,
        "stream": True,
    }
    batch = parse_chat(body, WITH_DECODE, template)
    assert batch.prompts[0].token_ids == [3, 2, 99] and batch.prompts[0].handoff
    assert batch.sampling == Sampling(8, 0.0) and batch.stream
    refusals = [
        (body, PREFILL_ONLY, template, "messages", 400),
        (body, WITH_DECODE, None, "messages", 422),
        ({**body, "messages": []}, WITH_DECODE, template, "messages", 400),
        (
            {**body, "messages": [{"role": "user"}]},
            WITH_DECODE,
            template,
            "messages[0].content",
            400,
        ),
        ({**body, "messages": [{"content": "x"}]}, WITH_DECODE, template, "messages[0].role", 400),
        ({**body, "max_tokens": 999}, WITH_DECODE, template, "max_tokens", 400),
        ({**body, "kv_transfer_params": {}}, WITH_DECODE, template, "kv_transfer_params", 400),
    ]
    for bad, limits, tmpl, field, status in refusals:
        with pytest.raises(BadRequest) as exc:
            parse_chat(bad, limits, tmpl)
        assert (exc.value.field, exc.value.status) == (field, status), bad


def test_chat_shapes_of_an_answer_and_a_chunk() -> None:
    whole = completion_answer(
        {"choices": [{"text": "hi", "token_ids": [5, 6], "finish_reason": "length"}]},
        _result(),
        model="tiny",
        created=1,
    )
    chat = chat_answer(whole)
    assert chat["object"] == "chat.completion" and chat["id"] == "chatcmpl-r1"
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    assert chat["choices"][0]["token_ids"] == [5, 6] and chat["usage"] == whole["usage"]
    token, _, _ = stream_chunk(
        {"choices": [{"text": "a", "token_ids": [5]}]},
        _result(),
        model="tiny",
        created=1,
        num_tokens_so_far=0,
    )
    assert token is not None
    first, later = chat_chunk(token, first=True), chat_chunk(token, first=False)
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "a"}
    assert later["choices"][0]["delta"] == {"content": "a"}


def test_the_chat_template_comes_from_the_tokenizer_files(tmp_path) -> None:
    pytest.importorskip("transformers")
    from up_support import build_tokenizer

    from wavepp.gateway.chat_template import load_chat_template

    directory = build_tokenizer(tmp_path / "tok")
    assert load_chat_template(str(directory)) is None  # no template: chat is refused
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "unk_token": "[UNK]",
                "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}"
                "{% if add_generation_prompt %}w9{% endif %}",
            }
        )
    )
    template = load_chat_template(str(directory / "tokenizer.json"))
    assert template is not None
    assert template([{"role": "user", "content": "w1 w2"}]) == [2, 3, 10]
