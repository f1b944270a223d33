"""The operator's Kubernetes API access: lightkube's async client, logged in as kopf is.

Children are written with **server-side apply** (``PATCH``, ``application/apply-patch+yaml``,
``fieldManager=wavepp-operator``, ``force=true``): the API server creates an absent object,
records which fields the operator owns, removes fields the operator stopped sending, takes back
fields another writer changed (``spec.replicas`` set by hand) and leaves alone the fields only
others own (defaults, annotations the operator merge-patches). No client-side diff, no
last-applied annotation.

Objects travel as plain dicts (lightkube's generic resources): the builders write dicts and the
planner reads them, and a dict decodes whatever the server sends (lightkube's typed models reject
an object that lacks a field the schema requires, and drop fields newer than the models).

Login: :func:`kubeconfig_from_kopf` turns the :class:`kopf.ConnectionInfo` that kopf logged in
with (service account, kubeconfig, or the ``kubernetes`` client's parsing for exec plugins) into
a lightkube configuration, so both clients use one set of credentials. lightkube builds the TLS
context: inline certificate data passes through a ``NamedTemporaryFile`` that is deleted as soon
as the context has loaded it, so nothing is left in the temp directory.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx2
import kopf
from lightkube import AsyncClient, KubeConfig
from lightkube.config.models import Cluster, User
from lightkube.generic_resource import GenericNamespacedResource, create_namespaced_resource
from lightkube.types import CascadeType, PatchType

FIELD_MANAGER = "wavepp-operator"

# What a failed call raises: HTTP status errors (lightkube's ApiError is one; an error body whose
# content type is not exactly application/json comes as the plain httpx error), transport errors.
API_ERRORS: tuple[type[BaseException], ...] = (httpx2.HTTPError, TimeoutError)

# kind -> generic (dict-backed) resource class; the kinds the operator reads or writes.
# NOTE: lightkube registers these classes by (apiVersion, kind); nothing in the operator loads
# lightkube's typed models for the same kinds, which would conflict.
RESOURCES: dict[str, type[GenericNamespacedResource]] = {
    kind: create_namespaced_resource(group, version, kind, plural)
    for kind, group, version, plural in (
        ("ConfigMap", "", "v1", "configmaps"),
        ("Secret", "", "v1", "secrets"),
        ("Service", "", "v1", "services"),
        ("Pod", "", "v1", "pods"),
        ("StatefulSet", "apps", "v1", "statefulsets"),
        ("Deployment", "apps", "v1", "deployments"),
        ("HorizontalPodAutoscaler", "autoscaling", "v2", "horizontalpodautoscalers"),
        ("PodDisruptionBudget", "policy", "v1", "poddisruptionbudgets"),
        ("NetworkPolicy", "networking.k8s.io", "v1", "networkpolicies"),
        ("PodGroup", "scheduling.x-k8s.io", "v1alpha1", "podgroups"),
        ("InferencePool", "inference.networking.k8s.io", "v1", "inferencepools"),
        ("WavePipeline", "wavepp.dev", "v1alpha1", "wavepipelines"),
    )
}

T = TypeVar("T")


class ApplyRefused(RuntimeError):
    """The API server refused a child (a 4xx other than 404/409/429: invalid, forbidden);
    the status names it (condition ``Degraded``, reason ``ApplyFailed``)."""


def resource(kind: str) -> type[GenericNamespacedResource]:
    """The lightkube resource class of ``kind``.

    Raises:
        ValueError: unknown kind.
    """
    if kind not in RESOURCES:
        raise ValueError(f"kind={kind!r} is not one of {sorted(RESOURCES)}")
    return RESOURCES[kind]


def status_code(exc: BaseException) -> int | None:
    """The HTTP status of a failed call, None for a transport error."""
    response = getattr(exc, "response", None)
    return None if response is None else response.status_code


def _text(value: str | bytes | os.PathLike[Any] | None) -> str | None:
    return None if value is None else os.fsdecode(value)


def kubeconfig_from_kopf(info: kopf.ConnectionInfo) -> KubeConfig:
    """The lightkube configuration of the credentials kopf logged in with.

    Args:
        info: server, CA (path or base64 data), ``insecure``, client certificate and key (paths or
            base64 data), bearer token or basic auth, default namespace.

    Returns:
        A one-context KubeConfig.

    Raises:
        ValueError: an authorization scheme other than Bearer (lightkube sends tokens as Bearer).
    """
    if info.token and info.scheme and info.scheme.lower() != "bearer":
        raise ValueError(
            f"authorization scheme {info.scheme!r} is not supported: only Bearer tokens "
            "(fix: use a token, a client certificate or basic auth in the kubeconfig)"
        )
    cluster = Cluster(
        server=info.server,
        certificate_auth=_text(info.ca_path),
        certificate_auth_data=_text(info.ca_data),
        insecure=bool(info.insecure),
    )
    user = User(
        token=info.token,
        username=info.username,
        password=info.password,
        client_cert=_text(info.certificate_path),
        client_cert_data=_text(info.certificate_data),
        client_key=_text(info.private_key_path),
        client_key_data=_text(info.private_key_data),
    )
    return KubeConfig.from_one(cluster=cluster, user=user, namespace=info.default_namespace)


class KubeClient:
    """lightkube's AsyncClient for the operator's verbs; objects are dicts.

    Holds the current client and the clients replaced by a re-login (closed at the next re-login
    or at :meth:`close`, so that requests still running on them can finish).
    """

    def __init__(
        self,
        info: kopf.ConnectionInfo,
        *,
        relogin: Callable[[], kopf.ConnectionInfo] | None = None,
        timeout_s: float = 30.0,
        transport: Callable[[], httpx2.AsyncBaseTransport] | None = None,
    ) -> None:
        """Open the client (no request yet).

        Args:
            info: the credentials (see :func:`kubeconfig_from_kopf`).
            relogin: called on HTTP 401 for fresh credentials (rotated tokens); the request is
                then repeated once.
            timeout_s: time limit of one request, in seconds.
            transport: makes an httpx transport for each client opened, instead of lightkube's
                default (tests: a User-Agent).
        """
        self._relogin = relogin
        self._timeout = httpx2.Timeout(timeout_s)
        self._transport = transport
        self._client = self._open(info)
        self._retired: list[AsyncClient] = []

    def _open(self, info: kopf.ConnectionInfo) -> AsyncClient:
        return AsyncClient(
            kubeconfig_from_kopf(info),
            timeout=self._timeout,
            field_manager=FIELD_MANAGER,
            trust_env=info.trust_env,  # kopf's settings.networking.trust_env (default False)
            proxy=info.proxy_url,
            transport=None if self._transport is None else self._transport(),
        )

    async def __aenter__(self) -> KubeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the HTTP client(s)."""
        for client in [*self._retired, self._client]:
            await client.close()
        self._retired.clear()

    async def _call(self, request: Callable[[AsyncClient], Awaitable[T]]) -> T:
        client = self._client
        try:
            return await request(client)
        except httpx2.HTTPStatusError as exc:
            if status_code(exc) != 401 or self._relogin is None:
                raise
        if self._client is client:  # the first caller to see the 401 logs in again
            for old in self._retired:
                await old.close()
            self._retired = [client]
            self._client = self._open(self._relogin())
        return await request(self._client)

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist (404)."""
        res = resource(kind)
        try:
            obj = await self._call(lambda c: c.get(res, name, namespace=namespace))
        except httpx2.HTTPStatusError as exc:
            if status_code(exc) == 404:
                return None
            raise
        return obj.to_dict()

    async def list(
        self, kind: str, namespace: str, labels: dict[str, str] | None = None
    ) -> list[dict[str, Any]]:
        """Objects of ``kind`` in ``namespace`` whose labels equal ``labels``."""
        res = resource(kind)

        async def request(client: AsyncClient) -> list[dict[str, Any]]:
            return [o.to_dict() async for o in client.list(res, namespace=namespace, labels=labels)]

        return await self._call(request)

    async def create(self, body: dict[str, Any]) -> dict[str, Any]:
        """Create ``body`` (its kind and namespace name the collection)."""
        obj = resource(body["kind"])(body)
        return (await self._call(lambda c: c.create(obj))).to_dict()

    async def apply(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply of ``manifest`` as :data:`FIELD_MANAGER`, forcing conflicts.

        NOTE: a dict body goes out as it is (lightkube's ``apply`` takes typed objects only, and
        ``patch`` with the apply type is the same request), so no model drops a field.
        """
        meta = manifest["metadata"]
        res = resource(manifest["kind"])
        applied = await self._call(
            lambda c: c.patch(
                res,
                meta["name"],
                manifest,
                namespace=meta["namespace"],
                patch_type=PatchType.APPLY,
                field_manager=FIELD_MANAGER,
                force=True,
            )
        )
        return applied.to_dict()

    async def patch(
        self,
        kind: str,
        namespace: str,
        name: str,
        patch: dict[str, Any],
        *,
        subresource: str | None = None,
    ) -> dict[str, Any]:
        """JSON merge patch (RFC 7386) of an object, or of its ``status`` subresource."""
        res: Any = resource(kind)
        if subresource == "status":
            res = res.Status
        elif subresource is not None:
            raise ValueError(f"subresource={subresource!r}: only 'status' is patched")
        patched = await self._call(
            lambda c: c.patch(res, name, patch, namespace=namespace, patch_type=PatchType.MERGE)
        )
        return patched.to_dict()

    async def delete(self, kind: str, namespace: str, name: str) -> bool:
        """Delete with background propagation; False when it was already gone."""
        res = resource(kind)
        try:
            await self._call(
                lambda c: c.delete(res, name, namespace=namespace, cascade=CascadeType.BACKGROUND)
            )
        except httpx2.HTTPStatusError as exc:
            if status_code(exc) == 404:
                return False
            raise
        return True
