"""Every pod the operator or the chart makes runs non-root on a read-only root filesystem."""

from __future__ import annotations

from typing import Any

from operator_support import render_chart
from test_operator_builders import FULL, _all_children


def _pod_specs(objects: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [
        (obj["metadata"]["name"], obj["spec"]["template"]["spec"])
        for obj in objects
        if obj and obj.get("kind") in ("StatefulSet", "Deployment")
    ]


def _check(name: str, pod: dict[str, Any]) -> None:
    pod_ctx = pod.get("securityContext", {})
    assert pod_ctx.get("runAsNonRoot") is True, name
    assert pod_ctx.get("runAsUser", 0) != 0, name
    mounts_tmp = {v["name"] for v in pod.get("volumes", []) if "emptyDir" in v}
    for container in pod["containers"]:
        ctx = container.get("securityContext", {})
        assert ctx.get("readOnlyRootFilesystem") is True, (name, container["name"])
        assert ctx.get("allowPrivilegeEscalation") is False, (name, container["name"])
        assert ctx.get("capabilities", {}).get("drop") == ["ALL"], (name, container["name"])
        writable = [m for m in container.get("volumeMounts", []) if m["name"] in mounts_tmp]
        assert writable, f"{name}/{container['name']}: no writable emptyDir (e.g. /tmp)"


def test_pipeline_pods_are_non_root_and_read_only() -> None:
    specs = _pod_specs(_all_children(FULL))
    assert {n for n, _ in specs} >= {"big-r0", "big-r1"}  # stage StatefulSets are checked too
    for name, pod in specs:
        _check(name, pod)


def test_chart_pods_are_non_root_and_read_only(helm: str) -> None:
    specs = _pod_specs(render_chart(helm, "nats.deploy=true"))
    assert len(specs) >= 2  # the operator and the bundled NATS
    for name, pod in specs:
        _check(name, pod)
