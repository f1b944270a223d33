"""The operator's API client (wavepp/operator/kube.py): login, server-side apply, re-login.

The apply tests run against kmock's emulator, which cannot model server-side apply: it keeps no
field ownership (``managedFields``), so it cannot prune a field the operator stopped sending nor
report conflicts. operator_support.WaveEmulator serves an apply as create-or-merge; these tests
check what the operator sends (verb, content type, field manager, force, body) and the
create-or-merge result. ``scripts/kind-e2e.sh`` runs the operator against a real API server.
"""

from __future__ import annotations

import base64
import copy
import datetime as dt
import json
import logging
import tempfile
from pathlib import Path
from typing import Any

import httpx2
import kopf
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from operator_support import APPLY_PATCH, NAMESPACE, TEST_USER_AGENT, Cluster, tiny_spec, wait_for

from wavepp.operator import kube


def _configmap(data: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "cm", "namespace": NAMESPACE, "labels": {"app": "x"}},
        "data": data,
    }


def _operator_requests(cluster: Cluster) -> list[Any]:
    return [
        r
        for r in list(cluster.emulator)
        if not r.headers.get("User-Agent", "").startswith(TEST_USER_AGENT)
    ]


async def test_apply_is_one_server_side_apply_request(cluster: Cluster) -> None:
    """Approximates server-side apply (kmock keeps no field ownership): the request is a PATCH
    with the apply content type, fieldManager=wavepp-operator and force=true, carrying the
    manifest as it is; an absent object is created, an existing one takes the manifest."""
    info = kopf.ConnectionInfo(server=str(cluster.server))
    async with kube.KubeClient(info) as client:
        created = await client.apply(_configmap({"a": "1"}))
        assert created["data"] == {"a": "1"} and created["metadata"]["uid"]
        # Someone else changes a field the operator owns; the next apply takes it back (force).
        await cluster.client.patch("ConfigMap", NAMESPACE, "cm", {"data": {"a": "edited"}})
        await client.apply(_configmap({"a": "1"}))
        assert (await cluster.get("ConfigMap", "cm"))["data"] == {"a": "1"}
    requests = _operator_requests(cluster)
    assert len(requests) == 2
    for request in requests:
        assert str(request.method.value).upper() == "PATCH"
        assert request.url.path == f"/api/v1/namespaces/{NAMESPACE}/configmaps/cm"
        assert request.headers["Content-Type"] == APPLY_PATCH
        assert request.params == {"fieldManager": kube.FIELD_MANAGER, "force": "true"}
        assert json.loads(request.body) == _configmap({"a": "1"})  # as sent


async def test_get_list_delete_of_absent_and_present_objects(cluster: Cluster) -> None:
    client = cluster.client
    assert await client.get("StatefulSet", NAMESPACE, "none") is None
    assert await client.delete("StatefulSet", NAMESPACE, "none") is False
    await client.create(_configmap({"a": "1"}))
    other = copy.deepcopy(_configmap({}))
    other["metadata"] |= {"name": "other", "labels": {"app": "y"}}
    await client.create(other)
    listed = await client.list("ConfigMap", NAMESPACE)
    assert sorted(o["metadata"]["name"] for o in listed) == ["cm", "other"]
    listed = await client.list("ConfigMap", NAMESPACE, {"app": "y"})
    assert [o["metadata"]["name"] for o in listed] == ["other"]
    with pytest.raises(httpx2.HTTPStatusError) as info:
        await client.create(other)
    assert kube.status_code(info.value) == 409
    assert await client.delete("ConfigMap", NAMESPACE, "other") is True
    assert await client.get("ConfigMap", NAMESPACE, "other") is None


class _Expired(httpx2.AsyncBaseTransport):
    """Answers 401 to everything, as an API server does to an expired token."""

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(401, json={"kind": "Status", "code": 401}, request=request)


async def test_a_401_logs_in_again_and_repeats_the_request(cluster: Cluster) -> None:
    await cluster.client.create(_configmap({"a": "1"}))
    transports = iter([_Expired(), httpx2.AsyncHTTPTransport()])
    logins: list[str] = []

    def relogin() -> kopf.ConnectionInfo:
        logins.append("again")
        return kopf.ConnectionInfo(server=str(cluster.server))

    info = kopf.ConnectionInfo(server=str(cluster.server))
    async with kube.KubeClient(info, relogin=relogin, transport=lambda: next(transports)) as client:
        cm = await client.get("ConfigMap", NAMESPACE, "cm")
    assert cm is not None and cm["data"] == {"a": "1"}
    assert logins == ["again"]


def _pem_pair() -> tuple[bytes, bytes]:
    """A self-signed certificate and its key (PEM), valid for an hour."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "wavepp-test")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=1))
        .not_valid_after(now + dt.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


async def test_login_with_inline_certificates_leaves_no_temporary_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kubeconfig with inline CA, client certificate and key (the ``*-data`` fields): opening
    the client loads them into its TLS context and leaves nothing in the temp directory."""
    cert_pem, key_pem = _pem_pair()

    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode()

    kubeconfig = tmp_path / "kubeconfig.yaml"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "c",
                        "cluster": {
                            "server": "https://127.0.0.1:6443",
                            "certificate-authority-data": b64(cert_pem),
                        },
                    }
                ],
                "users": [
                    {
                        "name": "u",
                        "user": {
                            "client-certificate-data": b64(cert_pem),
                            "client-key-data": b64(key_pem),
                        },
                    }
                ],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "c",
            }
        )
    )
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    temp_dir = tmp_path / "tmp"
    temp_dir.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp_dir))

    info = kopf.login_with_kubeconfig(
        settings=kopf.OperatorSettings(), logger=logging.getLogger("test")
    )
    assert info is not None and info.certificate_data and info.private_key_data
    client = kube.KubeClient(info)
    try:
        assert sorted(temp_dir.iterdir()) == []
    finally:
        await client.close()
    assert sorted(temp_dir.iterdir()) == []


def _count(cluster: Cluster, method: str, plural: str, content_type: str | None = None) -> int:
    return sum(
        1
        for r in _operator_requests(cluster)
        if str(r.method.value).upper() == method
        and r.resource is not None
        and r.resource.plural == plural
        and (content_type is None or r.headers.get("Content-Type") == content_type)
    )


async def test_unchanged_children_cost_no_writes_and_drift_is_taken_back(
    cluster: Cluster, operator: Any
) -> None:
    """The daemon skips the apply of a child it applied with the same manifest and whose
    resourceVersion has not moved since; a write by someone else moves it, and the next pass
    applies again, which sets the operator's fields back."""
    await cluster.create_pipeline("demo", tiny_spec(replicas=1))
    await wait_for(lambda: cluster.get("Deployment", "demo-gateway"), what="children")
    passes = _count(cluster, "GET", "statefulsets")
    await wait_for(lambda: _passes_since(cluster, passes, 2), what="two passes")
    applies = _count(cluster, "PATCH", "statefulsets", APPLY_PATCH)
    passes = _count(cluster, "GET", "statefulsets")
    await wait_for(lambda: _passes_since(cluster, passes, 3), what="three more passes")
    assert _count(cluster, "PATCH", "statefulsets", APPLY_PATCH) == applies

    await cluster.client.patch("StatefulSet", NAMESPACE, "demo-r0", {"spec": {"replicas": 1}})
    await wait_for(lambda: _replicas_are(cluster, "demo-r0", 4), what="replicas set back")
    assert _count(cluster, "PATCH", "statefulsets", APPLY_PATCH) == applies + 1


async def _passes_since(cluster: Cluster, count: int, more: int) -> bool:
    return _count(cluster, "GET", "statefulsets") >= count + more


async def _replicas_are(cluster: Cluster, name: str, replicas: int) -> bool:
    sts = await cluster.get("StatefulSet", name)
    return sts is not None and sts["spec"]["replicas"] == replicas
