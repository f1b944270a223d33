"""The gateway's HTTP server (aiohttp) and NATS request-reply API, and its process main.

| route                    | answer                                                          |
| ------------------------ | --------------------------------------------------------------- |
| ``POST /v1/prefill``     | ``PrefillResult`` JSON (first token, prompt/cached tokens, TTFT, per-stage timings) |
| ``POST /v1/completions`` | OpenAI text completion, prefill only (``max_tokens`` = 1)       |
| ``GET /healthz``         | 200 while the process and its NATS connection are up           |
| ``GET /readyz``          | 200 only when every stage of every replica is formed            |
| ``GET /metrics``         | Prometheus text, per-tenant counters and TTFT histogram, queue depth |

Errors are JSON ``{"error": {"field", "message", "limit"?}}``: 400 malformed or out of range,
403 unknown tenant, 404 wrong model, 422 text without a tokenizer, 429 over a tenant limit or
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
from wavepp.gateway.core import Gateway, GatewayConfig
from wavepp.gateway.tenants import LimitExceeded
from wavepp.gateway.validation import (
    BadRequest,
    ParsedRequest,
    parse_completion,
    parse_prefill,
)
from wavepp.runtime.transport.buskey import load_bus_key
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
        self.gateway = gateway
        self.tokenizer = tokenizer
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

    async def serve(self, parse: Callable[[], ParsedRequest]) -> tuple[int, object, dict]:
        """Run one request; returns (status, JSON body or PrefillResult, headers).

        ``parse`` validates the body and may raise BadRequest. Counts the request per tenant.
        """
        tenant = "unknown"
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
        tenant = tenant if tenant in self.gateway.tenants else "unknown"
        self.gateway.metrics.request_answered(tenant, status)
        return status, payload, headers

    async def _json_body(self, request: web.Request) -> object:
        try:
            return json.loads(await request.read())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise BadRequest("body", f"malformed JSON: {exc}") from exc

    async def handle_prefill(self, request: web.Request) -> web.Response:
        try:
            body = await self._json_body(request)
        except BadRequest as exc:
            self.gateway.metrics.request_answered("unknown", exc.status)
            return _error(exc, 400)
        limits = self.gateway.config.limits
        status, payload, headers = await self.serve(
            lambda: parse_prefill(body, limits, self._encode)
        )
        if isinstance(payload, PrefillResult):
            payload = payload.model_dump(mode="json", exclude={"mac"})
        return web.json_response(payload, status=status, headers=headers)

    async def handle_completions(self, request: web.Request) -> web.Response:
        try:
            body = await self._json_body(request)
        except BadRequest as exc:
            return _error(exc, 400)
        config = self.gateway.config
        tenant_header = request.headers.get("X-WavePP-Tenant")
        status, payload, headers = await self.serve(
            lambda: parse_completion(
                body,
                config.limits,
                self._encode,
                tenant_header=tenant_header,
                model_name=config.model_name,
            )
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
            "wavepp": payload.model_dump(mode="json", exclude={"mac"}),
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

        def parse() -> ParsedRequest:
            try:
                body = json.loads(msg.data)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise BadRequest("body", f"malformed JSON: {exc}") from exc
            return parse_prefill(body, limits, self._encode)

        status, payload, _ = await self.serve(parse)
        if isinstance(payload, PrefillResult):
            payload = payload.model_dump(mode="json", exclude={"mac"})
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
    bus_key = load_bus_key()
    nc = await connect(nats_url, name=f"{config.pool}-gateway-{os.getpid()}")
    gateway = Gateway(config, nc, bus_key=bus_key)
    runner = None
    try:
        await gateway.start()
        server = GatewayServer(gateway, tokenizer)
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
