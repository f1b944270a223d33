"""The OpenAI-compatible bodies of the gateway (pure): ``/v1/models``, ``/v1/completions`` as
one JSON object or as server-sent events.

The service runs prefill only, so a completion is the first token of each prompt:

- ``GET /v1/models``: ``{"object": "list", "data": [{"id": MODEL, "object": "model",
  "created": T, "owned_by": "wavepp"}]}``, the one model the pool serves.
- ``POST /v1/completions``: one choice per prompt (``index`` = the prompt's position), each
  with ``text`` (the decoded token; "" without a tokenizer), ``token_ids`` and
  ``finish_reason`` ``"length"``; ``usage`` summed over the prompts, with
  ``prompt_tokens_details.cached_tokens`` the reused prefix in tokens; ``wavepp``: each prompt's
  ``PrefillResult`` (a list when there were several prompts); ``kv_transfer_params``: a
  handed-off request's (``"kv_transfer_params": {"do_remote_decode": true}`` in the request, one
  prompt), what the decode request consumes, as in vLLM's answer; null otherwise.
- ``"stream": true``: ``text/event-stream``, one ``data:`` event per prompt (a
  ``text_completion`` chunk with its single token), then, with
  ``stream_options.include_usage``, one chunk with empty ``choices`` and the ``usage``, then
  ``data: [DONE]``. This is what the ``openai`` client's stream loop reads.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

from wavepp.api.prefill import PrefillResult

Decode = Callable[[list[int]], str]


def models_body(model_name: str, created: int) -> dict[str, object]:
    """The ``GET /v1/models`` answer: the pool's one model."""
    return {
        "object": "list",
        "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "wavepp"}],
    }


def _usage(results: Sequence[PrefillResult]) -> dict[str, object]:
    prompt = sum(r.num_prompt_tokens for r in results)
    cached = sum(r.num_cached_tokens for r in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": len(results),
        "total_tokens": prompt + len(results),
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _choice(index: int, result: PrefillResult, decode: Decode | None) -> dict[str, object]:
    text = ""
    if decode is not None and result.first_token_id is not None:
        text = decode([result.first_token_id])
    return {
        "index": index,
        "text": text,
        "token_ids": [result.first_token_id],
        "logprobs": None,
        "finish_reason": "length",
    }


def completion_head(request_id: str, model: str, created: int) -> dict[str, object]:
    """What every OpenAI ``text_completion`` object and stream chunk starts with: ``id``
    (``cmpl-`` + the request id), ``object``, ``created`` (Unix seconds) and ``model``."""
    return {
        "id": f"cmpl-{request_id}",
        "object": "text_completion",
        "created": created,
        "model": model,
    }


def completion_body(
    results: Sequence[PrefillResult], model: str, created: int, decode: Decode | None
) -> dict[str, object]:
    """The ``/v1/completions`` JSON answer for ``results`` (one per prompt, in order)."""
    dumped = [r.model_dump(mode="json", exclude={"mac", "kv_transfer_params"}) for r in results]
    return {
        **completion_head(results[0].request_id, model, created),
        "choices": [_choice(i, r, decode) for i, r in enumerate(results)],
        "usage": _usage(results),
        "wavepp": dumped[0] if len(dumped) == 1 else dumped,
        "kv_transfer_params": results[0].kv_transfer_params if len(results) == 1 else None,
    }


def sse_events(
    results: Sequence[PrefillResult],
    model: str,
    created: int,
    decode: Decode | None,
    *,
    include_usage: bool,
) -> bytes:
    """The ``stream: true`` answer: one event per prompt, the usage chunk if asked, ``[DONE]``."""
    head = completion_head(results[0].request_id, model, created)
    chunks: list[dict[str, object]] = [
        {
            **head,
            "choices": [_choice(i, result, decode)],
            "wavepp": result.model_dump(mode="json", exclude={"mac"}),
        }
        for i, result in enumerate(results)
    ]
    if include_usage:
        chunks.append({**head, "choices": [], "usage": _usage(results)})
    events = [f"data: {json.dumps(chunk)}\n\n" for chunk in chunks] + ["data: [DONE]\n\n"]
    return "".join(events).encode()
