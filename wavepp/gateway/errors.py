"""Every HTTP error of the gateway in the documented JSON shape, counted per tenant.

Handlers answer their own errors (``validation.BadRequest.to_json``); what aiohttp raises
before or around a handler (413 body too large, 404 no such route, 405 wrong method, ...) is
turned by :func:`error_middleware` into the same shape::

    {"error": {"type": "invalid_request_error", "field": "body", "param": "body",
               "message": "...", "limit": 16777216}}

and counted in ``wavepp_gateway_requests_total`` under the tenant the ``X-WavePP-Tenant``
header names when it is a configured tenant, else ``unknown``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Container

from aiohttp import web

from wavepp.gateway.metrics import GatewayMetrics

MAX_BODY_BYTES = 16 * 1024 * 1024
"""Largest request body the gateway reads (413 past it)."""

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_body(
    field: str, message: str, *, limit: object = None, kind: str = "invalid_request_error"
) -> dict[str, object]:
    """``{"error": {...}}`` as every gateway error is written."""
    error: dict[str, object] = {"type": kind, "field": field, "param": field, "message": message}
    if limit is not None:
        error["limit"] = limit
    return {"error": error}


def metrics_tenant(name: str | None, tenants: Container[str]) -> str:
    """The tenant label of a request: ``name`` when it is configured, else ``unknown`` (so a
    caller cannot mint label values)."""
    return name if name and name in tenants else "unknown"


def _body_for(exc: web.HTTPException, request: web.Request) -> dict[str, object]:
    if exc.status == 413:
        return error_body(
            "body",
            f"request body is larger than {MAX_BODY_BYTES} bytes",
            limit=MAX_BODY_BYTES,
        )
    if exc.status == 404:
        return error_body("path", f"no route {request.path!r:.80}")
    if exc.status == 405:
        allowed = sorted(getattr(exc, "allowed_methods", ()) or ())
        return error_body("method", f"{request.method} is not allowed here; use {allowed}")
    return error_body("request", exc.reason or "error")


def error_middleware(
    metrics: GatewayMetrics, tenants: Container[str]
) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """An aiohttp middleware writing aiohttp's own 4xx/5xx as JSON and counting them."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            tenant = metrics_tenant(request.headers.get("X-WavePP-Tenant"), tenants)
            metrics.request_answered(tenant, exc.status)
            headers = {k: v for k, v in exc.headers.items() if k in ("Allow", "Retry-After")}
            return web.json_response(_body_for(exc, request), status=exc.status, headers=headers)

    return middleware
