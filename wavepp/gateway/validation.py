"""Validation of prefill request bodies (pure): every rejection names the field and the limit.

Two request shapes are accepted:

- ``POST /v1/prefill`` (and the NATS prefill subject)::

      {"tenant": "acme", "token_ids": [1, 2, 3] | "text": "...", "request_id": "r1",
       "priority": 0}

- ``POST /v1/completions`` (OpenAI-compatible)::

      {"model": "tiny-llama", "prompt": "..." | [1, 2, 3] | ["...", "..."] | [[1, 2], [3]],
       "max_tokens": 1, "user": "acme", "stream": false,
       "temperature": 0.0, "seed": 7, "stop": "\n" | ["a", "b"],
       "kv_transfer_params": {"do_remote_decode": true}}

  A list of prompts (at most ``MAX_PROMPTS``) is one prefill each. The tenant is the
  ``X-WavePP-Tenant`` header, else ``user``, else the tenant ``default``.
  ``kv_transfer_params`` (vLLM's disaggregated-serving protocol, see :func:`parse_kv_transfer`)
  with ``do_remote_decode: true`` asks for a KV handoff to a decode engine: one prompt, not
  streamed; the answer carries the ``kv_transfer_params`` the decode request consumes.

  Without decode endpoints (``PromptLimits.max_new_tokens`` = 1) the service runs prefill only:
  ``max_tokens`` must be 1 (1 when absent), the answer is greedy (``temperature`` 0 or absent)
  and ``stop``/``seed`` are refused (one token is never stopped; greedy needs no seed). With
  decode endpoints (``max_new_tokens`` > 1) a request without ``kv_transfer_params`` is a whole
  completion (``CompletionRequest.sampling``): prefilled here, decoded on a decode engine;
  ``max_tokens`` in [1, max_new_tokens] (16 when absent, OpenAI's default), one prompt.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from wavepp.api.prefill import REQUEST_ID_PATTERN

_REQUEST_ID = re.compile(REQUEST_ID_PATTERN)
MAX_PRIORITY = 100
MAX_PROMPTS = 64
"""Prompts in one ``/v1/completions`` request (each is its own prefill)."""
MAX_STOP_STRINGS = 4
"""``stop`` strings in one request (OpenAI's bound)."""
MAX_TEMPERATURE = 2.0
"""Largest ``temperature`` (OpenAI's bound)."""
MAX_MESSAGES = 256
"""Messages in one ``/v1/chat/completions`` request."""
DEFAULT_DECODE_TOKENS = 16
"""``max_tokens`` of a decoded completion that does not state it (OpenAI's default)."""


class BadRequest(ValueError):
    """A request that cannot be served: ``field`` names the part, ``limit`` the bound (if any)."""

    def __init__(self, field: str, message: str, limit: object = None, status: int = 400) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        self.limit = limit
        self.status = status

    def to_json(self) -> dict[str, object]:
        error: dict[str, object] = {
            "type": "invalid_request_error",
            "field": self.field,
            "param": self.field,
            "message": str(self),
        }
        if self.limit is not None:
            error["limit"] = self.limit
        return {"error": error}


@dataclass(frozen=True)
class PromptLimits:
    """Bounds of a prompt: ``vocab_size`` (ids in [0, vocab_size)), ``max_prompt_tokens``
    (what every stage's KV cache holds), the tenants that exist, and ``max_new_tokens``: the
    largest ``max_tokens`` of a completion (1: prefill only, no decode endpoints)."""

    vocab_size: int
    max_prompt_tokens: int
    tenants: frozenset[str]
    max_new_tokens: int = 1


@dataclass(frozen=True)
class Sampling:
    """How a decode engine continues a prompt (OpenAI's fields, passed on as they are):
    ``max_tokens`` >= 1, ``temperature`` in [0, ``MAX_TEMPERATURE``] (None: the engine's
    default), ``seed`` (None: none), ``stop`` (at most ``MAX_STOP_STRINGS`` non-empty strings;
    None: none)."""

    max_tokens: int
    temperature: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] | None = None


@dataclass
class ParsedRequest:
    tenant: str
    request_id: str
    token_ids: list[int]
    priority: int = 0
    model: str = ""
    handoff: bool = False  # hand the prompt's KV to a decode engine (kv_transfer_params)


Tokenize = Callable[[str], list[int]]


def _check_tokens(token_ids: object, field: str, limits: PromptLimits) -> list[int]:
    if not isinstance(token_ids, list):
        raise BadRequest(field, f"must be a list of token ids, got {type(token_ids).__name__}")
    if not token_ids:
        raise BadRequest(field, "prompt is empty; send at least 1 token", limit=1)
    if len(token_ids) > limits.max_prompt_tokens:
        raise BadRequest(
            field,
            f"prompt has {len(token_ids)} tokens; the pipeline holds at most "
            f"{limits.max_prompt_tokens}",
            limit=limits.max_prompt_tokens,
        )
    for i, tid in enumerate(token_ids):
        if isinstance(tid, bool) or not isinstance(tid, int) or not 0 <= tid < limits.vocab_size:
            raise BadRequest(
                f"{field}[{i}]",
                f"{tid!r} is not a token id in [0, {limits.vocab_size})",
                limit=limits.vocab_size,
            )
    return list(token_ids)


def _check_tenant(tenant: object, limits: PromptLimits) -> str:
    if not isinstance(tenant, str) or not tenant:
        raise BadRequest("tenant", "required: a tenant name")
    if tenant not in limits.tenants:
        # NOTE: never list the configured tenants: another tenant's name is not this caller's.
        raise BadRequest("tenant", f"unknown tenant {tenant!r:.80}", status=403)
    return tenant


def tenant_hint(body: object, tenant_header: str | None = None, *, completion: bool) -> str:
    """The tenant a body names, before (or without) validating it: for labelling the metrics
    of a request that is refused. Not checked against the known tenants."""
    if tenant_header:
        return tenant_header
    if not isinstance(body, Mapping):
        return "default" if completion else ""
    value = (body.get("user") or "default") if completion else body.get("tenant")
    return value if isinstance(value, str) else ""


def _check_request_id(request_id: object) -> str:
    if request_id is None:
        return uuid.uuid4().hex
    if not isinstance(request_id, str) or not _REQUEST_ID.match(request_id):
        raise BadRequest(
            "request_id",
            f"{request_id!r} must match {REQUEST_ID_PATTERN} (letters, digits, _ = - .; "
            "at most 128)",
            limit=128,
        )
    return request_id


def _text_tokens(text: object, field: str, tokenize: Tokenize | None) -> list[int]:
    if not isinstance(text, str):
        raise BadRequest(field, f"must be a string, got {type(text).__name__}")
    if not text:
        raise BadRequest(field, "prompt is empty; send at least 1 token", limit=1)
    if tokenize is None:
        raise BadRequest(
            field,
            "text needs a tokenizer: start the gateway with --tokenizer PATH (or serve a "
            "checkpoint directory holding tokenizer.json)",
            status=422,
        )
    return tokenize(text)


def parse_prefill(
    body: object, limits: PromptLimits, tokenize: Tokenize | None = None
) -> ParsedRequest:
    """Validate a ``/v1/prefill`` body.

    Raises:
        BadRequest: naming the field (and limit) of the first problem.
    """
    if not isinstance(body, Mapping):
        raise BadRequest("body", "must be a JSON object")
    unknown = sorted(set(body) - {"tenant", "token_ids", "text", "request_id", "priority"})
    if unknown:
        raise BadRequest(unknown[0], "unknown field")
    tenant = _check_tenant(body.get("tenant"), limits)
    has_ids, has_text = "token_ids" in body, "text" in body
    if has_ids == has_text:
        raise BadRequest("token_ids", "give exactly one of token_ids and text")
    if has_ids:
        token_ids = _check_tokens(body["token_ids"], "token_ids", limits)
    else:
        token_ids = _check_tokens(_text_tokens(body["text"], "text", tokenize), "text", limits)
    priority = body.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int) or abs(priority) > MAX_PRIORITY:
        raise BadRequest(
            "priority",
            f"{priority!r} must be an int in [-{MAX_PRIORITY}, {MAX_PRIORITY}]",
            limit=MAX_PRIORITY,
        )
    return ParsedRequest(tenant, _check_request_id(body.get("request_id")), token_ids, priority)


@dataclass
class CompletionRequest:
    """A validated ``/v1/completions`` body: one :class:`ParsedRequest` per prompt, in order;
    ``stream``: answer as server-sent events; ``include_usage``: ``stream_options``' flag;
    ``sampling``: set when the completion is decoded on a decode engine (then one prompt, its
    ``handoff`` set), None when the prefill answers alone."""

    prompts: list[ParsedRequest]
    model: str
    stream: bool = False
    include_usage: bool = False
    sampling: Sampling | None = None


def _prompt_list(prompt: object) -> list[object]:
    """OpenAI's four prompt forms -> a list of single prompts (a string or a list of ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return list(prompt)
    return [prompt]


_NIXL_NULL_KEYS = frozenset({"remote_engine_id", "remote_block_ids", "remote_host", "remote_port"})
"""Keys a P/D proxy puts in a prefill request's ``kv_transfer_params`` for NixlConnector, always
null there (vLLM's disaggregated proxies); accepted only as null."""


def parse_kv_transfer(value: object) -> bool:
    """Whether a ``/v1/completions`` body's ``kv_transfer_params`` asks for a KV handoff.

    Accepted: absent or null (no handoff); an object with ``do_remote_decode`` (true or false;
    absent: false), ``do_remote_prefill`` (false or null: this service is the prefill side) and
    the NixlConnector keys ``remote_engine_id``, ``remote_block_ids``, ``remote_host``,
    ``remote_port`` (null only), as vLLM's disaggregated proxies send them.

    Raises:
        BadRequest: field ``kv_transfer_params`` (not an object) or
            ``kv_transfer_params.<key>`` (an unknown key, or a value outside the above).
    """
    if value is None:
        return False
    if not isinstance(value, Mapping):
        raise BadRequest(
            "kv_transfer_params",
            f'must be an object such as {{"do_remote_decode": true}}, got {type(value).__name__}',
        )
    known = {"do_remote_decode", "do_remote_prefill"} | _NIXL_NULL_KEYS
    for key in sorted(value, key=str):
        field = f"kv_transfer_params.{key!s:.40}"
        if key not in known:
            raise BadRequest(
                field, f"unknown key; known: {sorted(known)} (this service is the prefill side)"
            )
        if key in _NIXL_NULL_KEYS and value[key] is not None:
            raise BadRequest(field, "must be null in a prefill request")
    prefill = value.get("do_remote_prefill")
    if prefill not in (None, False):
        raise BadRequest(
            "kv_transfer_params.do_remote_prefill",
            f"{prefill!r:.40}: this service runs the prefill; it consumes no remote KV",
        )
    decode = value.get("do_remote_decode", False)
    if not isinstance(decode, bool):
        raise BadRequest(
            "kv_transfer_params.do_remote_decode", f"{decode!r:.40} must be true or false"
        )
    return decode


def _check_openai_fields(body: Mapping[str, object], model_name: str) -> tuple[str, bool, bool]:
    """An OpenAI body's ``model`` (404 unless the served ``model_name``; absent: that name),
    ``n`` (1 only), ``stream`` and ``stream_options``, checked in that order: (model, stream,
    include_usage)."""
    model = body.get("model", model_name)
    if model_name and model not in (model_name, None):
        raise BadRequest("model", f"{model!r:.80}: this service serves {model_name!r}", status=404)
    if body.get("n", 1) not in (1, None):
        raise BadRequest("n", "only n=1 is supported", limit=1)
    served = str(model or model_name)
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest("stream", f"{stream!r:.40} must be true or false")
    options = body.get("stream_options")
    if options is None:
        return served, stream, False
    if not isinstance(options, Mapping) or not isinstance(
        options.get("include_usage", False), bool
    ):
        raise BadRequest("stream_options", 'must be {"include_usage": true|false}')
    if not stream:
        raise BadRequest("stream_options", "only with stream: true")
    return served, stream, bool(options.get("include_usage", False))


_PREFILL_ONLY = "this service runs prefill only (no decode endpoints: see wavepp up --decode)"
_HANDOFF = "a KV handoff (kv_transfer_params) is answered with the first token"


def _check_max_tokens(body: Mapping[str, object], limits: PromptLimits, mode: str) -> int:
    """``max_tokens`` for ``mode`` ``decode`` (a whole completion), ``handoff`` (the prefill
    side of a P/D proxy) or ``prefill`` (no decode endpoints)."""
    default = DEFAULT_DECODE_TOKENS if mode == "decode" else 1
    max_tokens = body.get("max_tokens", default)
    if max_tokens is None:
        max_tokens = default
    limit = limits.max_new_tokens if mode == "decode" else 1
    if (
        isinstance(max_tokens, bool)
        or not isinstance(max_tokens, int)
        or not 1 <= max_tokens <= limit
    ):
        why = {
            "decode": f"must be an int in [1, {limit}]",
            "handoff": f"{_HANDOFF}; max_tokens must be 1",
            "prefill": f"{_PREFILL_ONLY} and returns the first token; max_tokens must be 1",
        }[mode]
        raise BadRequest("max_tokens", f"{max_tokens!r:.40}: {why}", limit=limit)
    return max_tokens


def _check_sampling(body: Mapping[str, object], max_tokens: int, mode: str) -> Sampling:
    """The sampling fields, checked; refused in ``prefill`` mode (one greedy token) unless
    neutral. A ``handoff`` request (a P/D proxy's prefill) carries the decode side's fields:
    checked, not applied here."""
    temperature = body.get("temperature")
    if temperature is not None and (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or not 0 <= temperature <= MAX_TEMPERATURE
    ):
        raise BadRequest(
            "temperature",
            f"{temperature!r:.40} must be a number in [0, {MAX_TEMPERATURE:g}]",
            limit=MAX_TEMPERATURE,
        )
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest("seed", f"{seed!r:.40} must be an integer")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (
        not isinstance(stop, list)
        or len(stop) > MAX_STOP_STRINGS
        or not all(isinstance(x, str) and x for x in stop)
    ):
        raise BadRequest(
            "stop",
            f"must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them",
            limit=MAX_STOP_STRINGS,
        )
    if mode == "prefill":
        if temperature not in (None, 0):
            raise BadRequest("temperature", f"{_PREFILL_ONLY}: its one token is greedy; send 0")
        if seed is not None:
            raise BadRequest("seed", f"{_PREFILL_ONLY}: a greedy token takes no seed")
        if stop:
            raise BadRequest("stop", f"{_PREFILL_ONLY}: one token is never stopped")
    return Sampling(
        max_tokens,
        None if temperature is None else float(temperature),
        seed,
        None if stop is None else tuple(stop),
    )


def parse_completion_batch(
    body: object,
    limits: PromptLimits,
    tokenize: Tokenize | None = None,
    *,
    tenant_header: str | None = None,
    model_name: str = "",
) -> CompletionRequest:
    """Validate an OpenAI ``/v1/completions`` body (the module docstring says which fields,
    with and without decode endpoints).

    Raises:
        BadRequest: naming the field (``prompt[2]``, ``max_tokens``, ...) and limit of the
            first problem.
    """
    if not isinstance(body, Mapping):
        raise BadRequest("body", "must be a JSON object")
    handoff = parse_kv_transfer(body.get("kv_transfer_params"))
    # a whole completion: decode endpoints exist and the caller is not itself the P/D proxy
    decode = limits.max_new_tokens > 1 and body.get("kv_transfer_params") is None
    mode = "decode" if decode else "handoff" if body.get("kv_transfer_params") else "prefill"
    max_tokens = _check_max_tokens(body, limits, mode)
    sampling = _check_sampling(body, max_tokens, mode)
    model, stream, include_usage = _check_openai_fields(body, model_name)
    if handoff and stream:
        raise BadRequest("stream", "a KV handoff (kv_transfer_params) is answered as one object")
    tenant = _check_tenant(tenant_header or body.get("user") or "default", limits)
    prompt = body.get("prompt")
    if prompt is None:
        raise BadRequest("prompt", "required: a string, a list of token ids, or a list of those")
    prompts = _prompt_list(prompt)
    if len(prompts) > MAX_PROMPTS:
        raise BadRequest(
            "prompt", f"{len(prompts)} prompts; at most {MAX_PROMPTS} per request", MAX_PROMPTS
        )
    if handoff and len(prompts) != 1:
        raise BadRequest(
            "prompt", f"{len(prompts)} prompts; a KV handoff (kv_transfer_params) takes one", 1
        )
    if decode and len(prompts) != 1:
        raise BadRequest(
            "prompt", f"{len(prompts)} prompts; a decoded completion takes one per request", 1
        )
    parsed = []
    for i, one in enumerate(prompts):
        field = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if isinstance(one, str):
            token_ids = _check_tokens(_text_tokens(one, field, tokenize), field, limits)
        else:
            token_ids = _check_tokens(one, field, limits)
        parsed.append(
            ParsedRequest(tenant, uuid.uuid4().hex, token_ids, 0, model, handoff or decode)
        )
    return CompletionRequest(parsed, model, stream, include_usage, sampling if decode else None)


Messages = list[dict[str, str]]
ChatTemplate = Callable[[Messages], list[int]]


def _check_messages(messages: object) -> Messages:
    if not isinstance(messages, list) or not 1 <= len(messages) <= MAX_MESSAGES:
        raise BadRequest(
            "messages", f"must be a list of 1 to {MAX_MESSAGES} messages", limit=MAX_MESSAGES
        )
    out: Messages = []
    for i, message in enumerate(messages):
        field = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise BadRequest(field, 'must be an object {"role": ..., "content": ...}')
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise BadRequest(f"{field}.role", "required: a non-empty string")
        if isinstance(content, list):  # OpenAI's content parts: text only
            if not all(isinstance(p, Mapping) and p.get("type") == "text" for p in content):
                raise BadRequest(f"{field}.content", "only text parts are supported")
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(content, str):
            raise BadRequest(f"{field}.content", "must be a string or a list of text parts")
        out.append({"role": role, "content": content})
    return out


def parse_chat(
    body: object,
    limits: PromptLimits,
    template: ChatTemplate | None,
    *,
    tenant_header: str | None = None,
    model_name: str = "",
) -> CompletionRequest:
    """Validate an OpenAI ``/v1/chat/completions`` body into one decoded completion of the
    templated conversation (``template``: the checkpoint's chat template, messages -> token
    ids, ``add_generation_prompt``). Fields as a decoded ``/v1/completions`` request's, with
    ``messages`` (1 to ``MAX_MESSAGES`` of ``{"role", "content"}``, content a string or text
    parts) instead of ``prompt``; ``max_completion_tokens`` is read as ``max_tokens``.

    Raises:
        BadRequest: naming the field of the first problem; ``messages`` with status 422 when
            there is no chat template, 400 without decode endpoints (a chat answer is
            decoded); ``max_tokens`` out of [1, ``max_new_tokens``].
    """
    if not isinstance(body, Mapping):
        raise BadRequest("body", "must be a JSON object")
    if limits.max_new_tokens <= 1:
        raise BadRequest(
            "messages", f"{_PREFILL_ONLY}; chat completions are decoded on a decode engine"
        )
    if body.get("kv_transfer_params") is not None:
        raise BadRequest("kv_transfer_params", "a KV handoff takes /v1/completions")
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is not None:
        body = {**body, "max_tokens": body["max_completion_tokens"]}
    max_tokens = _check_max_tokens(body, limits, "decode")
    sampling = _check_sampling(body, max_tokens, "decode")
    model, stream, include_usage = _check_openai_fields(body, model_name)
    tenant = _check_tenant(tenant_header or body.get("user") or "default", limits)
    messages = _check_messages(body.get("messages"))
    if template is None:
        raise BadRequest(
            "messages",
            "the served checkpoint's tokenizer has no chat template (tokenizer_config.json "
            "chat_template or chat_template.jinja); send /v1/completions with a prompt",
            status=422,
        )
    token_ids = _check_tokens(template(messages), "messages", limits)
    parsed = ParsedRequest(tenant, uuid.uuid4().hex, token_ids, 0, model, True)
    return CompletionRequest([parsed], model, stream, include_usage, sampling)
