"""``flush_in_order``: a flush that proves what was published and subscribed before it reached
the server. nats-py's own ``flush`` writes its PING ahead of the commands still in its pending
buffer, so its PONG proves nothing about them (a forger that "answered first" could still see
the stage's reply arrive before its forgeries)."""

from __future__ import annotations

from wavepp.runtime.transport.natsio import EmbeddedNatsServer, connect, flush_in_order


async def _wire_order(nats_server: EmbeddedNatsServer, flush) -> list[bytes]:  # noqa: ANN001
    """The commands ``publish``, ``subscribe``, then ``flush(nc)`` put on the socket, in order
    (the first 4 bytes of each)."""
    nc = await connect(nats_server.url, name="wire-order", anonymous_ok=True)
    try:
        transport = nc._transport  # the client's socket writer: spied, not replaced
        order: list[bytes] = []
        write, writelines = transport.write, transport.writelines

        def spy_write(data: bytes) -> None:
            order.append(bytes(data)[:4])
            write(data)

        def spy_writelines(lines: list[bytes]) -> None:
            order.extend(bytes(line)[:4] for line in lines)
            writelines(lines)

        transport.write, transport.writelines = spy_write, spy_writelines

        async def on_msg(msg) -> None:  # noqa: ANN001
            pass

        await nc.publish("wire.order", b"x")
        await nc.subscribe("wire.order.sub", cb=on_msg)
        await flush(nc)
        transport.write, transport.writelines = write, writelines
        return order
    finally:
        await nc.close()


async def test_nats_py_flush_pings_ahead_of_pending_commands(
    nats_server: EmbeddedNatsServer,
) -> None:
    """The premise: one ``flush`` sends PING before the PUB and SUB it was meant to cover. If
    a nats-py release fixes this, this test says so (and ``flush_in_order`` may become one
    flush)."""

    async def plain(nc) -> None:  # noqa: ANN001
        await nc.flush()

    order = await _wire_order(nats_server, plain)
    assert order.index(b"PING") < order.index(b"PUB ") < order.index(b"SUB ")


async def test_flush_in_order_pings_after_every_pending_command(
    nats_server: EmbeddedNatsServer,
) -> None:
    order = await _wire_order(nats_server, flush_in_order)
    last_ping = len(order) - 1 - order[::-1].index(b"PING")
    assert order.index(b"PUB ") < last_ping and order.index(b"SUB ") < last_ping
