"""A whole completion through prefill/decode disaggregation: the HTTP half of the gateway's
decode path (aiohttp client). The pure parts (endpoint order, bodies, usage) are in
``wavepp.gateway.decode``.

``DecodeFlow.complete`` serves one validated ``/v1/completions`` request whose
``CompletionRequest.sampling`` is set, after the gateway admitted it (API key -> tenant, limits,
cache salt): it prefills the prompt on a WavePP replica with a KV handoff (``prefill``, the
gateway's own path), then POSTs the decode request to the decode endpoints in
``DecodePool.order`` (the next one when a connection is refused) and answers with the decode
endpoint's completion, or streams its tokens as server-sent events as they come. Each request
opens its own connection (none is kept alive): behind a Kubernetes Service that is what lets a
scaled-down decode pod stop getting requests once it leaves the endpoints, and a new one get
them at once.

Tracing (when the gateway traces, ``GatewayConfig.telemetry``): one span tree per request,
in the trace of the client's ``traceparent`` header when it sent one::

    gateway.request      request.id, tenant, http.route, http.status_code, completion.tokens
    ├── prefill          the gateway's prefill (queue, route, intake, answer); the replica's
    │   └── request ...  ``request`` span and its agreement and stage spans
    │                    (``wavepp.telemetry.pipeline``) through ``IntakeRequest.traceparent``
    └── decode           from the decode request to its last chunk (decode.endpoint); its
        ├── handoff.pull traceparent goes to the endpoint as the HTTP header ``traceparent``
        │   (per stage)  (vLLM's own spans) and in the handoff (the stages' pull spans)
        └── (vLLM)

Metrics (``GatewayMetrics``): ``first_token_sent`` when the first generated token is written
to the client (a non-streamed answer: when it is built), ``output_tokens_paced`` when a stream
of two or more tokens ended normally (``decode.CompletionClock``).

Failures and what they release:

- prefill refused or failed: its JSON error (status as ``/v1/prefill``); no lease was taken.
- no decode endpoint reachable (refused, or the connection lost before an answer): 503
  ``{"error": {"field": "decode", ...}}``; the handoff lease is released on every stage
  (``release_handoff``) at once instead of at its expiry.
- the decode endpoint answers an error: its status (4xx passed on, else 502) with field
  ``decode`` and its message; lease released. vLLM answers a failed KV load as a bare 500
  "Internal server error", so this message, and the mid-stream and mid-answer ones below, end
  with the stages' view of the handoff (``describe_release``): still held and not pulled, or
  how it ended on each stage (lease ended, its pull broke off, released after its pull); so
  does the 503's.
- the decode endpoint breaks mid-stream (killed, connection lost, no chunk within
  ``chunk_timeout_s``): a final SSE event ``data: {"error": {...}}`` (which the ``openai``
  client raises as ``APIError``), then the stream ends; lease released (a decode engine that
  pulled the KV released it already; a second release is refused by the stage and ignored).
- the client goes away mid-stream: the decode response is closed (vLLM aborts the request)
  and the lease released.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web
from opentelemetry.context import Context
from opentelemetry.trace import Span, Status, StatusCode

from wavepp.api.prefill import PrefillResult
from wavepp.gateway.decode import (
    CompletionClock,
    DecodePool,
    chat_answer,
    chat_chunk,
    completion_answer,
    decode_body,
    decode_error_message,
    pd_usage,
    stream_chunk,
)
from wavepp.gateway.errors import error_body
from wavepp.gateway.metrics import GatewayMetrics
from wavepp.gateway.openai_api import completion_head
from wavepp.gateway.validation import CompletionRequest
from wavepp.runtime.serving.handoff import (
    describe_release,
    release_handoff,
    release_handoff_report,
)
from wavepp.telemetry import tracing

log = logging.getLogger(__name__)

Prefill = Callable[[], Awaitable[tuple[int, object, dict]]]
Answered = Callable[[int], None]


class DecodeFlow:
    """The decode half of whole completions (module docstring) over ``pool``'s endpoints.

    ``connect_timeout_s``: to reach an endpoint; ``chunk_timeout_s``: the longest wait for the
    decode endpoint's answer or next stream chunk (it includes the KV pull); ``metrics``: where
    the completions' TTFT and time per output token are recorded (None: nowhere).
    """

    def __init__(
        self,
        pool: DecodePool,
        *,
        model_name: str,
        connect_timeout_s: float = 5.0,
        chunk_timeout_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.pool = pool
        self.metrics = metrics
        self.model_name = model_name
        self.connect_timeout_s = connect_timeout_s
        self.chunk_timeout_s = chunk_timeout_s
        self.clock = clock
        self._session: aiohttp.ClientSession | None = None
        self._models: dict[str, str] = {}  # endpoint -> the model name it serves

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                # one connection per request: a decode Service's proxy picks a pod per
                # connection, so each request goes to a pod that is in its endpoints now
                # (a terminating pod gets none; a new one gets its share at once)
                connector=aiohttp.TCPConnector(force_close=True),
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=self.connect_timeout_s, sock_read=self.chunk_timeout_s
                ),
            )
        return self._session

    async def _served_model(self, url: str) -> str:
        """The model name ``url`` serves (its ``/v1/models``' first), asked once."""
        if url not in self._models:
            async with self.session.get(f"{url}/v1/models") as response:
                response.raise_for_status()
                data = (await response.json()).get("data") or [{}]
                self._models[url] = str(data[0].get("id") or self.model_name)
        return self._models[url]

    async def _send(
        self, result: PrefillResult, batch: CompletionRequest, cache_salt: str, traceparent: str
    ) -> tuple[str, aiohttp.ClientResponse] | None:
        """POST the decode request to the first endpoint (``DecodePool.order``) that takes the
        connection; (url, open response) with the endpoint counted in flight, or None when
        none could be reached. ``traceparent`` (W3C, "" none): the decode span's, sent as the
        HTTP header and in the handoff (``decode.decode_body``)."""
        assert batch.sampling is not None
        headers = {tracing.TRACEPARENT_HEADER: traceparent} if traceparent else None
        for url in self.pool.order(self.clock()):
            try:
                body = decode_body(
                    result,
                    batch.prompts[0].token_ids,
                    model=await self._served_model(url),
                    sampling=batch.sampling,
                    stream=batch.stream,
                    cache_salt=cache_salt,
                    traceparent=traceparent,
                )
                self.pool.begin(url)
                try:
                    response = await self.session.post(
                        f"{url}/v1/completions", json=body, headers=headers
                    )
                except BaseException:
                    self.pool.end(url)
                    raise
                return url, response
            except (TimeoutError, aiohttp.ClientConnectionError) as exc:
                log.warning("decode endpoint %s unreachable: %r", url, exc)
                self.pool.mark_down(url, self.clock())
            except aiohttp.ClientResponseError as exc:
                log.warning("decode endpoint %s: /v1/models answered %s", url, exc.status)
                self.pool.mark_down(url, self.clock())
        return None

    async def complete(
        self,
        request: web.Request,
        batch: CompletionRequest,
        *,
        prefill: Prefill,
        cache_salt: str,
        answered: Answered,
        chat: bool = False,
    ) -> web.StreamResponse:
        """Serve ``batch`` (one prompt, ``sampling`` set) as the module docstring says.
        ``prefill``: the gateway's prefill of ``batch.prompts[0]`` (status, PrefillResult or
        error body, headers), called inside the ``prefill`` span; ``answered(status)``: counts
        the answer in the metrics; ``chat``: answer in ``/v1/chat/completions``' shapes
        (``decode.chat_answer``, ``decode.chat_chunk``)."""
        first = batch.prompts[0]
        clock = CompletionClock(self.clock())
        codes: list[int] = []

        def answered_once(code: int) -> None:
            codes.append(code)
            answered(code)

        assert batch.sampling is not None
        client = tracing.context_from_traceparent(
            request.headers.get(tracing.TRACEPARENT_HEADER, "")
        )
        root = tracing.start_span(
            "gateway.request",
            parent=client or Context(),  # the client's trace, else a trace of its own
            attributes={
                "request.id": first.request_id,
                "tenant": first.tenant,
                "http.route": "/v1/chat/completions" if chat else "/v1/completions",
                "completion.stream": batch.stream,
                "completion.max_tokens": batch.sampling.max_tokens,
            },
        )
        unanswered = 499  # the client left (cancelled) before an answer was counted
        try:
            with tracing.use_span(root):
                return await self._complete(
                    request, batch, prefill, cache_salt, answered_once, chat, clock
                )
        except Exception:
            unanswered = 500
            raise
        finally:
            _end(root, codes[-1] if codes else unanswered, clock)

    def _tokens_sent(self, tenant: str, clock: CompletionClock, num_tokens: int) -> None:
        """``num_tokens`` generated tokens were just sent to the client."""
        if clock.sent(num_tokens, self.clock()) and self.metrics is not None:
            assert clock.ttft_s is not None
            self.metrics.first_token_sent(tenant, clock.ttft_s)

    async def _complete(
        self,
        request: web.Request,
        batch: CompletionRequest,
        prefill: Prefill,
        cache_salt: str,
        answered: Answered,
        chat: bool,
        clock: CompletionClock,
    ) -> web.StreamResponse:
        with tracing.span("prefill") as prefill_span:
            status, payload, headers = await prefill()
            if prefill_span is not None:
                prefill_span.set_attribute("http.status_code", status)
                if isinstance(payload, PrefillResult):
                    prefill_span.set_attributes(
                        {"replica": payload.replica, "tokens.cached": payload.num_cached_tokens}
                    )
        if status != 200:
            answered(status)
            return web.json_response(payload, status=status, headers=headers)
        assert isinstance(payload, PrefillResult)
        result = payload
        if not result.kv_transfer_params:
            answered(500)
            message = "the prefill answered without a KV handoff; it cannot be decoded"
            return web.json_response(error_body("decode", message, kind="server_error"), status=500)
        sent = None
        decode_span = tracing.start_span("decode")
        try:
            sent = await self._send(result, batch, cache_salt, tracing.traceparent_of(decode_span))
            if sent is None:
                stages = await _released(result)
                answered(503)
                message = f"no decode endpoint reachable of {len(self.pool.urls)}{stages}"
                return web.json_response(
                    error_body("decode", message, kind="unavailable"),
                    status=503,
                    headers={"Retry-After": "1"},
                )
            url, response = sent
            if decode_span is not None:
                decode_span.set_attribute("decode.endpoint", url)
            async with response:
                if response.status != 200:
                    try:
                        error = await response.json(content_type=None)
                    except (ValueError, aiohttp.ClientError):
                        error = None
                    stages = await _released(result)
                    code = response.status if 400 <= response.status < 500 else 502
                    answered(code)
                    return web.json_response(
                        error_body(
                            "decode",
                            decode_error_message(response.status, error) + stages,
                            kind="invalid_request_error" if code < 500 else "decode_error",
                        ),
                        status=code,
                    )
                if batch.stream:
                    return await self._stream(
                        request, url, response, result, batch, answered, chat, clock
                    )
                try:
                    answer = await response.json()
                except (TimeoutError, ValueError, aiohttp.ClientError) as exc:
                    stages = await _released(result)
                    answered(502)
                    message = f"decode endpoint {url} failed mid-answer: {exc!r}{stages}"
                    return web.json_response(
                        error_body("decode", message, kind="decode_error"), status=502
                    )
            answered(200)
            whole = completion_answer(
                answer, result, model=self.model_name, created=int(time.time())
            )
            usage = whole["usage"]
            assert isinstance(usage, dict)
            self._tokens_sent(first_tenant(batch), clock, int(usage["completion_tokens"]))
            return web.json_response(chat_answer(whole) if chat else whole)
        finally:
            if sent is not None:
                self.pool.end(sent[0])
            tracing.end_span(decode_span, **{"completion.tokens": clock.num_tokens})

    async def _stream(
        self,
        request: web.Request,
        url: str,
        response: aiohttp.ClientResponse,
        result: PrefillResult,
        batch: CompletionRequest,
        answered: Answered,
        chat: bool,
        clock: CompletionClock,
    ) -> web.StreamResponse:
        tenant = first_tenant(batch)
        out = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await out.prepare(request)
        created = int(time.time())
        count = 0
        sent_any = False
        usage: dict[str, object] | None = None
        try:
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if isinstance(chunk, dict) and (
                    chunk.get("error") or chunk.get("object") == "error"
                ):
                    raise _DecodeBroke(decode_error_message(200, chunk))
                previous = count
                token_chunk, usage_chunk, count = stream_chunk(
                    chunk, result, model=self.model_name, created=created, num_tokens_so_far=count
                )
                usage = usage_chunk or usage
                if token_chunk is not None:
                    if chat:
                        token_chunk = chat_chunk(token_chunk, first=not sent_any)
                    sent_any = True
                    await out.write(f"data: {json.dumps(token_chunk)}\n\n".encode())
                    self._tokens_sent(tenant, clock, count - previous)
            else:
                raise _DecodeBroke("the decode stream ended before [DONE]")
        except (ConnectionResetError, asyncio.CancelledError):
            # the client went away: closing the decode response aborts the request there
            response.close()
            await release_handoff(result.kv_transfer_params)
            answered(499)
            raise
        except (TimeoutError, _DecodeBroke, aiohttp.ClientError, ValueError) as exc:
            response.close()
            stages = await _released(result)
            answered(502)
            message = f"decode endpoint {url} broke off the stream after {count} tokens: " + (
                str(exc) if isinstance(exc, _DecodeBroke) else repr(exc)
            )
            message += stages
            event = error_body("decode", message, kind="decode_error")
            with contextlib.suppress(ConnectionResetError):
                await out.write(f"data: {json.dumps(event)}\n\n".encode())
                await out.write_eof()
            return out
        if batch.include_usage:
            usage = usage or {
                **completion_head(result.request_id, self.model_name, created),
                "choices": [],
                "usage": pd_usage(result, count),
            }
            if chat:
                usage = chat_chunk(usage, first=False)
            await out.write(f"data: {json.dumps(usage)}\n\n".encode())
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        answered(200)
        if self.metrics is not None and clock.tpot_s is not None:
            self.metrics.output_tokens_paced(tenant, clock.tpot_s)
        return out


def first_tenant(batch: CompletionRequest) -> str:
    """The tenant label of a whole completion (its one prompt's tenant)."""
    return batch.prompts[0].tenant


def _end(root: Span | None, status: int, clock: CompletionClock) -> None:
    """End the request's ``gateway.request`` span with the status answered (unanswered: 499
    when the client left, 500 when the gateway raised) and the tokens sent; a status other than
    200 marks it failed."""
    if root is None:
        return
    if status != 200:
        root.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
    tracing.end_span(root, **{"http.status_code": status, "completion.tokens": clock.num_tokens})


async def _released(result: PrefillResult) -> str:
    """Release ``result``'s handoff on every stage; "; " + the stages' view of it
    (``describe_release``: still held, or why not: lease ended, pull broken off, pulled), to
    append to the error that names the decode endpoint's failure; "" when none answered."""
    described = describe_release(await release_handoff_report(result.kv_transfer_params))
    return f"; {described}" if described else ""


class _DecodeBroke(Exception):
    """The decode endpoint's stream failed (an error event, or it ended early)."""
