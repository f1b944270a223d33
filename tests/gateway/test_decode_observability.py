"""Whole completions are observable: one trace from the gateway into the decode request, and the
completion TTFT / time-per-output-token histograms per tenant.

The decode endpoint here is a **recorder**: an aiohttp server that records the headers and body
of each decode request and answers a fixed completion in vLLM's JSON or SSE shape, with the
token timing the test sets. It stands for nothing of vLLM's behaviour beyond that wire shape
(the real vLLM path is tests/up/test_up_pd.py). The gateway's prefill is a callable returning a
``PrefillResult`` (the admission is exercised in ``test_intake_carries_the_prefill_span``).
Tracing records into an in-memory exporter; metrics are read from the gateway's own
Prometheus text."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from gateway_support import tiny_gateway_config
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from wavepp.api.kv_handoff import PARAMS_KEY
from wavepp.api.prefill import Heartbeat, IntakeRequest, PrefillResult
from wavepp.api.subjects import heartbeat_subject, intake_subject
from wavepp.gateway.core import Gateway
from wavepp.gateway.decode import CompletionClock, DecodePool
from wavepp.gateway.decode_flow import DecodeFlow
from wavepp.gateway.metrics import GatewayLoad, GatewayMetrics
from wavepp.gateway.validation import CompletionRequest, ParsedRequest, Sampling
from wavepp.runtime.transport.natsio import EmbeddedNatsServer, connect, flush_in_order, free_port
from wavepp.telemetry import tracing
from wavepp.telemetry.settings import TelemetrySettings
from wavepp.telemetry.spans import SpanRecord

pytestmark = pytest.mark.timeout(60)

TOKEN_GAP_S = 0.05  # the recorder's pause between streamed tokens


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    memory = InMemorySpanExporter()
    tracing.setup(TelemetrySettings(), "wavepp-gateway", span_exporter=memory)
    try:
        yield memory
    finally:
        tracing.shutdown()


def _records(memory: InMemorySpanExporter) -> dict[str, SpanRecord]:
    return {s.name: SpanRecord.from_span(s) for s in memory.get_finished_spans()}


class Recorder:
    """The decode endpoint: records each request, answers ``tokens`` (JSON or SSE, as the body
    asks), or 400, or breaks the stream off after the first token (``behaviour``)."""

    def __init__(self, tokens: list[int], behaviour: str = "ok") -> None:
        self.tokens = tokens
        self.behaviour = behaviour
        self.requests: list[tuple[dict[str, str], dict[str, Any]]] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.add_routes(
            [web.get("/v1/models", self._models), web.post("/v1/completions", self._complete)]
        )
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "tiny"}]})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append((dict(request.headers), body))
        if self.behaviour == "error":
            return web.json_response({"error": {"message": "refused"}}, status=400)
        if not body["stream"]:
            choice = {"index": 0, "text": "x" * len(self.tokens), "token_ids": self.tokens,
                      "finish_reason": "length"}  # fmt: skip
            usage = {"completion_tokens": len(self.tokens)}
            return web.json_response({"choices": [choice], "usage": usage})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i, token in enumerate(self.tokens):
            if i:
                await asyncio.sleep(TOKEN_GAP_S)
            chunk = {"choices": [{"index": 0, "text": "x", "token_ids": [token]}]}
            await out.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if self.behaviour == "break":
                assert request.transport is not None
                request.transport.close()
                return out
        usage = {"choices": [], "usage": {"completion_tokens": len(self.tokens)}}
        await out.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        return out

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


def _result(tenant: str) -> PrefillResult:
    handoff = {"request_id": "r1", "num_tokens": 4, "expires": 9e9, "token": "ab" * 32,
               "stages": [["127.0.0.1:1", 0, 2]]}  # fmt: skip
    return PrefillResult(
        request_id="r1",
        tenant=tenant,
        num_prompt_tokens=4,
        kv_transfer_params={"do_remote_prefill": True, PARAMS_KEY: handoff},
    )


async def _serve_one(
    decode: Recorder,
    *,
    tenant: str,
    stream: bool,
    metrics: GatewayMetrics | None = None,
    prefill_delay_s: float = 0.0,
    client_traceparent: str = "",
) -> tuple[int, str, list[str]]:
    """One whole completion through a DecodeFlow in front of ``decode``: (status, body, the
    traceparents current while the prefill ran)."""
    flow = DecodeFlow(DecodePool([decode.url]), model_name="tiny", metrics=metrics)
    seen: list[str] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        async def prefill() -> tuple[int, object, dict]:
            seen.append(tracing.current_traceparent())  # what Gateway.prefill puts in the intake
            await asyncio.sleep(prefill_delay_s)
            return 200, _result(tenant), {}

        prompt = ParsedRequest(tenant, "r1", [1, 2, 3, 4], handoff=True)
        batch = CompletionRequest([prompt], "tiny", stream=stream, sampling=Sampling(8))
        return await flow.complete(
            request, batch, prefill=prefill, cache_salt="s", answered=lambda _code: None
        )

    app = web.Application()
    app.add_routes([web.post("/v1/completions", handle)])
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    headers = {"traceparent": client_traceparent} if client_traceparent else {}
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"http://127.0.0.1:{port}/v1/completions", json={}, headers=headers) as r,
        ):
            return r.status, await r.text(), seen
    finally:
        await flow.close()
        await runner.cleanup()


def _ids(traceparent: str) -> tuple[str, str]:
    """(trace id, span id) of a W3C traceparent ``00-<trace>-<span>-<flags>``, sampled."""
    version, trace_id, span_id, flags = traceparent.split("-")
    assert version == "00" and int(flags, 16) & 1, traceparent
    return trace_id, span_id


def _metrics() -> GatewayMetrics:
    return GatewayMetrics(lambda: GatewayLoad({}, {}, 0, 1, {}))


def _histograms(metrics: GatewayMetrics, name: str) -> dict[str, tuple[float, float]]:
    """tenant -> (count, sum) of the histogram ``name`` in the gateway's scrape."""
    text = metrics.scrape()[0].decode()
    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (f"{name}_count", f"{name}_sum"):
                entry = out.setdefault(sample.labels["tenant"], [0.0, 0.0])
                entry[0 if sample.name.endswith("_count") else 1] = sample.value
    return {tenant: (count, total) for tenant, (count, total) in out.items()}


# ---- the trace --------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_the_decode_request_carries_the_requests_trace(
    spans: InMemorySpanExporter, stream: bool
) -> None:
    decode = Recorder([7, 8, 9])
    await decode.start()
    try:
        status, _text, prefill_seen = await _serve_one(decode, tenant="acme", stream=stream)
    finally:
        await decode.stop()
    assert status == 200
    records = _records(spans)
    root, prefill, dec = records["gateway.request"], records["prefill"], records["decode"]
    assert root.is_root and root.attributes["tenant"] == "acme"
    assert root.attributes["http.status_code"] == 200 and root.attributes["completion.tokens"] == 3
    assert {prefill.trace_id, dec.trace_id} == {root.trace_id}
    assert prefill.parent_span_id == root.span_id and dec.parent_span_id == root.span_id
    # the intake gets the prefill span's context, the decode endpoint the decode span's
    assert [_ids(tp) for tp in prefill_seen] == [(root.trace_id, prefill.span_id)]
    [(headers, body)] = decode.requests
    assert _ids(headers["traceparent"]) == (root.trace_id, dec.span_id)
    assert body["kv_transfer_params"][PARAMS_KEY]["traceparent"] == headers["traceparent"]
    assert dec.attributes["decode.endpoint"] == decode.url


async def test_a_clients_traceparent_is_the_parent_and_failures_mark_the_span(
    spans: InMemorySpanExporter,
) -> None:
    client = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
    decode = Recorder([7], behaviour="error")
    await decode.start()
    try:
        status, _text, _seen = await _serve_one(
            decode, tenant="acme", stream=False, client_traceparent=client
        )
    finally:
        await decode.stop()
    assert status == 400
    root = _records(spans)["gateway.request"]
    assert (root.trace_id, root.parent_span_id) == ("ab" * 16, "cd" * 8)
    assert root.status == "ERROR" and root.attributes["http.status_code"] == 400
    assert decode.requests[0][0]["traceparent"].split("-")[1] == "ab" * 16


async def test_untraced_gateway_sends_no_traceparent() -> None:
    decode = Recorder([7, 8])
    await decode.start()
    try:
        status, _text, seen = await _serve_one(decode, tenant="acme", stream=True)
    finally:
        await decode.stop()
    assert status == 200 and seen == [""]
    [(headers, body)] = decode.requests
    assert "traceparent" not in headers
    assert "traceparent" not in body["kv_transfer_params"][PARAMS_KEY]


async def test_intake_carries_the_prefill_span(spans: InMemorySpanExporter) -> None:
    """The real ``Gateway.prefill`` over a real nats-server: the intake message it publishes
    carries the traceparent of the span current when it was called."""
    with EmbeddedNatsServer(jetstream=True) as server:
        nc = await connect(server.url, name="test-gateway-trace")
        gateway = Gateway(tiny_gateway_config(model_id="m"), nc)
        await gateway.start()
        intakes: asyncio.Queue[bytes] = asyncio.Queue()

        async def on_intake(msg: Any) -> None:
            await intakes.put(msg.data)

        await nc.subscribe(intake_subject("p-r0", namespace="local"), cb=on_intake)
        try:
            beat = Heartbeat(pipeline="p-r0", ready=True, num_stages_formed=2, num_inflight=0,
                             instance="i", pool="p", num_stages=2)  # fmt: skip
            await nc.publish(
                heartbeat_subject("p-r0", namespace="local"), beat.model_dump_json().encode()
            )
            await flush_in_order(nc)
            await asyncio.sleep(0.2)
            with tracing.span("prefill") as span:
                task = asyncio.create_task(
                    gateway.prefill(ParsedRequest("default", "r1", [1, 2, 3]))
                )
                expected = tracing.traceparent_of(span)
            intake = IntakeRequest.model_validate_json(await asyncio.wait_for(intakes.get(), 10))
            assert expected and intake.traceparent == expected
            task.cancel()
        finally:
            await gateway.stop()
            await nc.close()


# ---- TTFT and time per output token -----------------------------------------------------------


def test_completion_clock() -> None:
    clock = CompletionClock(admitted_s=10.0)
    assert clock.ttft_s is None and clock.tpot_s is None
    assert not clock.sent(0, 10.5)  # a chunk without tokens is not the first token
    assert clock.sent(1, 11.0) and clock.ttft_s == 1.0 and clock.tpot_s is None
    assert not clock.sent(1, 11.5)
    assert not clock.sent(2, 12.0)  # a chunk of two tokens: 3 gaps after the first token
    assert clock.num_tokens == 4 and clock.tpot_s == pytest.approx(1.0 / 3)


async def test_streamed_completion_records_ttft_and_tpot_per_tenant() -> None:
    metrics = _metrics()
    decode = Recorder([7, 8, 9, 10])
    await decode.start()
    try:
        status, text, _ = await _serve_one(
            decode, tenant="acme", stream=True, metrics=metrics, prefill_delay_s=0.2
        )
    finally:
        await decode.stop()
    assert status == 200 and text.rstrip().endswith("data: [DONE]")
    ttft = _histograms(metrics, "wavepp_gateway_completion_ttft_seconds")
    tpot = _histograms(metrics, "wavepp_gateway_time_per_output_token_seconds")
    assert set(ttft) == {"acme"} and ttft["acme"][0] == 1
    assert ttft["acme"][1] >= 0.2  # from admission: the prefill's 0.2 s is in it
    assert set(tpot) == {"acme"} and tpot["acme"][0] == 1
    assert TOKEN_GAP_S * 0.9 <= tpot["acme"][1] < TOKEN_GAP_S * 10  # one mean gap per request


async def test_non_streamed_completion_records_ttft_only() -> None:
    metrics = _metrics()
    decode = Recorder([7, 8, 9])
    await decode.start()
    try:
        status, text, _ = await _serve_one(
            decode, tenant="beta", stream=False, metrics=metrics, prefill_delay_s=0.1
        )
    finally:
        await decode.stop()
    assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 3
    ttft = _histograms(metrics, "wavepp_gateway_completion_ttft_seconds")
    assert set(ttft) == {"beta"} and ttft["beta"][0] == 1 and ttft["beta"][1] >= 0.1
    # a non-streamed answer has no token times at the gateway: no TPOT sample
    assert _histograms(metrics, "wavepp_gateway_time_per_output_token_seconds") == {}


async def test_failures_record_no_tpot_and_ttft_only_for_a_token_sent() -> None:
    metrics = _metrics()
    refusing, breaking = Recorder([7], behaviour="error"), Recorder([7, 8, 9], behaviour="break")
    await refusing.start()
    await breaking.start()
    try:
        refused = await _serve_one(refusing, tenant="acme", stream=True, metrics=metrics)
        broken = await _serve_one(breaking, tenant="beta", stream=True, metrics=metrics)
    finally:
        await refusing.stop()
        await breaking.stop()
    assert refused[0] == 400
    assert broken[0] == 200 and '"error"' in broken[1]  # the final SSE error event
    # the refused one sent no token: nothing; the broken one sent its first token: TTFT only
    assert _histograms(metrics, "wavepp_gateway_completion_ttft_seconds").keys() == {"beta"}
    assert _histograms(metrics, "wavepp_gateway_time_per_output_token_seconds") == {}


# ---- where the gateway's tracing settings come from -------------------------------------------


def test_the_gateway_traces_as_the_spec_says_and_refuses_a_metrics_port(tmp_path: Any) -> None:
    from wavepp import cli
    from wavepp.api.spec import WavePipelineSpec
    from wavepp.launch.gateway import gateway_config_from_spec
    from wavepp.launch.up import plan_up

    raw = {"model": {"name": "tiny-llama"}, "stages": 2, "engine": "emulated",
           "telemetry": {"otlpEndpoint": "http://collector:4317", "samplingRatio": 0.25}}  # fmt: skip
    spec = WavePipelineSpec.model_validate(raw).resolved(
        default_image="i", default_nats_url="nats://n"
    )
    pod = gateway_config_from_spec(spec, {"pipeline": "p"}).telemetry
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(raw))
    args = cli.build_parser(["up"]).parse_args(["up", "--port", "0", "--config", str(path)])
    local = plan_up(args).gateway.telemetry
    for telemetry in (pod, local):
        assert (telemetry.exporter, telemetry.endpoint) == ("otlp-grpc", "http://collector:4317")
        assert telemetry.sampling_ratio == 0.25 and telemetry.metrics_port is None
    with pytest.raises(ValueError, match="telemetry.metrics_port"):
        tiny_gateway_config(telemetry=TelemetrySettings(metrics_port=9100))
