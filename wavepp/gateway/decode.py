"""A whole completion's decode half (pure): which decode endpoint, what it is sent, and how its
answer becomes the gateway's.

A decode endpoint is an OpenAI-compatible vLLM server whose KV connector is WavePP's
(``wavepp.integrations.vllm.connector``, ``kv_consumer``). After the prefill ran on a WavePP
replica with a KV handoff, the gateway sends the endpoint (:func:`decode_body`)::

    {"model", "prompt": [token ids], "max_tokens", "temperature"?, "seed"?, "stop"?,
     "stream", "stream_options": {"include_usage": true} (stream only),
     "return_token_ids": true, "cache_salt": <hex SHA-256 of the tenant's salt, 32 digits>,
     "kv_transfer_params": <the prefill's; its handoff with the decode span's "traceparent">}

with the HTTP header ``traceparent`` (W3C) of the gateway's ``decode`` span when the gateway
traces, so a vLLM started with ``--otlp-traces-endpoint`` records its request in that trace.

and the endpoint pulls the prompt's KV from the stages and decodes. Its answer is passed on
under the gateway's id and model (:func:`completion_answer`, :func:`stream_chunk`), each choice
with the generated ``token_ids``, and ``usage`` (:func:`pd_usage`) counting the prompt, the
completion and, as ``prompt_tokens_details.cached_tokens``, the prefix the WavePP stages agreed
to reuse (``PrefillResult.num_cached_tokens``).

``CompletionClock`` times one completion as its client sees it: time to first token from the
admission, and the mean time per output token after the first (the gateway's
``completion_ttft`` and ``time_per_output_token`` histograms).

``DecodePool`` picks the endpoint with the fewest requests in flight from this gateway (ties:
the one chosen least recently); one that refused a connection is passed over for
``down_s`` seconds while another is up.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from wavepp.api.kv_handoff import PARAMS_KEY
from wavepp.api.prefill import PrefillResult
from wavepp.gateway.openai_api import completion_head
from wavepp.gateway.validation import Sampling

DEFAULT_DOWN_S = 5.0
"""Seconds a decode endpoint that refused a connection is passed over (while another is up)."""


@dataclass
class _Endpoint:
    url: str
    num_in_flight: int = 0
    down_until_s: float = float("-inf")
    last_chosen: int = -1


@dataclass
class DecodePool:
    """The decode endpoints (base URLs, e.g. ``http://127.0.0.1:8100``) and their load as this
    gateway sees it. Not thread-safe (the gateway's event loop owns it). ``urls`` non-empty."""

    urls: Sequence[str]
    down_s: float = DEFAULT_DOWN_S
    _endpoints: dict[str, _Endpoint] = field(init=False)
    _num_chosen: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError("DecodePool: urls is empty; give at least one decode endpoint")
        self._endpoints = {u.rstrip("/"): _Endpoint(u.rstrip("/")) for u in self.urls}

    def order(self, now_s: float) -> list[str]:
        """Every endpoint, best first: those not marked down before those that are, then the
        fewest in flight, then the least recently chosen."""
        return [
            e.url
            for e in sorted(
                self._endpoints.values(),
                key=lambda e: (e.down_until_s > now_s, e.num_in_flight, e.last_chosen),
            )
        ]

    def begin(self, url: str) -> None:
        """A request was sent to ``url`` (counted in flight until :meth:`end`)."""
        endpoint = self._endpoints[url]
        endpoint.num_in_flight += 1
        endpoint.last_chosen = self._num_chosen
        self._num_chosen += 1

    def end(self, url: str) -> None:
        """The request sent to ``url`` is answered, failed or abandoned."""
        self._endpoints[url].num_in_flight -= 1

    def mark_down(self, url: str, now_s: float) -> None:
        """``url`` refused a connection: passed over for ``down_s`` seconds."""
        self._endpoints[url].down_until_s = now_s + self.down_s

    def num_in_flight(self, url: str) -> int:
        return self._endpoints[url].num_in_flight


@dataclass
class CompletionClock:
    """One completion's token times as sent to its client (seconds of one monotonic clock).

    ``admitted_s``: when the gateway admitted the request (validated, before its queue).
    ``sent(num_tokens, now_s)`` after each write that carried ``num_tokens`` generated tokens
    (writes of 0 tokens are not counted). Invariant: ``first_s <= last_s`` once a token was sent.
    """

    admitted_s: float
    num_tokens: int = 0
    first_s: float | None = None
    last_s: float | None = None

    def sent(self, num_tokens: int, now_s: float) -> bool:
        """Count a write of ``num_tokens`` tokens at ``now_s``; True when it carried the
        completion's first token (the moment its TTFT ends)."""
        if num_tokens <= 0:
            return False
        first = self.first_s is None
        if first:
            self.first_s = now_s
        self.last_s = now_s
        self.num_tokens += num_tokens
        return first

    @property
    def ttft_s(self) -> float | None:
        """Seconds from admission to the first token sent; None before it."""
        return None if self.first_s is None else self.first_s - self.admitted_s

    @property
    def tpot_s(self) -> float | None:
        """Mean seconds between output tokens after the first: ``(last - first) / (tokens -
        1)``; None with fewer than 2 tokens (a write of k tokens counts k, so a chunk carrying
        several tokens lowers the mean as it should)."""
        if self.first_s is None or self.last_s is None or self.num_tokens < 2:
            return None
        return (self.last_s - self.first_s) / (self.num_tokens - 1)


def decode_body(
    result: PrefillResult,
    token_ids: Sequence[int],
    *,
    model: str,
    sampling: Sampling,
    stream: bool,
    cache_salt: str,
    traceparent: str = "",
) -> dict[str, object]:
    """The decode endpoint's ``/v1/completions`` body for a prefilled prompt (module
    docstring). ``result`` carries the handoff's ``kv_transfer_params`` (ValueError if not).
    ``traceparent`` (W3C, "" none): set as the handoff's ``traceparent``, so the stages record
    the KV pull in that trace (``wavepp.api.kv_handoff``)."""
    if not result.kv_transfer_params:
        raise ValueError(f"prefill of {result.request_id} carries no kv_transfer_params")
    transfer = dict(result.kv_transfer_params)
    handoff = transfer.get(PARAMS_KEY)
    if traceparent and isinstance(handoff, Mapping):
        transfer[PARAMS_KEY] = {**handoff, "traceparent": traceparent}
    body: dict[str, object] = {
        "model": model,
        "prompt": list(token_ids),
        "max_tokens": sampling.max_tokens,
        "stream": stream,
        "return_token_ids": True,
        # vLLM's cache_salt takes at most 128 characters and no '@', '/' or '\\': a digest
        "cache_salt": hashlib.sha256(cache_salt.encode()).hexdigest()[:32],
        "kv_transfer_params": transfer,
    }
    if sampling.temperature is not None:
        body["temperature"] = sampling.temperature
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    if sampling.stop is not None:
        body["stop"] = list(sampling.stop)
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def pd_usage(result: PrefillResult, num_completion_tokens: int) -> dict[str, object]:
    """``usage`` of a whole completion: the prompt's tokens, the decoded ones, and the reused
    prefix (the WavePP agreement's, ``result.num_cached_tokens``) as ``cached_tokens``."""
    prompt = result.num_prompt_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": num_completion_tokens,
        "total_tokens": prompt + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": result.num_cached_tokens},
    }


def _choice(choice: Mapping[str, object]) -> dict[str, object]:
    token_ids = choice.get("token_ids")
    return {
        "index": 0,
        "text": choice.get("text") or "",
        "token_ids": list(token_ids) if isinstance(token_ids, list) else [],
        "logprobs": choice.get("logprobs"),
        "finish_reason": choice.get("finish_reason"),
        "stop_reason": choice.get("stop_reason"),
    }


def _completion_tokens(answer: Mapping[str, object], choices: list[dict[str, object]]) -> int:
    usage = answer.get("usage")
    if isinstance(usage, Mapping) and isinstance(usage.get("completion_tokens"), int):
        return int(usage["completion_tokens"])  # type: ignore[arg-type]
    return sum(len(c["token_ids"]) for c in choices)  # type: ignore[arg-type]


def completion_answer(
    answer: Mapping[str, object], result: PrefillResult, *, model: str, created: int
) -> dict[str, object]:
    """The gateway's ``/v1/completions`` answer from the decode endpoint's (one choice)."""
    raw = answer.get("choices")
    choices = (
        [_choice(c) for c in raw[:1] if isinstance(c, Mapping)] if isinstance(raw, list) else []
    )
    return {
        **completion_head(result.request_id, model, created),
        "choices": choices,
        "usage": pd_usage(result, _completion_tokens(answer, choices)),
        "wavepp": result.model_dump(mode="json", exclude={"mac", "kv_transfer_params"}),
    }


def stream_chunk(
    chunk: Mapping[str, object],
    result: PrefillResult,
    *,
    model: str,
    created: int,
    num_tokens_so_far: int,
) -> tuple[dict[str, object] | None, dict[str, object] | None, int]:
    """One decode SSE chunk as the gateway's: (the token chunk or None, the usage chunk or None,
    tokens counted so far). vLLM's usage chunk (empty ``choices``) becomes the gateway's usage
    chunk (:func:`pd_usage`); a chunk's ``token_ids`` add to the count."""
    base = completion_head(result.request_id, model, created)
    raw = chunk.get("choices")
    choices = (
        [_choice(c) for c in raw[:1] if isinstance(c, Mapping)] if isinstance(raw, list) else []
    )
    count = num_tokens_so_far + sum(len(c["token_ids"]) for c in choices)  # type: ignore[arg-type]
    token_chunk = {**base, "choices": choices} if choices else None
    usage_chunk = None
    if not choices and isinstance(chunk.get("usage"), Mapping):
        usage_chunk = {
            **base,
            "choices": [],
            "usage": pd_usage(result, _completion_tokens(chunk, []) or count),
        }
    return token_chunk, usage_chunk, count


def decode_error_message(status: int, body: object) -> str:
    """A decode endpoint's error answer in one line: its ``error.message`` (vLLM's and OpenAI's
    shape), else the body's start, with the HTTP status."""
    message = ""
    if isinstance(body, Mapping):
        error = body.get("error")
        if isinstance(error, Mapping):
            message = str(error.get("message", ""))
        elif isinstance(body.get("message"), str):
            message = str(body["message"])
    if not message:
        message = str(body)[:200]
    return f"decode endpoint answered {status}: {message}"


def chat_answer(answer: Mapping[str, object]) -> dict[str, object]:
    """A :func:`completion_answer` in ``/v1/chat/completions``' shape: ``chat.completion``,
    each choice's text as the assistant's ``message`` (``token_ids`` kept)."""
    choices = [
        {
            "index": c["index"],
            "message": {"role": "assistant", "content": c["text"]},
            "token_ids": c["token_ids"],
            "logprobs": None,
            "finish_reason": c["finish_reason"],
        }
        for c in answer["choices"]  # type: ignore[attr-defined]
    ]
    return {
        **answer,
        "id": f"chatcmpl-{str(answer['id']).removeprefix('cmpl-')}",
        "object": "chat.completion",
        "choices": choices,
    }


def chat_chunk(chunk: Mapping[str, object], *, first: bool) -> dict[str, object]:
    """A :func:`stream_chunk` token or usage chunk in ``chat.completion.chunk`` shape: the
    text as ``delta.content`` (the first chunk's delta also names the role)."""
    choices = []
    for c in chunk["choices"]:  # type: ignore[attr-defined]
        delta = {"role": "assistant", "content": c["text"]} if first else {"content": c["text"]}
        choices.append(
            {
                "index": c["index"],
                "delta": delta,
                "token_ids": c["token_ids"],
                "logprobs": None,
                "finish_reason": c["finish_reason"],
            }
        )
    return {
        **chunk,
        "id": f"chatcmpl-{str(chunk['id']).removeprefix('cmpl-')}",
        "object": "chat.completion.chunk",
        "choices": choices,
    }
