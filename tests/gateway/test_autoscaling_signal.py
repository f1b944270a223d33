"""The autoscaler's signal exists where the autoscaler looks for it.

The operator's HPA for ``autoscaling.metric: backlog`` asks for an External metric by name and
labels; the chart's prometheus-adapter rule serves that name from a series; a real gateway (the
one `wavepp up` runs) exports that series with those labels. This test fails if any of the three
names or the selector's labels drift apart.
"""

from __future__ import annotations

import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from wavepp.api.spec import WavePipelineSpec
from wavepp.operator import builders
from wavepp.operator.gateway_builders import build_gateway_deployment
from wavepp.operator.naming import PipelineRef, spec_hash

REPO = Path(__file__).resolve().parents[2]


def _helm() -> str:
    for candidate in (REPO / ".venv" / "bin" / "helm", shutil.which("helm")):
        if candidate and Path(candidate).exists():
            return str(candidate)
    pytest.fail("helm not found (scripts/install-helm.sh installs it into .venv/bin)")


def _chart(*values: str) -> list[dict]:
    args = [_helm(), "template", "wavepp", str(REPO / "charts" / "wavepp"), "-n", "wavepp-system"]
    for value in values:
        args += ["--set", value]
    result = subprocess.run(args, capture_output=True, text=True, timeout=60, check=True)
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def test_hpa_rule_and_a_real_gateway_agree_on_the_backlog_series(up_service) -> None:  # noqa: ANN001
    pool = "default"  # wavepp up's --pool default: the gateway's pool is the pipeline's name
    spec = WavePipelineSpec.model_validate(
        {
            "model": {"name": "tiny-llama"},
            "stages": 2,
            "autoscaling": {"maxReplicas": 3, "target": 4},
        }
    )
    assert spec.autoscaling is not None and spec.autoscaling.metric == "backlog"  # the default
    hpa = builders.build_hpa(PipelineRef(pool, "team-a", "uid-1"), spec)
    assert hpa is not None
    (metric,) = hpa["spec"]["metrics"]
    external = metric["external"]
    name, labels = external["metric"]["name"], external["metric"]["selector"]["matchLabels"]
    assert labels == {"namespace": "team-a", "pool": pool}
    assert external["target"] == {"type": "AverageValue", "averageValue": "4"}
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300

    objects = _chart("monitoring.prometheusAdapterRules.enabled=true")
    (rules_cm,) = [
        o for o in objects if o["kind"] == "ConfigMap" and "adapter" in o["metadata"]["name"]
    ]
    (rule,) = yaml.safe_load(rules_cm["data"]["external-rules.yaml"])["externalRules"]
    assert rule["name"]["as"] == name and rule["seriesQuery"].startswith(name + "{")
    assert "by (namespace, pool)" in rule["metricsQuery"]  # the selector's labels survive

    with urllib.request.urlopen(f"{up_service.endpoint}/metrics", timeout=10) as response:
        text = response.read().decode()
    series = [
        sample
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    ]
    assert series, f"the gateway exports no {name}"
    # Prometheus adds namespace from the scraped pod; the series itself carries the pool.
    assert {s.labels.get("pool") for s in series} == {pool}


def test_the_pod_monitor_scrapes_the_gateway_port_that_serves_the_series() -> None:
    objects = _chart("monitoring.podMonitor.enabled=true")
    (monitor,) = [o for o in objects if o["kind"] == "PodMonitor"]
    ports = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    # the http endpoint keeps only gateway and decode pods (an admission pod's http port has
    # no /metrics; vLLM serves its own on its http port: tests/operator/test_decode_scaling.py)
    (http,) = [e for e in monitor["spec"]["podMetricsEndpoints"] if e["port"] == "http"]
    component = {
        "sourceLabels": ["__meta_kubernetes_pod_label_app_kubernetes_io_component"],
        "targetLabel": "component",
    }  # the label the chart's alert rules select on
    assert http["relabelings"] == [
        {
            "sourceLabels": ["__meta_kubernetes_pod_label_app_kubernetes_io_component"],
            "regex": "gateway|decode",
            "action": "keep",
        },
        component,
    ]
    (metrics,) = [e for e in monitor["spec"]["podMetricsEndpoints"] if e["port"] == "metrics"]
    assert metrics["relabelings"] == [component]
    spec = WavePipelineSpec.model_validate({"model": {"name": "tiny-llama"}, "stages": 2})
    ref = PipelineRef("p", "team-a", "uid-1")
    gateway = build_gateway_deployment(ref, spec, spec_hash(spec))
    container = gateway["spec"]["template"]["spec"]["containers"][0]
    assert {p["name"] for p in container["ports"]} & ports == {"http"}
    labels = gateway["spec"]["template"]["metadata"]["labels"]
    wanted = {e["key"]: e["values"] for e in monitor["spec"]["selector"]["matchExpressions"]}
    assert labels["app.kubernetes.io/name"] in wanted["app.kubernetes.io/name"]
    assert labels["app.kubernetes.io/component"] in wanted["app.kubernetes.io/component"]
    # stage pods serve their own /metrics on their `metrics` port (wavepp.runtime.stage.metrics;
    # a real stage process is scraped in tests/operator/test_replica_drain.py)
    sts = builders.build_stage_statefulset(ref, spec, spec_hash(spec), 0)
    stage = sts["spec"]["template"]["spec"]["containers"][0]
    assert {p["name"] for p in stage["ports"]} & ports == {"metrics"}
    metrics_port = next(p for p in stage["ports"] if p["name"] == "metrics")["containerPort"]
    assert stage["args"][stage["args"].index("--metrics-port") + 1] == str(metrics_port)
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert labels["app.kubernetes.io/name"] in wanted["app.kubernetes.io/name"]
    assert labels["app.kubernetes.io/component"] in wanted["app.kubernetes.io/component"]
