"""The chart's alert rules (charts/wavepp/rules/wavepp-alerts.yaml) under ``promtool``: the file
checks as a Prometheus rules file, its unit tests pass (each alert fires on the series that
should raise it after its ``for:``, and not on a near miss), and the chart's PrometheusRule
carries exactly those rules. The live firing of ``WavePPStageDown`` after a stage is killed is
tests/telemetry/test_prometheus_live.py's."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from operator_support import helm, render_chart  # noqa: F401 - helm: the fixture
from prometheus_support import ALERT_RULES, require

pytestmark = pytest.mark.timeout(120)

UNIT_TESTS = Path(__file__).parent / "promtool" / "wavepp-alerts.test.yaml"
ALERTS = {
    "WavePPStageDown",
    "WavePPReplicaOutOfPool",
    "WavePPWaveFillLow",
    "WavePPKVPoolFull",
    "WavePPReservationRefusalsClimbing",
    "WavePPAgreementP99High",
    "WavePPAuthFailuresSpiking",
    "WavePPJetStreamStoreNearFull",
}


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([require("promtool"), *args], capture_output=True, text=True, timeout=60)


def test_rules_file_checks_and_names_every_alert() -> None:
    result = _promtool("check", "rules", str(ALERT_RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    rules = yaml.safe_load(ALERT_RULES.read_text())["groups"][0]["rules"]
    assert {r["alert"] for r in rules} == ALERTS


def test_promtool_unit_tests_pass_and_cover_every_alert() -> None:
    result = _promtool("test", "rules", str(UNIT_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    tested = {
        case["alertname"]
        for test in yaml.safe_load(UNIT_TESTS.read_text())["tests"]
        for case in test["alert_rule_test"]
        if case.get("exp_alerts")
    }
    assert tested == ALERTS


def test_promtool_unit_tests_fail_on_a_broken_threshold(tmp_path: Path) -> None:
    """The unit tests can fail: a copy of the rules with the auth-failure threshold raised
    past the test's rate leaves that alert silent, and promtool says so."""
    broken = tmp_path / "charts" / "wavepp" / "rules" / "wavepp-alerts.yaml"
    broken.parent.mkdir(parents=True)
    text = ALERT_RULES.read_text()
    assert "[5m])) > 1\n" in text
    broken.write_text(text.replace("[5m])) > 1\n", "[5m])) > 100\n"))
    tests = tmp_path / "tests" / "telemetry" / "promtool" / UNIT_TESTS.name
    tests.parent.mkdir(parents=True)
    tests.write_text(UNIT_TESTS.read_text())
    result = _promtool("test", "rules", str(tests))
    assert result.returncode != 0
    assert "WavePPAuthFailuresSpiking" in result.stdout + result.stderr


def test_chart_prometheus_rule_is_the_rules_file(helm: str) -> None:  # noqa: F811
    objects = render_chart(
        helm,
        "monitoring.prometheusRule.enabled=true",
        "monitoring.prometheusRule.labels.release=kube-prometheus-stack",
    )
    (rule,) = [o for o in objects if o["kind"] == "PrometheusRule"]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert rule["spec"] == yaml.safe_load(ALERT_RULES.read_text())
    assert not [o for o in render_chart(helm) if o["kind"] == "PrometheusRule"]


def test_pod_monitor_sets_the_component_label_the_rules_select_on(helm: str) -> None:  # noqa: F811
    objects = render_chart(helm, "monitoring.podMonitor.enabled=true")
    (monitor,) = [o for o in objects if o["kind"] == "PodMonitor"]
    for endpoint in monitor["spec"]["podMetricsEndpoints"]:
        assert {
            "sourceLabels": ["__meta_kubernetes_pod_label_app_kubernetes_io_component"],
            "targetLabel": "component",
        } in endpoint["relabelings"]
