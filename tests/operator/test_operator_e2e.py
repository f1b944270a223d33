"""End to end: kopf running the wavepp handlers against kmock's Kubernetes emulator."""

from __future__ import annotations

from typing import Any

from conftest import NAMESPACE, Cluster, tiny_spec, wait_for

from wavepp.operator import builders as b


def _condition(body: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    for c in ((body or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return c
    return {}


async def test_create_makes_owned_children_and_status(cluster: Cluster, operator: Any) -> None:
    created = await cluster.create_pipeline("demo", tiny_spec())
    uid = created["metadata"]["uid"]

    async def children() -> list[dict[str, Any]] | None:
        objs = []
        for kind in ("StatefulSet", "Deployment", "Service", "ConfigMap"):
            objs += await cluster.list(kind, "demo")
        return objs if len(objs) >= 2 * 2 + 2 * 2 + 1 + 1 + 1 + 1 else None

    objs = await wait_for(children, what="children of demo")
    names = {(o["kind"] if "kind" in o else "", o["metadata"]["name"]) for o in objs}
    for o in objs:
        refs = o["metadata"]["ownerReferences"]
        assert refs == [b.owner_reference(b.PipelineRef("demo", NAMESPACE, uid))], o["metadata"]
    assert {n for _, n in names} >= {
        "demo-r0",
        "demo-r1",
        "demo-r0-admission",
        "demo-r1-admission",
        "demo-gateway",
        "demo-pool",
    }
    body = await wait_for(lambda: _status_is(cluster, "demo", replicas=2), what="status.replicas")
    status = body["status"]
    assert status["replicas"] == 2 and status["readyReplicas"] == 0
    assert status["selector"] == "wavepp.dev/pipeline=demo,wavepp.dev/component=stage"
    assert [
        (s["replica"], s["rank"], s["firstLayer"], s["lastLayer"], s["phase"])
        for s in status["stages"]
    ] == [(r, rank, 2 * rank, 2 * rank + 2, "pending") for r in range(2) for rank in range(4)]
    assert _condition(body, "Ready")["status"] == "False"
    assert _condition(body, "Progressing")["reason"] == "Forming"
    assert status["observedGeneration"] == 1


async def _status_is(cluster: Cluster, name: str, **expected: Any) -> dict[str, Any] | None:
    body = await cluster.pipeline(name)
    status = (body or {}).get("status") or {}
    return body if all(status.get(k) == v for k, v in expected.items()) else None
