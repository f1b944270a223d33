"""The Helm chart: lint, render, validate every manifest, and its RBAC and CRD."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from operator_support import REPO, kubernetes_validate, render_chart

from wavepp.operator.crdgen import render_crd

CHART = REPO / "charts" / "wavepp"
VALUE_SETS = [
    (),
    ("nats.deploy=true", "otlp.endpoint=http://otel:4317", "operator.postEvents=false"),
    ("watchNamespaces={team-a,team-b}", "rbac.podGroups=true", "rbac.inferencePools=true"),
]
IDS = ["defaults", "nats-deploy", "namespaced"]


@pytest.mark.parametrize("values", VALUE_SETS, ids=IDS)
def test_helm_lint(helm: str, values: tuple[str, ...]) -> None:
    args = [helm, "lint", "--strict", str(CHART)]
    for value in values:
        args += ["--set", value]
    result = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("values", VALUE_SETS, ids=IDS)
def test_rendered_manifests_pass_kubernetes_validate_strict(
    helm: str, values: tuple[str, ...], tmp_path: Path
) -> None:
    objects = render_chart(helm, *values)
    kinds = sorted({o["kind"] for o in objects})
    assert {"CustomResourceDefinition", "Deployment", "ServiceAccount", "NetworkPolicy"} <= set(
        kinds
    )
    rc, output = kubernetes_validate(objects, tmp_path)
    assert rc == 0, output


def test_validator_rejects_a_broken_manifest(helm: str, tmp_path: Path) -> None:
    """Control: the strict validator does catch an unknown field in a rendered object."""
    objects = render_chart(helm)
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    rc, output = kubernetes_validate([deployment], tmp_path)
    assert rc != 0 and "imagePullPolcy" in output


def _env(objects: list[dict[str, Any]]) -> dict[str, str]:
    deployment = next(o for o in objects if o["metadata"]["name"] == "wavepp-operator")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", "") for e in container["env"]}


def test_values_reach_the_operator(helm: str) -> None:
    env = _env(render_chart(helm, "nats.url=nats://nats.infra:4222", "image.tag=9.9"))
    assert env["WAVEPP_DEFAULT_NATS_URL"] == "nats://nats.infra:4222"
    assert env["WAVEPP_DEFAULT_IMAGE"] == "ghcr.io/wavepp/wavepp:9.9"
    objects = render_chart(helm, "nats.deploy=true", "otlp.endpoint=http://otel:4317")
    env = _env(objects)
    assert env["WAVEPP_DEFAULT_NATS_URL"] == "nats://wavepp-nats.wavepp-system.svc:4222"
    assert env["WAVEPP_DEFAULT_OTLP_ENDPOINT"] == "http://otel:4317"
    assert {o["metadata"]["name"] for o in objects if o["kind"] in ("Service", "Deployment")} >= {
        "wavepp-nats"
    }
    assert not any(o["metadata"]["name"] == "wavepp-nats" for o in render_chart(helm))


def test_chart_crd_is_the_generated_crd(helm: str) -> None:
    assert (CHART / "crds" / "wavepipelines.wavepp.dev.yaml").read_text() == render_crd()
    crds = [o for o in render_chart(helm) if o["kind"] == "CustomResourceDefinition"]
    assert [c["metadata"]["name"] for c in crds] == ["wavepipelines.wavepp.dev"]


def test_operator_role_is_least_privilege(helm: str) -> None:
    role = next(
        o
        for o in render_chart(helm)
        if o["kind"] == "ClusterRole" and o["metadata"]["name"] == "wavepp"
    )
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"], rule
        assert "escalate" not in rule["verbs"] and "bind" not in rule["verbs"], rule
    granted = {
        (g, r) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
    }
    # It writes each pipeline's NATS credentials (server-side apply) but never reads a Secret.
    secret_verbs = {
        v for rule in role["rules"] if "secrets" in rule["resources"] for v in rule["verbs"]
    }
    assert secret_verbs == {"create", "patch"}, secret_verbs
    assert not any(r.startswith("roles") or r.startswith("clusterroles") for _, r in granted)


def test_install_helm_is_idempotent(helm: str) -> None:
    """A second run finds the checked binary and does nothing (no download)."""
    if Path(helm) != REPO / ".venv" / "bin" / "helm":
        pytest.skip(f"helm comes from {helm}, not from scripts/install-helm.sh")
    result = subprocess.run(
        ["bash", str(REPO / "scripts" / "install-helm.sh")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert "already at" in result.stdout and "fetching" not in result.stdout


def _deployment(objects: list[dict], name: str) -> dict:
    return next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == name)


def test_nats_auth_is_on_by_default_and_insecure_is_explicit(helm: str) -> None:
    """Default: the chart's NATS loads the operator-mode auth config and the operator gets the
    account seed (from one Secret); nats.insecure=true drops both and tells the operator."""
    objects = render_chart(helm, "nats.deploy=true")
    nats = _deployment(objects, "wavepp-nats")["spec"]["template"]["spec"]
    assert "--config=/etc/nats-auth/auth.conf" in nats["containers"][0]["args"]
    assert nats["volumes"][-1]["secret"] == {
        "secretName": "wavepp-nats-auth",
        "items": [{"key": "auth.conf", "path": "auth.conf"}],
    }
    env = _env(objects)
    assert env["WAVEPP_NATS_ACCOUNT_SEED_FILE"] == "/etc/wavepp-nats-account/account.seed"
    assert "WAVEPP_INSECURE_NATS" not in env
    operator = _deployment(objects, "wavepp-operator")["spec"]["template"]["spec"]
    assert {"key": "account.seed", "path": "account.seed"} in operator["volumes"][-1]["secret"][
        "items"
    ]

    insecure = render_chart(helm, "nats.deploy=true", "nats.insecure=true")
    nats = _deployment(insecure, "wavepp-nats")["spec"]["template"]["spec"]
    assert not any("--config" in a for a in nats["containers"][0]["args"])
    env = _env(insecure)
    assert env["WAVEPP_INSECURE_NATS"] == "1" and "WAVEPP_NATS_ACCOUNT_SEED_FILE" not in env


def test_namespace_scoped_install_uses_roles_and_watches_only_those_namespaces(helm: str) -> None:
    objects = render_chart(helm, "watchNamespaces={team-a,team-b}")
    roles = [o for o in objects if o["kind"] in ("Role", "RoleBinding")]
    assert sorted((o["kind"], o["metadata"]["namespace"]) for o in roles) == [
        ("Role", "team-a"), ("Role", "team-b"), ("RoleBinding", "team-a"), ("RoleBinding", "team-b"),
    ]  # fmt: skip
    operator_roles = [
        o for o in objects if o["kind"] == "ClusterRole" and o["metadata"]["name"] == "wavepp"
    ]
    assert operator_roles == [] and not any(o["kind"] == "ClusterRoleBinding" for o in objects)
    deployment = next(o for o in objects if o["metadata"]["name"] == "wavepp-operator")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args
    cluster_wide = render_chart(helm)
    deployment = next(o for o in cluster_wide if o["metadata"]["name"] == "wavepp-operator")
    assert not any(
        a.startswith("--namespace")
        for a in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    )


def test_nats_takes_clients_only_from_wavepp_pods(helm: str) -> None:
    objects = render_chart(helm, "nats.deploy=true")
    policy = next(
        o
        for o in objects
        if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "wavepp-nats"
    )
    nats = next(
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "wavepp-nats"
    )
    selected = policy["spec"]["podSelector"]["matchLabels"]
    assert selected.items() <= nats["spec"]["template"]["metadata"]["labels"].items()
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 4222}]
    assert rule["from"] == [
        {
            "namespaceSelector": {},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "wavepp"}},
        }
    ]
    # Pipeline pods carry that label (the operator's children).
    from wavepp.operator.naming import base_labels

    assert base_labels("p", "stage")["app.kubernetes.io/name"] == "wavepp"
    assert not any(
        o["metadata"]["name"] == "wavepp-nats"
        for o in render_chart(helm)
        if o["kind"] == "NetworkPolicy"
    )
