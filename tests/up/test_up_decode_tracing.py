"""``wavepp up --decode vllm`` starts its vLLM instances exporting their request spans where the
replicas and the gateway export theirs (the spec's OTLP endpoint), so vLLM's ``llm_request``
span joins the trace whose ``traceparent`` the gateway sends. Resolved before anything starts;
the probe of ``--decode-python`` for vLLM is replaced (vLLM is not installed where this runs)."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from wavepp.api.vllm_decode import OTLP_PROTOCOL_ENV, vllm_tracing
from wavepp.launch import decode as launch_decode
from wavepp.telemetry.settings import TelemetrySettings


def test_vllm_tracing_follows_the_exporter() -> None:
    assert vllm_tracing("otlp-grpc", "http://c:4317") == (
        ["--otlp-traces-endpoint", "http://c:4317"],
        {OTLP_PROTOCOL_ENV: "grpc"},
    )
    assert vllm_tracing("otlp-http", "http://c:4318/v1/traces")[1] == {
        OTLP_PROTOCOL_ENV: "http/protobuf"
    }
    for exporter, endpoint in (("none", ""), ("jsonl", ""), ("otlp-grpc", ""), ("none", "x")):
        assert vllm_tracing(exporter, endpoint) == ([], {})


@pytest.mark.parametrize("exporter", ["otlp-http", "none"])
def test_local_decode_instances_export_to_the_replicas_endpoint(
    monkeypatch: pytest.MonkeyPatch, exporter: str
) -> None:
    monkeypatch.setattr(launch_decode, "check_vllm_python", lambda python: None)
    endpoint = "http://collector:4318/v1/traces" if exporter != "none" else ""
    first = SimpleNamespace(
        model_dir="/nonexistent/ckpt",
        model=SimpleNamespace(name="tiny", dtype="float32", max_position=256),
        telemetry=TelemetrySettings(exporter=exporter, endpoint=endpoint),
    )
    args = argparse.Namespace(
        decode="vllm", decode_url=[], decode_max_tokens=16, decode_replicas=2,
        decode_python="/x/python", decode_args="--max-num-seqs 4",
    )  # fmt: skip
    servers, urls = launch_decode.plan_decode(args, first, on_cpu=True)  # type: ignore[arg-type]
    assert len(servers) == 2 and urls == [s.url for s in servers]
    for server in servers:
        if exporter == "none":
            assert "--otlp-traces-endpoint" not in server.command
            continue
        at = server.command.index("--otlp-traces-endpoint")
        assert server.command[at + 1] == endpoint
        assert server.command[-2:] == ["--max-num-seqs", "4"]  # the user's options last
        assert server.env[OTLP_PROTOCOL_ENV] == "http/protobuf"
