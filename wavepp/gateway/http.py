"""The gateway's HTTP server (aiohttp) and NATS request-reply API, and its process main.

| route                    | answer                                                          |
| ------------------------ | --------------------------------------------------------------- |
| ``POST /v1/prefill``     | ``PrefillResult`` JSON (first token, prompt/cached tokens, TTFT, per-stage timings) |
| ``POST /v1/completions`` | OpenAI text completion, prefill only (``max_tokens`` = 1)       |
| ``GET /healthz``         | 200 while the process and its NATS connection are up           |
| ``GET /readyz``          | 200 only when every stage of every replica is formed            |
| ``GET /metrics``         | Prometheus text, per-tenant counters and TTFT histogram, queue depth |

API keys (``wavepp.gateway.auth``): when any tenant has a key file, every ``/v1/*`` request and
every NATS request needs ``Authorization: Bearer <key>`` (an HTTP header, or a NATS message
header) and is served as the key's tenant: no valid key is 401 (``WWW-Authenticate: Bearer``);
a ``tenant`` field or ``X-WavePP-Tenant`` header naming another tenant is 403; the OpenAI ``user``
field is then only the end user's id, not a tenant; a client past its budget of failures is
429. Without key files the gateway is open: the request names its tenant.

Errors are JSON ``{"error": {"field", "message", "limit"?}}``: 400 malformed or out of range,
401 no valid API key, 403 unknown tenant or another tenant than the key's, 404 wrong model,
422 text without a tokenizer, 429 over a tenant limit, too many failed keys, or
past the gateway's queue limit (``field`` ``queue``, ``limit`` = ``max_queued_requests``; both
with ``Retry-After``), 503 intake unavailable, 504 no answer in time. The NATS API on
``wavepp.{pool}.prefill`` (queue group ``gateway``) takes the ``/v1/prefill`` body and answers
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
from wavepp.gateway.core import Gateway, GatewayConfig
from wavepp.gateway.tenants import LimitExceeded
from wavepp.gateway.validation import (
    BadRequest,
    ParsedRequest,
    parse_completion,
    parse_prefill,
)
from wavepp.runtime.transport.natsio import connect

log = logging.getLogger(__name__)

Tokenizer = tuple[Callable[[str], list[int]], Callable[[list[int]], str]]


def load_tokenizer(path: str) -> Tokenizer:
    """(encode, decode) of a tokenizer on local disk; never downloads.

    ``path`` is a ``tokenizer.json`` file or a directory holding one (``tokenizers``), or a
    directory ``transformers.AutoTokenizer`` loads with ``local_files_only=True``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
    """
    target = Path(path)
    if not target.exists():
        raise FileNotFoundError(f"tokenizer path {path!r} does not exist")
    file = target / "tokenizer.json" if target.is_dir() else target
    if file.is_file():
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
    return web.json_response(
        {"error": {"type": "server_error", "message": str(exc)}}, status=status
    )


class GatewayServer:
    """The HTTP app and NATS API over a started :class:`Gateway`."""

    def __init__(self, gateway: Gateway, tokenizer: Tokenizer | None = None) -> None:
        """Raises KeyFileError: a tenant's key file is missing or malformed."""
        self.gateway = gateway
        self.tokenizer = tokenizer
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
        self.app = web.Application(client_max_size=16 * 1024 * 1024)
        self.app.add_routes(
            [
                web.post("/v1/prefill", self.handle_prefill),
                web.post("/v1/completions", self.handle_completions),
                web.get("/healthz", self.handle_healthz),
                web.get("/readyz", self.handle_readyz),
                web.get("/metrics", self.handle_metrics),
            ]
        )

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
            result, is_duplicate = await self.gateway.prefill(request)
            headers = {"X-WavePP-Duplicate": "true"} if is_duplicate else {}
            status, payload = (500 if result.error else 200), result
        except (BadRequest, LimitExceeded) as exc:
            response = _error(exc, 400)
            status, payload = response.status, json.loads(response.body)
            headers = {k: v for k, v in response.headers.items() if k == "Retry-After"}
        except TimeoutError as exc:
            status, payload = 504, {"error": {"type": "timeout", "message": str(exc)}}
        except Exception as exc:  # noqa: BLE001 - intake (JetStream) unavailable
            log.exception("prefill failed")
            status, payload = 503, {"error": {"type": "unavailable", "message": str(exc)}}
        tenant = tenant if isinstance(tenant, str) and tenant in self.gateway.tenants else "unknown"
        self.gateway.metrics.request_answered(tenant, status)
        return status, payload, headers

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

    async def _json_body(self, request: web.Request) -> object:
        try:
            return json.loads(await request.read())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise BadRequest("body", f"malformed JSON: {exc}") from exc

    async def handle_prefill(self, request: web.Request) -> web.Response:
        try:
            key_tenant = self.authenticate(
                request.headers.get("Authorization"), request.remote or ""
            )
        except AuthError as exc:
            return self._auth_error(exc)
        try:
            body = await self._json_body(request)
        except BadRequest as exc:
            self.gateway.metrics.request_answered(key_tenant or "unknown", exc.status)
            return _error(exc, 400)
        claimed = body.get("tenant") if isinstance(body, dict) else None
        if key_tenant is not None and isinstance(body, dict):
            try:
                self.bind_tenant(key_tenant, claimed)
            except AuthError as exc:
                return self._auth_error(exc)
            body = {**body, "tenant": key_tenant}
        limits = self.gateway.config.limits
        status, payload, headers = await self.serve(
            lambda: parse_prefill(body, limits, self._encode), key_tenant or claimed
        )
        if isinstance(payload, PrefillResult):
            payload = payload.model_dump(mode="json")
        return web.json_response(payload, status=status, headers=headers)

    async def handle_completions(self, request: web.Request) -> web.Response:
        try:
            key_tenant = self.authenticate(
                request.headers.get("Authorization"), request.remote or ""
            )
        except AuthError as exc:
            return self._auth_error(exc)
        try:
            body = await self._json_body(request)
        except BadRequest as exc:
            self.gateway.metrics.request_answered(key_tenant or "unknown", exc.status)
            return _error(exc, 400)
        config = self.gateway.config
        tenant_header = request.headers.get("X-WavePP-Tenant")
        if key_tenant is not None:
            try:
                self.bind_tenant(key_tenant, tenant_header)
            except AuthError as exc:
                return self._auth_error(exc)
            tenant_header = key_tenant  # the key's tenant; `user` is the end user's id then
        hint = tenant_header or (body.get("user") if isinstance(body, dict) else None)
        status, payload, headers = await self.serve(
            lambda: parse_completion(
                body,
                config.limits,
                self._encode,
                tenant_header=tenant_header,
                model_name=config.model_name,
            ),
            hint or "default",
        )
        if not isinstance(payload, PrefillResult):
            return web.json_response(payload, status=status, headers=headers)
        text = ""
        if self.tokenizer is not None and payload.first_token_id is not None:
            text = self.tokenizer[1]([payload.first_token_id])
        body_out = {
            "id": f"cmpl-{payload.request_id}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": config.model_name,
            "choices": [
                {
                    "index": 0,
                    "text": text,
                    "token_ids": [payload.first_token_id],
                    "logprobs": None,
                    "finish_reason": "length",
                }
            ],
            "usage": {
                "prompt_tokens": payload.num_prompt_tokens,
                "completion_tokens": 1,
                "total_tokens": payload.num_prompt_tokens + 1,
                "prompt_tokens_details": {"cached_tokens": payload.num_cached_tokens},
            },
            "wavepp": payload.model_dump(mode="json"),
        }
        return web.json_response(body_out, status=status, headers=headers)

    async def handle_healthz(self, request: web.Request) -> web.Response:
        ok = self.gateway.nc.is_connected
        return web.json_response({"ok": ok}, status=200 if ok else 503)

    async def handle_readyz(self, request: web.Request) -> web.Response:
        now = self.gateway.clock()
        replicas = {
            r.name: {"in_pool": self.gateway.router.is_alive(r.name, now), "ready": r.is_ready}
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
            prefill_subject(self.gateway.config.pool), queue="gateway", cb=self._on_nats
        )

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
            body = json.loads(msg.data)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            malformed = BadRequest("body", f"malformed JSON: {exc}")
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
            payload = payload.model_dump(mode="json")
        await msg.respond(json.dumps({"status": status, "body": payload}).encode())


async def run_gateway(
    config: GatewayConfig, nats_url: str, host: str, port: int, stop: asyncio.Event | None = None
) -> None:
    """Process main of ``wavepp gateway``: serve until SIGTERM/SIGINT, then drain."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tokenizer = load_tokenizer(config.tokenizer) if config.tokenizer else None
    nc = await connect(nats_url, name=f"{config.pool}-gateway-{os.getpid()}")
    gateway = Gateway(config, nc)
    runner = None
    try:
        server = GatewayServer(gateway, tokenizer)
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
