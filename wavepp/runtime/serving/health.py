"""The health endpoints of a pipeline process (``wavepp stage``, ``wavepp admission``): an aiohttp
server on the process's own event loop answering each path by a cheap predicate."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aiohttp import web


async def start_health_server(
    host: str, port: int, checks: dict[str, Callable[[], bool]]
) -> tuple[web.AppRunner, int]:
    """Serve ``GET path`` -> 200 ``ok`` when ``checks[path]()`` is true, else 503.

    Runs on the caller's event loop; the checks must be cheap and never block.

    Args:
        host: bind address.
        port: TCP port (0: any free port).
        checks: path (e.g. ``/readyz``) -> predicate.

    Returns:
        ``(runner, bound port)``; ``await runner.cleanup()`` stops it.
    """
    from aiohttp import web

    def handler(check: Callable[[], bool]) -> Callable[[web.Request], object]:
        async def answer(_request: web.Request) -> web.Response:
            is_ok = check()
            return web.Response(text="ok" if is_ok else "not ready", status=200 if is_ok else 503)

        return answer

    app = web.Application()
    for path, check in checks.items():
        app.router.add_get(path, handler(check))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    server = site._server  # NOTE: aiohttp exposes the bound port only through the server
    bound = port
    if server is not None and getattr(server, "sockets", None):
        bound = int(server.sockets[0].getsockname()[1])
    return runner, bound
