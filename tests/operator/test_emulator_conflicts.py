"""The test-side API server answers a stale JSON patch as a real one does.

kopf removes finalizers with a JSON patch that first tests metadata.resourceVersion; a real
API server answers a failed test with 422 and kopf re-reads and tries again. kmock raised,
answering 500, and kopf retried the same stale patch nine times: the delete handler's finalizer
stayed and the e2e test timed out waiting for the pipeline to go (flaky, whenever the daemon's
status write landed between kopf's read and its patch).
"""

from __future__ import annotations

import httpx2
from operator_support import NAMESPACE, Cluster


async def test_a_json_patch_with_a_stale_resource_version_gets_422(cluster: Cluster) -> None:
    created = await cluster.client.create(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "cm", "namespace": NAMESPACE, "finalizers": ["x"]},
            "data": {"a": "1"},
        }
    )
    stale = created["metadata"]["resourceVersion"]
    await cluster.client.patch("ConfigMap", NAMESPACE, "cm", {"data": {"a": "2"}})  # bumps it
    url = f"{cluster.server}/api/v1/namespaces/{NAMESPACE}/configmaps/cm"
    ops = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": stale},
        {"op": "remove", "path": "/metadata/finalizers/0"},
    ]
    async with httpx2.AsyncClient() as http:
        response = await http.patch(
            url, json=ops, headers={"Content-Type": "application/json-patch+json"}
        )
        assert response.status_code == 422
        assert (await cluster.get("ConfigMap", "cm"))["metadata"]["finalizers"] == ["x"]
        fresh = (await cluster.get("ConfigMap", "cm"))["metadata"]["resourceVersion"]
        ops[0]["value"] = fresh
        response = await http.patch(
            url, json=ops, headers={"Content-Type": "application/json-patch+json"}
        )
        assert response.status_code == 200
    assert not (await cluster.get("ConfigMap", "cm"))["metadata"].get("finalizers")
