"""The gateway's HTTP server (aiohttp) and NATS request-reply API, and its process main.

| route                    | answer                                                          |
| ------------------------ | --------------------------------------------------------------- |
| ``POST /v1/prefill``     | ``PrefillResult`` JSON (first token, prompt/cached tokens, TTFT, per-stage timings) |
| ``POST /v1/completions`` | OpenAI text completion: with decode endpoints (``decode_urls``) a whole one, prefilled here and decoded on vLLM (``decode_flow``); without, prefill only (``max_tokens`` = 1; a list of prompts); ``stream`` as SSE (``openai_api``) |
| ``POST /v1/chat/completions`` | with decode endpoints: the conversation through the checkpoint's chat template, decoded as above (422 without a template) |
| ``GET /v1/models``       | the served model, OpenAI's list shape                           |
| ``GET /healthz``         | 200 while the process and its NATS connection are up           |
| ``GET /readyz``          | 200 when at least one replica is in the pool (all stages formed) |
| ``GET /metrics``         | Prometheus text, per-tenant counters and TTFT histogram, queue depth |

API keys (``wavepp.gateway.auth``): when any tenant has a key file, every ``/v1/*`` request and
every NATS request needs ``Authorization: Bearer <key>`` (an HTTP header, or a NATS message
header) and is served as the key's tenant: no valid key is 401 (``WWW-Authenticate: Bearer``);
a ``tenant`` field or ``X-WavePP-Tenant`` header naming another tenant is 403; the OpenAI ``user``
field is then only the end user's id, not a tenant; a client past its budget of failures is
429. Without key files the gateway is open: the request names its tenant.

Every error is JSON ``{"error": {"type", "field", "param", "message", "limit"?}}`` and is
counted per tenant: 400 malformed or out of range, 401 no valid API key, 403 unknown tenant
(the configured tenants are never listed) or another tenant than the key's, 404 wrong model or
no such route, 405 wrong method, 413 body over ``errors.MAX_BODY_BYTES`` (``limit``), 422 text
without a tokenizer, 429 over a tenant limit, too many failed keys, or past the gateway's queue
limit (``field`` ``queue``, ``limit`` = ``max_queued_requests``; both with ``Retry-After``), 500
the pipeline failed the request, 503 intake unavailable (JetStream store full or disabled: at
once, never after accepting the request), no replica in the pool, or the replica failed it
for a transient cause (``PrefillResult.retryable``: a stage down or re-forming) (all three
with ``Retry-After``), 504 no answer in time. aiohttp's own
errors (413, 404, 405) are rewritten by ``errors.error_middleware``. The NATS API on
``wavepp.{ns}.{pool}.prefill`` (queue group ``gateway``) takes the ``/v1/prefill`` body and answers
``{"status": code, "body": ...}``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from aiohttp import web
from nats.aio.msg import Msg

from wavepp.api.prefill import PrefillResult
from wavepp.api.subjects import prefill_subject
from wavepp.gateway.auth import AuthError, authenticator_for
from wavepp.gateway.chat_template import load_chat_template
from wavepp.gateway.config import (
    INTAKE_RETRY_AFTER_S,
    REPLICA_RETRY_AFTER_S,
    GatewayConfig,
    IntakeUnavailable,
)
from wavepp.gateway.core import Gateway
from wavepp.gateway.decode import DecodePool
from wavepp.gateway.decode_flow import DecodeFlow
from wavepp.gateway.errors import MAX_BODY_BYTES, error_body, error_middleware, metrics_tenant
from wavepp.gateway.openai_api import completion_body, models_body, sse_events
from wavepp.gateway.tenants import LimitExceeded
from wavepp.gateway.validation import (
    BadRequest,
    ChatTemplate,
    CompletionRequest,
    ParsedRequest,
    parse_chat,
    parse_completion_batch,
    parse_prefill,
    tenant_hint,
)
from wavepp.runtime.transport.buskey import load_bus_key
from wavepp.runtime.transport.natsio import connect, flush_in_order
from wavepp.telemetry import tracing

log = logging.getLogger(__name__)

Tokenizer = tuple[Callable[[str], list[int]], Callable[[list[int]], str]]
# A tokenizer.json is read whole into memory: real ones are 2-20 MB; past this it is refused.
MAX_TOKENIZER_BYTES = 64 * 1024 * 1024


def load_tokenizer(path: str) -> Tokenizer:
    """(encode, decode) of a tokenizer on local disk; never downloads.

    ``path`` is a ``tokenizer.json`` file or a directory holding one (``tokenizers``), or a
    directory ``transformers.AutoTokenizer`` loads with ``local_files_only=True``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the tokenizer file is not a regular file (a FIFO, a device) or is larger
            than ``MAX_TOKENIZER_BYTES``.
    """
    target = Path(path)
    if not target.exists():
        raise FileNotFoundError(f"tokenizer path {path!r} does not exist")
    file = target / "tokenizer.json" if target.is_dir() else target
    if not target.is_dir() and not file.is_file():
        raise ValueError(f"tokenizer path {path!r} is not a regular file")
    if file.is_file():
        size = file.stat().st_size
        if size > MAX_TOKENIZER_BYTES:
            raise ValueError(
                f"tokenizer {str(file)!r}: {size} bytes, over the limit of "
                f"{MAX_TOKENIZER_BYTES} (MAX_TOKENIZER_BYTES)"
            )
        from tokenizers import Tokenizer as HFTokenizer

        tok = HFTokenizer.from_file(str(file))
        return (lambda text: tok.encode(text).ids), (lambda ids: tok.decode(ids))
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(str(target), local_files_only=True)
    return (lambda text: list(auto.encode(text))), (lambda ids: auto.decode(ids))


def _error(exc: BadRequest | LimitExceeded | Exception, status: int) -> web.Response:
    if isinstance(exc, BadRequest):
        return web.json_response(exc.to_json(), status=exc.status)
    if isinstance(exc, LimitExceeded):
        body = {
            "error": {
                "type": "rate_limit_error",
                "field": exc.field,
                "param": exc.field,
                "limit": exc.limit,
                "message": str(exc),
            }
        }
        retry = str(max(1, math.ceil(exc.retry_after_s)))
        return web.json_response(body, status=429, headers={"Retry-After": retry})
    return web.json_response(error_body("request", str(exc), kind="server_error"), status=status)


def _parse_json(data: bytes) -> object:
    """A request body's JSON (HTTP or NATS). Raises BadRequest (field ``body``) saying why it
    is malformed."""
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest("body", f"malformed JSON: {exc}") from exc
    except RecursionError as exc:  # e.g. 100,000 nested arrays
        raise BadRequest("body", "malformed JSON: nested too deeply") from exc
    except ValueError as exc:  # e.g. an integer of 5,000 digits (int max str digits)
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise BadRequest("body", f"malformed JSON: {first_line}") from exc


class GatewayServer:
    """The HTTP app and NATS API over a started :class:`Gateway`."""

    def __init__(
        self,
        gateway: Gateway,
        tokenizer: Tokenizer | None = None,
        chat_template: ChatTemplate | None = None,
    ) -> None:
        """Raises KeyFileError: a tenant's key file is missing or malformed."""
        self.gateway = gateway
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        config = gateway.config
        self.auth = authenticator_for(
            {t.name: t.api_keys_file for t in config.tenants if t.api_keys_file},
            poll_s=config.auth_poll_s,
            failure_burst=config.auth_failure_burst,
            failures_per_s=config.auth_failures_per_s,
            clock=gateway.clock,
            wall_clock=time.time,
        )
        self._tasks: set[asyncio.Task[None]] = set()
        self.started = int(time.time())
        self.decode = (
            DecodeFlow(
                DecodePool(config.decode_urls),
                model_name=config.model_name,
                chunk_timeout_s=config.decode_timeout_s,
                metrics=gateway.metrics,
            )
            if config.decode_urls
            else None
        )
        self.app = web.Application(
            client_max_size=MAX_BODY_BYTES,
            middlewares=[error_middleware(gateway.metrics, gateway.tenants)],
        )
        self.app.add_routes(
            [
                web.post("/v1/prefill", self.handle_prefill),
                web.post("/v1/completions", self.handle_completions),
                web.post("/v1/chat/completions", self.handle_chat),
                web.get("/v1/models", self.handle_models),
                web.get("/healthz", self.handle_healthz),
                web.get("/readyz", self.handle_readyz),
                web.get("/metrics", self.handle_metrics),
            ]
        )
        self.app.on_cleanup.append(self._close_decode)

    async def _close_decode(self, app: web.Application) -> None:
        if self.decode is not None:
            await self.decode.close()

    @property
    def _encode(self) -> Callable[[str], list[int]] | None:
        return self.tokenizer[0] if self.tokenizer else None

    async def serve(
        self, parse: Callable[[], ParsedRequest], tenant: object = "unknown"
    ) -> tuple[int, object, dict]:
        """Run one request; returns (status, JSON body or PrefillResult, headers).

        ``parse`` validates the body and may raise BadRequest. Counts the request per tenant
        (``tenant``: the key's or the named one, used when ``parse`` fails).
        """
        status, payload, headers = 500, {}, {}
        try:
            request = parse()
            tenant = request.tenant
            status, payload, headers = await self._prefill(request)
        except (BadRequest, LimitExceeded) as exc:
            status, payload, headers = self._refusal(exc)
        label = metrics_tenant(tenant if isinstance(tenant, str) else None, self.gateway.tenants)
        self.gateway.metrics.request_answered(label, status)
        return status, payload, headers

    def _refusal(self, exc: BadRequest | LimitExceeded) -> tuple[int, object, dict]:
        response = _error(exc, 400)
        headers = {k: v for k, v in response.headers.items() if k == "Retry-After"}
        return response.status, json.loads(response.body), headers

    async def _prefill(self, request: ParsedRequest) -> tuple[int, object, dict]:
        """One validated request through the gateway: (status, PrefillResult or error, headers)."""
        try:
            result, is_duplicate = await self.gateway.prefill(request)
        except (BadRequest, LimitExceeded) as exc:
            return self._refusal(exc)
        except IntakeUnavailable as exc:
            log.warning("prefill refused: %s", exc)
            retry = {"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))}
            return 503, error_body("intake", str(exc), kind="unavailable"), retry
        except TimeoutError as exc:
            return 504, error_body("request", str(exc) or "no answer in time", kind="timeout"), {}
        except Exception as exc:  # noqa: BLE001 - intake (JetStream) unavailable
            log.exception("prefill failed")
            retry = {"Retry-After": str(max(1, math.ceil(INTAKE_RETRY_AFTER_S)))}
            return 503, error_body("intake", str(exc), kind="unavailable"), retry
        if result.error and result.retryable:
            retry = {"Retry-After": str(max(1, math.ceil(REPLICA_RETRY_AFTER_S)))}
            return 503, error_body("request", result.error, kind="unavailable"), retry
        if result.error:
            return 500, error_body("request", result.error, kind="server_error"), {}
        return 200, result, ({"X-WavePP-Duplicate": "true"} if is_duplicate else {})

    def authenticate(self, authorization: str | None, client: str) -> str | None:
        """The key's tenant; None in open mode. Raises AuthError (counted in the metrics)."""
        try:
            return self.auth.authenticate(authorization, client)
        except AuthError as exc:
            self.gateway.metrics.auth_failed(exc.reason)
            self.gateway.metrics.request_answered("unknown", exc.status)
            raise

    def bind_tenant(self, key_tenant: str, claimed: object) -> None:
        """Refuse a request naming another tenant than its key's. Raises AuthError (counted)."""
        try:
            self.auth.check_claim(key_tenant, claimed)
        except AuthError as exc:
            self.gateway.metrics.auth_failed(exc.reason)
            self.gateway.metrics.request_answered(key_tenant, exc.status)
            raise

    @staticmethod
    def _auth_error(exc: AuthError) -> web.Response:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else {}
        if exc.status == 429:
            headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
        return web.json_response(exc.to_json(), status=exc.status, headers=headers)

    async def handle_prefill(self, request: web.Request) -> web.Response:
        try:
            key_tenant = self.authenticate(
                request.headers.get("Authorization"), request.remote or ""
            )
        except AuthError as exc:
            return self._auth_error(exc)
        try:
            body = _parse_json(await request.read())
        except BadRequest as exc:
            self.gateway.metrics.request_answered(key_tenant or "unknown", exc.status)
            return _error(exc, 400)
        claimed = body.get("tenant") if isinstance(body, dict) else None
        if key_tenant is not None and isinstance(body, dict):
            try:
                self.bind_tenant(key_tenant, claimed)
                # the header names a tenant too (as on /v1/completions): another one is 403
                self.bind_tenant(key_tenant, request.headers.get("X-WavePP-Tenant"))
            except AuthError as exc:
                return self._auth_error(exc)
            body = {**body, "tenant": key_tenant}
        limits = self.gateway.config.limits
        status, payload, headers = await self.serve(
            lambda: parse_prefill(body, limits, self._encode), key_tenant or claimed
        )
        if isinstance(payload, PrefillResult):
            payload = payload.model_dump(mode="json", exclude={"mac"})
        return web.json_response(payload, status=status, headers=headers)

    async def handle_models(self, request: web.Request) -> web.Response:
        try:
            self.authenticate(request.headers.get("Authorization"), request.remote or "")
        except AuthError as exc:
            return self._auth_error(exc)
        return web.json_response(models_body(self.gateway.config.model_name, self.started))

    async def _openai_body(
        self, request: web.Request
    ) -> tuple[str | None, str | None, object] | web.Response:
        """The OpenAI routes' common start: the API key's tenant (None: open mode), the tenant
        header (the key's tenant when there is a key) and the JSON body; or the error answer."""
        try:
            key_tenant = self.authenticate(
                request.headers.get("Authorization"), request.remote or ""
            )
        except AuthError as exc:
            return self._auth_error(exc)
        tenant_header = request.headers.get("X-WavePP-Tenant")
        try:
            body = _parse_json(await request.read())
        except BadRequest as exc:
            label = key_tenant or metrics_tenant(tenant_header, self.gateway.tenants)
            self.gateway.metrics.request_answered(label, exc.status)
            return _error(exc, 400)
        if key_tenant is not None:
            try:
                self.bind_tenant(key_tenant, tenant_header)
            except AuthError as exc:
                return self._auth_error(exc)
            tenant_header = key_tenant  # the key's tenant; `user` is the end user's id then
        return key_tenant, tenant_header, body

    async def _decode(
        self, request: web.Request, batch: CompletionRequest, *, chat: bool
    ) -> web.StreamResponse:
        """A whole completion: prefill here, decode on a decode endpoint (``decode_flow``)."""
        assert self.decode is not None  # sampling is set only with decode endpoints
        first = batch.prompts[0]
        return await self.decode.complete(
            request,
            batch,
            prefill=lambda: self._prefill(first),
            cache_salt=self.gateway.tenants[first.tenant].cache_salt,
            answered=lambda status: self.gateway.metrics.request_answered(first.tenant, status),
            chat=chat,
        )

    async def handle_chat(self, request: web.Request) -> web.StreamResponse:
        """OpenAI ``/v1/chat/completions``: the conversation through the checkpoint's chat
        template, then a whole completion as on ``/v1/completions`` (decode endpoints
        needed; ``validation.parse_chat``)."""
        start = await self._openai_body(request)
        if isinstance(start, web.Response):
            return start
        _key_tenant, tenant_header, body = start
        config = self.gateway.config
        try:
            batch = parse_chat(
                body,
                config.limits,
                self.chat_template,
                tenant_header=tenant_header,
                model_name=config.model_name,
            )
        except BadRequest as exc:
            hint = tenant_hint(body, tenant_header, completion=True)
            self.gateway.metrics.request_answered(
                metrics_tenant(hint, self.gateway.tenants), exc.status
            )
            return _error(exc, 400)
        return await self._decode(request, batch, chat=True)

    async def handle_completions(self, request: web.Request) -> web.StreamResponse:
        """OpenAI ``/v1/completions``: with decode endpoints one prompt decoded whole
        (``decode_flow``); without, every prompt of the body prefilled (concurrently), one
        choice each; the first refused prompt's error answers the whole request."""
        metrics = self.gateway.metrics
        start = await self._openai_body(request)
        if isinstance(start, web.Response):
            return start
        _key_tenant, tenant_header, body = start
        config = self.gateway.config
        hint = tenant_hint(body, tenant_header, completion=True)
        try:
            batch: CompletionRequest = parse_completion_batch(
                body,
                config.limits,
                self._encode,
                tenant_header=tenant_header,
                model_name=config.model_name,
            )
        except BadRequest as exc:
            metrics.request_answered(metrics_tenant(hint, self.gateway.tenants), exc.status)
            return _error(exc, 400)
        if batch.sampling is not None:
            return await self._decode(request, batch, chat=False)
        admitted_s = time.monotonic()
        answers = await asyncio.gather(*(self._prefill(p) for p in batch.prompts))
        for status, _payload, _headers in answers:
            metrics.request_answered(batch.prompts[0].tenant, status)
        failed = next((a for a in answers if a[0] != 200), None)
        if failed is not None:
            return web.json_response(failed[1], status=failed[0], headers=failed[2])
        results = [payload for _status, payload, _headers in answers]
        assert all(isinstance(r, PrefillResult) for r in results)
        decode = self.tokenizer[1] if self.tokenizer is not None else None
        created = int(time.time())
        # every prompt's one token goes out in this answer: the completion's first token
        metrics.first_token_sent(batch.prompts[0].tenant, time.monotonic() - admitted_s)
        if batch.stream:
            events = sse_events(
                results, config.model_name, created, decode, include_usage=batch.include_usage
            )
            return web.Response(
                body=events,
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"},
            )
        return web.json_response(completion_body(results, config.model_name, created, decode))

    async def handle_healthz(self, request: web.Request) -> web.Response:
        ok = self.gateway.nc.is_connected
        return web.json_response({"ok": ok}, status=200 if ok else 503)

    async def handle_readyz(self, request: web.Request) -> web.Response:
        now = self.gateway.clock()
        replicas = {
            r.name: {
                "in_pool": self.gateway.router.in_pool(r.name, now),
                "ready": r.is_ready,
                "draining": self.gateway.router.is_finishing(r.name, now),
            }
            for r in self.gateway.router.replicas
        }
        ready = self.gateway.is_ready()
        return web.json_response(
            {"ready": ready, "replicas": replicas}, status=200 if ready else 503
        )

    async def handle_metrics(self, request: web.Request) -> web.Response:
        body, content_type = self.gateway.metrics.scrape()
        return web.Response(body=body, headers={"Content-Type": content_type})

    # ---- NATS API ------------------------------------------------------------------------

    async def subscribe_nats(self) -> None:
        await self.gateway.nc.subscribe(
            prefill_subject(self.gateway.config.pool, namespace=self.gateway.config.namespace),
            queue="gateway",
            cb=self._on_nats,
        )
        await flush_in_order(self.gateway.nc)  # live on the server before "gateway serving"

    async def _on_nats(self, msg: Msg) -> None:
        task = asyncio.create_task(self._serve_nats(msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve_nats(self, msg: Msg) -> None:
        limits = self.gateway.config.limits
        # A NATS client is known by its reply inbox (one per connection): _INBOX.<id>.<n>
        client = "nats:" + ".".join((msg.reply or "").split(".")[:2])
        try:
            key_tenant = self.authenticate((msg.headers or {}).get("Authorization"), client)
        except AuthError as exc:
            await msg.respond(json.dumps({"status": exc.status, "body": exc.to_json()}).encode())
            return

        body: object = None
        malformed: BadRequest | None = None
        try:
            body = _parse_json(msg.data)
        except BadRequest as exc:
            malformed = exc
        if key_tenant is not None and isinstance(body, dict):
            try:
                self.bind_tenant(key_tenant, body.get("tenant"))
            except AuthError as exc:
                await msg.respond(
                    json.dumps({"status": exc.status, "body": exc.to_json()}).encode()
                )
                return
            body = {**body, "tenant": key_tenant}

        def parse() -> ParsedRequest:
            if malformed is not None:
                raise malformed
            return parse_prefill(body, limits, self._encode)

        claimed = body.get("tenant") if isinstance(body, dict) else None
        status, payload, _ = await self.serve(parse, key_tenant or claimed)
        if isinstance(payload, PrefillResult):
            payload = payload.model_dump(mode="json", exclude={"mac"})
        await msg.respond(json.dumps({"status": status, "body": payload}).encode())


async def run_gateway(
    config: GatewayConfig,
    nats_url: str,
    host: str,
    port: int,
    stop: asyncio.Event | None = None,
    tokenizer: Tokenizer | None = None,
) -> None:
    """Process main of ``wavepp gateway``: serve until SIGTERM/SIGINT, then drain.
    ``tokenizer``: already loaded (``load_tokenizer``), else loaded from ``config.tokenizer``."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if tokenizer is None and config.tokenizer:
        tokenizer = load_tokenizer(config.tokenizer)
    chat_template = load_chat_template(config.tokenizer) if config.tokenizer else None
    bus_key = load_bus_key()
    nc = await connect(nats_url, name=f"{config.pool}-gateway-{os.getpid()}")
    gateway = Gateway(config, nc, bus_key=bus_key)
    runner = None
    tracing.setup(config.telemetry, "wavepp-gateway")
    try:
        server = GatewayServer(gateway, tokenizer, chat_template)
        if server.auth.enabled:
            keyless = sorted(t.name for t in config.tenants if not t.api_keys_file)
            log.info(
                "authentication on: API keys of %d tenant(s)%s",
                len(config.tenants) - len(keyless),
                f"; tenants without keys cannot be reached: {keyless}" if keyless else "",
            )
        else:
            log.warning(
                "authentication off (open local mode): no tenant has API keys; any caller may "
                "name any tenant"
            )
        await gateway.start()
        await server.subscribe_nats()
        runner = web.AppRunner(server.app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        log.info("gateway serving http://%s:%d", host, port)
        await stop.wait()
    finally:
        if runner is not None:
            await runner.cleanup()
        await gateway.stop()
        await nc.drain()
        tracing.shutdown()
