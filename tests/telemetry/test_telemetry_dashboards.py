"""The Grafana dashboards load as valid dashboard JSON, and every series and label a panel
queries is one the runtime or the gateway exports: checked against real scrapes of both
``/metrics`` endpoints after each instrument recorded a value."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from wavepp.gateway.metrics import (
    GATEWAY_PROMETHEUS_NAMES,
    GatewayLoad,
    GatewayMetrics,
    JetStreamStore,
)
from wavepp.telemetry.metrics import (
    PROMETHEUS_NAMES,
    setup_metrics,
    shutdown_metrics,
)
from wavepp.telemetry.pipeline import PipelineTelemetry
from wavepp.telemetry.settings import TelemetrySettings

pytestmark = pytest.mark.timeout(60)

DASHBOARDS = sorted((Path(__file__).parents[2] / "dashboards").glob("*.json"))
PANEL_TYPES = {"timeseries", "stat", "gauge", "heatmap", "table", "bargauge", "text"}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}


class _Stats:
    spans: list = []

    def wave_fill(self, num_stages: int) -> float:
        return 0.5

    def busy_s_by_stage(self, num_stages: int) -> list[float]:
        return [1.0] * num_stages


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    """Series name -> label names, from one scrape after every instrument recorded a value."""
    metrics = setup_metrics(TelemetrySettings(metrics_port=0), "test")
    assert metrics is not None and metrics.port
    try:
        telemetry = PipelineTelemetry("p", 2, _Stats(), lambda: {"intake": 1, "prepared": 2})
        telemetry.request_arrived("r", 0.0, 32, "acme")
        telemetry.admitted(
            "r", num_prompt_tokens=32, num_cached_tokens=16, agreement_s=1e-3, num_refusals=1
        )
        telemetry.completed("r", ttft_s=0.2, finished_s=0.2)
        telemetry.microbatch_published(0, [], 0.0, 0.0)
        telemetry.speculation_discarded()
        metrics.stage_busy.add(0.1, {"pipeline": "p", "stage.rank": 0})
        telemetry.kv_removed(1, 3)
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics.port}/metrics", timeout=10) as r:
            text = r.read().decode()
    finally:
        shutdown_metrics()
    return _series(text)


@pytest.fixture(scope="module")
def gateway_exported() -> dict[str, set[str]]:
    """The same, from the gateway's ``/metrics`` text (``GatewayMetrics.scrape``)."""
    load = GatewayLoad(
        num_queued_by_tenant={"acme": 1},
        num_active_by_tenant={"acme": 2},
        num_requests_in_gateway=2,
        max_queued_requests=1024,
        is_replica_up={"p-r0": True},
        jetstream_store=JetStreamStore(used_bytes=3 * 2**20, limit_bytes=2**30),
    )
    metrics = GatewayMetrics(lambda: load)
    try:
        metrics.request_answered("acme", 200)
        metrics.result_served("acme", num_prompt_tokens=32, num_cached_tokens=16, ttft_s=0.2)
        metrics.first_token_sent("acme", 0.3)
        metrics.output_tokens_paced("acme", 0.02)
        metrics.routed("p-r0", 2)
        metrics.auth_failed("invalid")
        body, content_type = metrics.scrape()
    finally:
        metrics.shutdown()
    assert content_type.startswith("text/plain")
    return _series(body.decode())


def _series(text: str) -> dict[str, set[str]]:
    series: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    return series


def _panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))  # collapsed rows
    return out


def test_prometheus_names_are_what_a_scrape_returns(exported: dict[str, set[str]]) -> None:
    for name in PROMETHEUS_NAMES:
        assert name in exported or f"{name}_bucket" in exported, name
    assert {n for n in exported if n.startswith("wavepp_")} <= {
        f"{n}{suffix}" for n in PROMETHEUS_NAMES for suffix in ("", "_bucket", "_count", "_sum")
    }


def test_gateway_series_and_labels(gateway_exported: dict[str, set[str]]) -> None:
    # The names and labels the gateway exported when it used prometheus_client directly (its
    # `*_created` series aside); nothing else, no OTel scope labels, no target_info.
    assert gateway_exported == {
        "wavepp_gateway_requests_total": {"tenant", "code"},
        "wavepp_gateway_prompt_tokens_total": {"tenant"},
        "wavepp_gateway_cached_tokens_total": {"tenant"},
        "wavepp_gateway_ttft_seconds_bucket": {"tenant", "le"},
        "wavepp_gateway_ttft_seconds_count": {"tenant"},
        "wavepp_gateway_ttft_seconds_sum": {"tenant"},
        "wavepp_gateway_completion_ttft_seconds_bucket": {"tenant", "le"},
        "wavepp_gateway_completion_ttft_seconds_count": {"tenant"},
        "wavepp_gateway_completion_ttft_seconds_sum": {"tenant"},
        "wavepp_gateway_time_per_output_token_seconds_bucket": {"tenant", "le"},
        "wavepp_gateway_time_per_output_token_seconds_count": {"tenant"},
        "wavepp_gateway_time_per_output_token_seconds_sum": {"tenant"},
        "wavepp_gateway_queue_depth": {"tenant"},
        "wavepp_gateway_active_requests": {"tenant"},
        "wavepp_gateway_requests_in_gateway": set(),
        "wavepp_gateway_backlog_requests": {"pool"},
        "wavepp_gateway_max_queued_requests": set(),
        "wavepp_gateway_replica_up": {"replica"},
        "wavepp_gateway_routed_reusable_blocks_total": {"replica"},
        "wavepp_gateway_auth_failures_total": {"reason"},
        "wavepp_gateway_jetstream_store_used_bytes": set(),
        "wavepp_gateway_jetstream_store_limit_bytes": set(),
    }
    for name in GATEWAY_PROMETHEUS_NAMES:
        assert name in gateway_exported or f"{name}_bucket" in gateway_exported, name


@pytest.mark.parametrize(
    ("store", "expected"),
    [
        (JetStreamStore(used_bytes=5, limit_bytes=100), {"used": 5.0, "limit": 100.0}),
        (JetStreamStore.from_account_info(7, -1), {"used": 7.0}),  # no account limit
        (None, {}),  # no account info answered yet
    ],
)
def test_gateway_store_gauges(store: JetStreamStore | None, expected: dict[str, float]) -> None:
    """The store gauges carry the account info's values; the limit series exists only with a
    limit, and neither before the first answer (a ratio over nothing stays empty, no alert)."""
    load = GatewayLoad({}, {}, 0, 1, {}, jetstream_store=store)
    metrics = GatewayMetrics(lambda: load)
    try:
        body, _ = metrics.scrape()
    finally:
        metrics.shutdown()
    values = {
        sample.name.removeprefix("wavepp_gateway_jetstream_store_").removesuffix("_bytes"): (
            sample.value
        )
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
        if sample.name.startswith("wavepp_gateway_jetstream_store_")
    }
    assert values == expected


def test_three_dashboards() -> None:
    assert {p.stem for p in DASHBOARDS} == {"wavepp-pipeline", "wavepp-stages", "wavepp-tenants"}


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_dashboard_is_valid_grafana_json(path: Path) -> None:
    dashboard = json.loads(path.read_text())
    for key in ("uid", "title", "schemaVersion", "panels", "templating", "time"):
        assert key in dashboard, key
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 30
    assert re.fullmatch(r"[a-zA-Z0-9_-]{1,40}", dashboard["uid"])
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    panels = _panels(dashboard)
    assert panels
    assert len({p["id"] for p in panels}) == len(panels), "panel ids must be unique"
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        assert panel["type"] in PANEL_TYPES, panel["type"]
        grid = panel["gridPos"]
        assert all(isinstance(grid[k], int) for k in "xywh")
        assert grid["x"] >= 0 and grid["w"] >= 1 and grid["x"] + grid["w"] <= 24, panel["title"]
        mine = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not mine & cells, f"panel {panel['title']!r} overlaps another"
        cells |= mine
        targets = panel["targets"]
        assert targets and len({t["refId"] for t in targets}) == len(targets)
        for target in targets:
            for var in re.findall(r"\$\{?(\w+)", target["expr"]):
                assert var in variables, f"{panel['title']}: ${var} is not a dashboard variable"
            assert target["expr"].count("(") == target["expr"].count(")")
            assert target["expr"].count("{") == target["expr"].count("}")


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_every_queried_series_and_label_is_exported(
    path: Path, exported: dict[str, set[str]], gateway_exported: dict[str, set[str]]
) -> None:
    assert not exported.keys() & gateway_exported.keys()
    exported = {**exported, **gateway_exported}  # Prometheus scrapes both endpoints
    dashboard = json.loads(path.read_text())
    queries = [t["expr"] for p in _panels(dashboard) for t in p["targets"]]
    queries += [
        v["definition"] for v in dashboard["templating"]["list"] if v.get("type") == "query"
    ]
    for expr in queries:
        names = set(re.findall(r"\bwavepp_[a-z0-9_]+", expr))
        assert names, f"no wavepp series in {expr!r}"
        labels: set[str] = set()
        for name in names:
            assert name in exported, f"{path.name}: {name} is not exported ({expr})"
            labels |= exported[name]
        used = set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)\s*\"", expr))
        for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
            used |= {label.strip() for label in group.split(",") if label.strip()}
        used |= set(re.findall(r"label_values\(\s*\w+\s*,\s*(\w+)\s*\)", expr))
        assert used - PROMQL_WORDS <= labels, (
            f"{path.name}: unknown labels {used - labels} in {expr}"
        )
