"""The decode pool scales on its own signal and drains when it scales down.

- ``decode.pool.autoscaling`` renders an HPA on the decode Deployment asking for a Pods metric
  whose name the chart's prometheus-adapter rule produces from vLLM's gauge, and the chart's
  PodMonitor scrapes the decode pods' port that serves it (the rule's PromQL against a real
  Prometheus: tests/telemetry/test_decode_adapter_rule.py);
- the spec's refusals name the field and the limit;
- the decode pods' NetworkPolicy admits the scrape, and only the configured scrapers;
- a decode pod leaving drains: preStop keeps it serving while it leaves the Service, vLLM's
  ``--shutdown-timeout`` finishes what it holds, the grace period covers both;
- kmock end to end: the operator creates and deletes the HPA, and never overwrites the count the
  HPA set.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from operator_support import (
    NAMESPACE,
    Cluster,
    kubernetes_validate,
    render_chart,
    tiny_spec,
    wait_for,
)

from wavepp.api.spec import DECODE_METRICS, DECODE_PORT, check_spec
from wavepp.operator import builders as b
from wavepp.operator.decode_builders import (
    DECODE_DEREGISTER_S,
    DECODE_METRIC_NAMES,
    DECODE_TEARDOWN_S,
)
from wavepp.operator.naming import LABEL_COMPONENT, LABEL_PIPELINE, PipelineRef
from wavepp.operator.reconcile import Apply, Create, Defaults, Delete, Observed, plan

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "wavepipeline-pd.yaml"
DEFAULTS = Defaults(image="img:1", nats_url="nats://n:4222")
REF = PipelineRef("small-pd", "default", "pd-uid")


def _body(pool_patch: dict[str, Any] | None = None, **spec_patch: Any) -> dict[str, Any]:
    body = yaml.safe_load(EXAMPLE.read_text())
    body["metadata"]["uid"] = REF.uid
    body["spec"]["decode"]["pool"].update(pool_patch or {})
    body["spec"].update(spec_patch)
    return body


def _actions(body: dict[str, Any], observed: Observed | None = None) -> list[Any]:
    return plan(body, observed or Observed(), 0.0, DEFAULTS).actions


def _rendered(body: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {
        (a.manifest["kind"], a.manifest["metadata"]["name"]): a.manifest
        for a in _actions(body)
        if isinstance(a, (Apply, Create))
    }


def _adapter_rule_name(rule: dict[str, Any], series: str) -> str | None:
    """The metric name prometheus-adapter serves ``series`` under (``name.matches`` /
    ``name.as``, Go's ``${1}`` as Python's ``\\g<1>``), None when the rule does not match it."""
    matches = rule["name"]["matches"]
    if not re.search(matches, series):
        return None
    return re.sub(matches, re.sub(r"\$\{(\d+)\}", r"\\g<\1>", rule["name"]["as"]), series)


def test_the_example_renders_an_hpa_on_the_decode_deployment(tmp_path: Path) -> None:
    objects = _rendered(_body())
    pool = yaml.safe_load(EXAMPLE.read_text())["spec"]["decode"]["pool"]
    auto = pool["autoscaling"]
    deployment = objects[("Deployment", "small-pd-decode")]
    hpa = objects[("HorizontalPodAutoscaler", "small-pd-decode")]
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"]) == (deployment["apiVersion"], "Deployment")
    assert target["name"] == deployment["metadata"]["name"]
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 8)
    assert (auto["minReplicas"], auto["maxReplicas"]) == (2, 8)
    assert hpa["spec"]["metrics"] == [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": "vllm_num_requests_running"},
                "target": {"type": "AverageValue", "averageValue": str(auto["target"])},
            },
        }
    ]
    # The HPA owns the decode pods' count: the operator's manifest leaves it out.
    assert "replicas" not in deployment["spec"]
    # The prefill pool keeps its own HPA, on its own signal (the gateway's backlog).
    prefill = objects[("HorizontalPodAutoscaler", "small-pd")]
    assert prefill["spec"]["metrics"][0]["external"]["metric"]["name"] == b.BACKLOG_METRIC
    rc, output = kubernetes_validate([hpa, prefill, deployment], tmp_path)
    assert rc == 0, output


@pytest.mark.parametrize(("metric", "vllm_name"), sorted(DECODE_METRICS.items()))
def test_the_adapter_rule_serves_the_name_the_hpa_asks_for(
    helm: str, metric: str, vllm_name: str
) -> None:
    """The HPA's Pods metric is what the chart's custom rule makes of vLLM's gauge, over
    series labelled with the pod (what the PodMonitor's targets carry)."""
    hpa = _rendered(_body({"autoscaling": {"maxReplicas": 3, "metric": metric, "target": 0.5}}))[
        ("HorizontalPodAutoscaler", "small-pd-decode")
    ]
    pods_metric = hpa["spec"]["metrics"][0]["pods"]
    assert pods_metric["metric"]["name"] == DECODE_METRIC_NAMES[metric]
    assert pods_metric["target"]["averageValue"] == "0.5"
    (config_map,) = [
        o
        for o in render_chart(helm, "monitoring.prometheusAdapterRules.enabled=true")
        if o["kind"] == "ConfigMap" and "adapter" in o["metadata"]["name"]
    ]
    (rule,) = yaml.safe_load(config_map["data"]["custom-rules.yaml"])["rules"]
    assert _adapter_rule_name(rule, vllm_name) == DECODE_METRIC_NAMES[metric]
    # the spelling an OpenMetrics scrape of vLLM stores (tests/telemetry/test_decode_adapter_rule)
    underscored = vllm_name.replace(":", "_")
    assert _adapter_rule_name(rule, underscored) == DECODE_METRIC_NAMES[metric]
    assert _adapter_rule_name(rule, f"{vllm_name}_by_reason") is None
    name_regex = re.search(r'__name__=~"([^"]+)"', rule["seriesQuery"])
    assert name_regex and re.fullmatch(name_regex.group(1), vllm_name)
    assert re.fullmatch(name_regex.group(1), underscored)
    assert not re.fullmatch(name_regex.group(1), f"{vllm_name}_by_reason")
    assert rule["resources"]["overrides"] == {
        "namespace": {"resource": "namespace"},
        "pod": {"resource": "pod"},
    }
    assert "by (<<.GroupBy>>)" in rule["metricsQuery"]  # per pod, as a Pods metric needs


def test_the_pod_monitor_scrapes_the_decode_pods_vllm_port(helm: str) -> None:
    (monitor,) = [
        o
        for o in render_chart(helm, "monitoring.podMonitor.enabled=true")
        if o["kind"] == "PodMonitor"
    ]
    deployment = _rendered(_body())[("Deployment", "small-pd-decode")]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    wanted = {e["key"]: e["values"] for e in monitor["spec"]["selector"]["matchExpressions"]}
    assert all(labels[key] in values for key, values in wanted.items())
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    (port,) = container["ports"]
    (endpoint,) = [e for e in monitor["spec"]["podMetricsEndpoints"] if e["port"] == port["name"]]
    assert endpoint["path"] == "/metrics" and port["containerPort"] == DECODE_PORT
    (keep,) = [r for r in endpoint["relabelings"] if r.get("action") == "keep"]
    assert re.fullmatch(keep["regex"], labels["app.kubernetes.io/component"])


@pytest.mark.parametrize(
    ("pool_patch", "field", "text"),
    [
        (
            {"replicas": 2, "autoscaling": {"maxReplicas": 4, "target": 8}},
            "spec.decode.pool.replicas",
            "maxReplicas=4",
        ),
        (
            {"autoscaling": {"minReplicas": 5, "maxReplicas": 4, "target": 8}},
            "spec.decode.pool.autoscaling.minReplicas",
            "> maxReplicas=4",
        ),
        (
            {"autoscaling": {"maxReplicas": 257, "target": 8}},
            "spec.decode.pool.autoscaling.maxReplicas",
            "less than or equal to 256",
        ),
        (
            {"autoscaling": {"maxReplicas": 4, "target": 0}},
            "spec.decode.pool.autoscaling.target",
            "greater than or equal to 0.001",
        ),
        (
            {"autoscaling": {"maxReplicas": 4, "target": 8, "metric": "kv_cache"}},
            "spec.decode.pool.autoscaling.metric",
            "'running' or 'waiting'",
        ),
        (
            {"autoscaling": {"target": 8}},
            "spec.decode.pool.autoscaling.maxReplicas",
            "required",
        ),
        ({"drainSeconds": 0}, "spec.decode.pool.drainSeconds", "greater than or equal to 1"),
        ({"drainSeconds": 7200}, "spec.decode.pool.drainSeconds", "less than or equal to 3600"),
        (
            {"args": ["--shutdown-timeout=5"]},
            "spec.decode.pool.args",
            "decode.pool.drainSeconds (1 to 3600)",
        ),
    ],
)
def test_decode_scaling_refusals_name_the_field(
    pool_patch: dict[str, Any], field: str, text: str
) -> None:
    raw = _body()["spec"]
    raw["decode"]["pool"].pop("autoscaling")
    raw["decode"]["pool"].update(pool_patch)
    spec, issues = check_spec(raw, default_image="i", default_nats_url="nats://n")
    assert spec is None
    assert any(i.field == field and text in i.message for i in issues), issues


def test_a_fixed_pool_sets_its_count_and_renders_no_hpa() -> None:
    body = _body()
    body["spec"]["decode"]["pool"].pop("autoscaling")
    objects = _rendered(body)
    assert objects[("Deployment", "small-pd-decode")]["spec"]["replicas"] == 1  # the default
    assert ("HorizontalPodAutoscaler", "small-pd-decode") not in objects
    body["spec"]["decode"]["pool"]["replicas"] = 3
    assert _rendered(body)[("Deployment", "small-pd-decode")]["spec"]["replicas"] == 3


def test_each_hpa_is_deleted_alone_when_its_autoscaling_goes() -> None:
    both = _rendered(_body())
    observed = Observed(
        hpas=[
            both[("HorizontalPodAutoscaler", "small-pd")],
            both[("HorizontalPodAutoscaler", "small-pd-decode")],
        ]
    )
    no_decode = _body()
    no_decode["spec"]["decode"]["pool"].pop("autoscaling")
    no_prefill = _body()
    no_prefill["spec"].pop("autoscaling")
    for body, gone in ((no_decode, "small-pd-decode"), (no_prefill, "small-pd")):
        deletes = [
            a.name
            for a in _actions(body, observed)
            if isinstance(a, Delete) and a.kind == "HorizontalPodAutoscaler"
        ]
        assert deletes == [gone]
    assert not [a for a in _actions(_body(), observed) if isinstance(a, Delete)]


def test_a_decode_pod_drains_before_it_exits() -> None:
    deployment = _rendered(_body({"drainSeconds": 120}))[("Deployment", "small-pd-decode")]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    command = container["command"]
    # vLLM finishes the requests it holds for drainSeconds after SIGTERM (0 would abort them)
    assert command[command.index("--shutdown-timeout") + 1] == "120"
    # before SIGTERM the pod keeps serving while its removal from the endpoints propagates
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == command[0]  # the pool's python: present in any vLLM image
    assert f"time.sleep({DECODE_DEREGISTER_S})" in pre_stop[-1]
    # the kubelet kills the pod only after preStop + the drain + vLLM's teardown
    assert pod["terminationGracePeriodSeconds"] == DECODE_DEREGISTER_S + 120 + DECODE_TEARDOWN_S
    # requests reach decode pods through their Service: a terminating pod leaves its endpoints
    service = _rendered(_body())[("Service", "small-pd-decode")]
    assert service["spec"].get("publishNotReadyAddresses") is not True


def test_decode_pods_admit_the_scrape_and_only_the_configured_scrapers(tmp_path: Path) -> None:
    objects = _rendered(_body())
    decode = objects[("NetworkPolicy", "small-pd-decode")]["spec"]["ingress"]
    gateway_pods = {"matchLabels": {LABEL_PIPELINE: "small-pd", LABEL_COMPONENT: "gateway"}}
    prometheus = {
        "namespaceSelector": {},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
    }
    port = [{"protocol": "TCP", "port": DECODE_PORT}]
    assert decode == [
        {"from": [{"podSelector": gateway_pods}], "ports": port},
        {"from": [prometheus], "ports": port},
    ]
    # the stages' own metrics port is open to the scrape too (it serves nothing else)
    stage = objects[("NetworkPolicy", "small-pd-stage")]["spec"]["ingress"]
    metrics_port = yaml.safe_load(EXAMPLE.read_text())["spec"].get("telemetry", {})
    assert {"ports": [{"protocol": "TCP", "port": metrics_port.get("metricsPort", 9400)}]} in stage

    mine = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    body = _body(networkPolicy={"scrapeFrom": [mine]})
    decode = _rendered(body)[("NetworkPolicy", "small-pd-decode")]["spec"]["ingress"]
    assert decode[1] == {"from": [mine], "ports": port}
    body = _body(networkPolicy={"scrapeFrom": []})
    decode = _rendered(body)[("NetworkPolicy", "small-pd-decode")]["spec"]["ingress"]
    assert decode == [{"from": [{"podSelector": gateway_pods}], "ports": port}]
    policies = [o for k, o in objects.items() if k[0] == "NetworkPolicy"]
    rc, output = kubernetes_validate(policies, tmp_path)
    assert rc == 0, output


# -- kmock end to end -------------------------------------------------------------------------


async def test_the_operator_keeps_the_count_the_decode_hpa_sets(
    cluster: Cluster, operator: Any
) -> None:
    """The operator creates the decode HPA next to the prefill one, leaves the Deployment's
    count to it across later applies, and deletes it (alone) when its autoscaling goes."""
    pool = {
        "image": "vllm-wavepp:1",
        "resources": {"gpus": 0},
        "autoscaling": {"minReplicas": 1, "maxReplicas": 4, "metric": "waiting", "target": 2},
    }
    spec = tiny_spec(
        replicas=1,
        model={"name": "tiny-llama", "pvc": {"claimName": "w"}},
        decode={"pool": copy.deepcopy(pool)},
        autoscaling={"minReplicas": 1, "maxReplicas": 3, "metric": "cpu", "target": 70},
    )
    await cluster.create_pipeline("demo", spec)
    hpa = await wait_for(lambda: cluster.get("HorizontalPodAutoscaler", "demo-decode"), what="HPA")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "demo-decode"
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "vllm_num_requests_waiting"
    assert await cluster.get("HorizontalPodAutoscaler", "demo") is not None
    dep = await wait_for(lambda: cluster.get("Deployment", "demo-decode"), what="decode pool")
    assert "replicas" not in dep["spec"]

    # The HPA controller scales the Deployment (its scale subresource writes spec.replicas).
    await cluster.client.patch("Deployment", NAMESPACE, "demo-decode", {"spec": {"replicas": 3}})
    # A later spec edit makes the operator apply the Deployment again; the count stays the HPA's.
    await cluster.edit_spec("demo", {"decode": {"pool": pool | {"drainSeconds": 60}}})
    grace = DECODE_DEREGISTER_S + 60 + DECODE_TEARDOWN_S

    async def reapplied() -> dict[str, Any] | None:
        dep = await cluster.get("Deployment", "demo-decode")
        pod = (dep or {}).get("spec", {}).get("template", {}).get("spec", {})
        return dep if pod.get("terminationGracePeriodSeconds") == grace else None

    dep = await wait_for(reapplied, what="the decode Deployment re-applied")
    assert dep["spec"]["replicas"] == 3

    # Without autoscaling the operator sets the count again, and the decode HPA goes alone.
    fixed = {k: v for k, v in pool.items() if k != "autoscaling"} | {"replicas": 2}
    await cluster.edit_spec("demo", {"decode": {"pool": fixed | {"autoscaling": None}}})

    async def hpa_gone() -> bool:
        return await cluster.get("HorizontalPodAutoscaler", "demo-decode") is None

    await wait_for(hpa_gone, what="decode HPA deleted")

    async def fixed_count() -> bool:
        dep = await cluster.get("Deployment", "demo-decode")
        return dep is not None and dep["spec"].get("replicas") == 2

    await wait_for(fixed_count, what="the fixed count applied")
    assert await cluster.get("HorizontalPodAutoscaler", "demo") is not None
