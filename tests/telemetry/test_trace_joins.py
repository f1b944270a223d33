"""The places a request's trace crosses a process boundary below the gateway join it: the
admission's ``request`` span is a child of the traceparent the intake carried, and a stage's
handoff server records the decode engine's KV pull as ``handoff.pull`` under the traceparent
the pull asked with (a real ``HandoffServer`` over a real socket, pulled by the connector's own
``pull_request``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from wavepp.api.kv_handoff import HandoffParams, StageEndpoint
from wavepp.api.signing import BusKey
from wavepp.integrations.vllm.pull import pull_request
from wavepp.runtime.kv import BlockPool
from wavepp.runtime.kv.handoff import HandoffLeases
from wavepp.runtime.serving.handoff import handoff_token
from wavepp.runtime.stage.handoff_server import HandoffServer
from wavepp.telemetry import tracing
from wavepp.telemetry.pipeline import PipelineTelemetry
from wavepp.telemetry.settings import TelemetrySettings
from wavepp.telemetry.spans import SpanRecord

pytestmark = pytest.mark.timeout(60)

PARENT = "00-" + "12" * 16 + "-" + "34" * 8 + "-01"  # the gateway's span, as a W3C traceparent


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    memory = InMemorySpanExporter()
    tracing.setup(TelemetrySettings(), "wavepp-test", span_exporter=memory)
    try:
        yield memory
    finally:
        tracing.shutdown()


def _records(memory: InMemorySpanExporter) -> list[SpanRecord]:
    return [SpanRecord.from_span(s) for s in memory.get_finished_spans()]


def test_the_admissions_request_span_joins_the_gateways_trace(
    spans: InMemorySpanExporter,
) -> None:
    stats = SimpleNamespace(spans=[], wave_fill=lambda n: 0.0, busy_s_by_stage=lambda n: [0.0] * n)
    telemetry = PipelineTelemetry("p-r0", 2, stats, dict)
    telemetry.request_arrived("joined", time.time(), 8, "acme", traceparent=PARENT)
    telemetry.request_arrived("alone", time.time(), 8, "acme")
    telemetry.request_arrived("malformed", time.time(), 8, "acme", traceparent="00-zz")
    for request_id in ("joined", "alone", "malformed"):
        telemetry.completed(request_id, ttft_s=0.1, finished_s=time.time(), error="")
    by_id = {r.attributes["request.id"]: r for r in _records(spans) if r.name == "request"}
    assert (by_id["joined"].trace_id, by_id["joined"].parent_span_id) == ("12" * 16, "34" * 8)
    assert by_id["alone"].is_root and by_id["alone"].trace_id != "12" * 16
    assert by_id["malformed"].is_root  # a bad traceparent starts a trace of its own


async def test_a_traced_pull_is_a_handoff_pull_span_under_the_decode_span(
    spans: InMemorySpanExporter,
) -> None:
    block, heads, dim, layers = 4, 2, 8, 2
    pool = BlockPool(8, block)
    caches = [torch.randn(2, 8 * block, heads, dim) for _ in range(layers)]
    key = BusKey.generate().for_replica("p")
    server = HandoffServer(
        HandoffLeases(pool),
        lambda: caches,
        first_layer=0,
        last_layer=layers,
        block_size=block,
        key=key,
    )
    await server.start("127.0.0.1", 0)
    try:
        expires = round(time.time() + 60, 3)  # as the wire writes it
        for request_id in ("traced", "untraced"):
            blocks = pool.allocate(2)
            assert blocks is not None
            server.leases.hold(request_id, tuple(blocks), 6, expires=expires)
            pool.free(blocks)
            params = HandoffParams(
                request_id=request_id,
                num_tokens=6,
                expires=expires,
                token=handoff_token(key, request_id, expires),
                stages=(StageEndpoint(server.addr, 0, layers),),
                traceparent=PARENT if request_id == "traced" else "",
            )
            assert HandoffParams.from_json(params.to_json()) == params  # the wire keeps it
            pulled = await asyncio.to_thread(pull_request, params)
            assert pulled.num_bytes == layers * 2 * 6 * heads * dim * 4
    finally:
        await server.stop()
    [pull] = [r for r in _records(spans) if r.name == "handoff.pull"]  # the traced one only
    assert (pull.trace_id, pull.parent_span_id) == ("12" * 16, "34" * 8)
    assert pull.attributes["request.id"] == "traced"
    assert pull.attributes["handoff.bytes"] == layers * 2 * 6 * heads * dim * 4
    assert pull.end_ns >= pull.start_ns and "handoff.error" not in pull.attributes
