"""The chart's prometheus-adapter rule for the decode autoscaler, against a real Prometheus.

Two decode "pods" are HTTP stand-ins exporting vLLM's scheduler gauges under vLLM's names and
labels (``vllm:num_requests_running``, ``vllm:num_requests_waiting`` and
``vllm:num_requests_waiting_by_reason``, labelled ``model_name`` and ``engine``, as vLLM's
Prometheus stat logger defines them) with prometheus_client, the library vLLM exports them with;
one of them runs two engines. Pod a answers as vLLM's ``/metrics`` does (prometheus_client's
content negotiation: OpenMetrics for Prometheus 2.x, whose sample names prometheus_client
writes with ``_`` for ``:``), pod b in the text format (names as vLLM defines them, what a
text-format or UTF-8 scrape stores). Prometheus scrapes them as the chart's PodMonitor would
(targets labelled ``namespace`` and ``pod``). Then, as prometheus-adapter does:

- the rule's ``seriesQuery`` is valid PromQL and finds exactly the two gauges of both pods,
  in either spelling (not the ``_by_reason`` one), each named as the operator's HPA asks for
  it;
- its ``metricsQuery``, expanded for the HPA's Pods request over those pods, answers one value
  per pod: the sum of that pod's engines.

A real vLLM is not started here (it takes minutes on CPU); the names are the ones
``wavepp.api.spec.DECODE_METRICS`` holds, which the operator's HPA is built from.

Skips where ``prometheus`` is not installed (``scripts/install-prometheus.sh``).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Gauge, MetricsHandler, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_support import (
    PrometheusServer,
    adapter_custom_rules,
    adapter_pods_query,
    require,
)

from wavepp.api.spec import DECODE_METRICS
from wavepp.operator.decode_builders import DECODE_METRIC_NAMES

pytestmark = pytest.mark.timeout(120)

NAMESPACE = "team-a"
MODEL = "small-llama"
# pod -> engine -> (running, waiting)
PODS: dict[str, dict[str, tuple[int, int]]] = {
    "small-pd-decode-a": {"0": (3, 1), "1": (2, 4)},
    "small-pd-decode-b": {"0": (7, 0)},
}


def _text_handler(registry: CollectorRegistry) -> type[BaseHTTPRequestHandler]:
    class TextHandler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_PLAIN_0_0_4)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    return TextHandler


def _serve(registry: CollectorRegistry, *, text: bool) -> tuple[ThreadingHTTPServer, str]:
    handler = _text_handler(registry) if text else MetricsHandler.factory(registry)
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/metrics"


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[PrometheusServer]:
    require("prometheus")
    servers, targets = [], []
    for pod, engines in PODS.items():
        registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        running = Gauge(DECODE_METRICS["running"], "running", labels, registry=registry)
        waiting = Gauge(DECODE_METRICS["waiting"], "waiting", labels, registry=registry)
        by_reason = Gauge(
            f"{DECODE_METRICS['waiting']}_by_reason", "by reason", [*labels, "reason"],
            registry=registry,
        )  # fmt: skip
        for engine, (num_running, num_waiting) in engines.items():
            running.labels(MODEL, engine).set(num_running)
            waiting.labels(MODEL, engine).set(num_waiting)
            by_reason.labels(MODEL, engine, "capacity").set(num_waiting)
        server, url = _serve(registry, text=pod.endswith("-b"))
        servers.append(server)
        targets.append(("decode", url, {"namespace": NAMESPACE, "pod": pod}))
    prom = PrometheusServer(tmp_path / "prometheus", targets, interval_s=0.5)
    try:
        prom.start()
        yield prom
    finally:
        prom.stop()
        for server in servers:
            server.shutdown()
            server.server_close()


def test_the_decode_rule_finds_and_sums_vllms_gauges_per_pod(prometheus: PrometheusServer) -> None:
    (rule,) = adapter_custom_rules()
    matches, as_ = rule["name"]["matches"], re.sub(r"\$\{(\d+)\}", r"\\g<\1>", rule["name"]["as"])
    wanted = {(name, pod) for name in DECODE_METRIC_NAMES.values() for pod in PODS}
    deadline = time.monotonic() + 30
    stored: dict[tuple[str, str], str] = {}  # (HPA metric, pod) -> the series name stored
    while time.monotonic() < deadline:
        series = prometheus.series(rule["seriesQuery"])
        names = {s["__name__"] for s in series}
        assert all(re.search(matches, name) for name in names), names  # nothing else found
        stored = {(re.sub(matches, as_, s["__name__"]), s["pod"]): s["__name__"] for s in series}
        if set(stored) >= wanted:
            break
        time.sleep(0.2)
    assert set(stored) == wanted  # both gauges of both pods (no _by_reason), as the HPA names
    # the two spellings Prometheus stores (module docstring): both served by the rule
    assert stored[("vllm_num_requests_running", "small-pd-decode-b")] == DECODE_METRICS["running"]
    assert stored[("vllm_num_requests_running", "small-pd-decode-a")] == "vllm_num_requests_running"

    for metric, hpa_name in DECODE_METRIC_NAMES.items():
        column = 0 if metric == "running" else 1
        for pod, engines in PODS.items():
            # the adapter queries each series name it discovered, over the HPA's pods
            query = adapter_pods_query(rule, stored[(hpa_name, pod)], NAMESPACE, sorted(PODS))
            answer = {r["metric"]["pod"]: float(r["value"][1]) for r in prometheus.query(query)}
            assert answer[pod] == sum(values[column] for values in engines.values()), query
