"""A small async Kubernetes API client (aiohttp) for the operator's handlers.

Why not the ``kubernetes`` package: it is synchronous, and its generated PATCH picks the
JSON-patch content type for dict bodies. The operator needs five verbs (get, list, create,
merge-patch, delete) on a handful of kinds; this client does those with the same credentials
kopf logged in with (:class:`kopf.ConnectionInfo`).

:func:`apply` is the handlers' one write path for children: create when absent, else a JSON
merge patch (RFC 7386) computed against the last applied manifest, which is kept in an
annotation as ``kubectl apply`` does, so that a field removed from the desired manifest is
removed from the object too, and an unchanged manifest costs no write.
"""

from __future__ import annotations

import base64
import json
import ssl
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

LAST_APPLIED = "wavepp.dev/last-applied"

# kind -> (apiVersion, plural); the kinds the operator reads or writes.
KINDS: dict[str, tuple[str, str]] = {
    "ConfigMap": ("v1", "configmaps"),
    "Service": ("v1", "services"),
    "Pod": ("v1", "pods"),
    "StatefulSet": ("apps/v1", "statefulsets"),
    "Deployment": ("apps/v1", "deployments"),
    "HorizontalPodAutoscaler": ("autoscaling/v2", "horizontalpodautoscalers"),
    "WavePipeline": ("wavepp.dev/v1alpha1", "wavepipelines"),
}


class KubeError(Exception):
    """A failed API call: HTTP status, Kubernetes reason, message."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"HTTP {status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


def resource_path(
    kind: str, namespace: str | None, name: str | None = None, subresource: str | None = None
) -> str:
    """URL path of a collection or object, e.g. ``/apis/apps/v1/namespaces/ns/statefulsets/x``.

    Raises:
        ValueError: unknown kind.
    """
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not one of {sorted(KINDS)}")
    api_version, plural = KINDS[kind]
    path = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    if namespace:
        path += f"/namespaces/{namespace}"
    path += f"/{plural}"
    if name:
        path += f"/{name}"
    if subresource:
        path += f"/{subresource}"
    return path


def merge_patch(old: Any, new: Any) -> Any:
    """The RFC 7386 merge patch that turns ``old`` into ``new``; ``{}`` when they are equal.

    Keys absent from ``new`` become ``None`` (delete); dicts recurse; anything else (lists
    included) is replaced whole.
    """
    if not isinstance(old, dict) or not isinstance(new, dict):
        return new
    patch: dict[str, Any] = {}
    for key in old.keys() - new.keys():
        patch[key] = None
    for key, value in new.items():
        if key not in old:
            patch[key] = value
        elif isinstance(old[key], dict) and isinstance(value, dict):
            sub = merge_patch(old[key], value)
            if sub != {}:
                patch[key] = sub
        elif old[key] != value:
            patch[key] = value
    return patch


@dataclass
class Credentials:
    """What the client needs from kopf's ConnectionInfo."""

    server: str
    headers: dict[str, str]
    ssl_context: ssl.SSLContext | bool


def credentials_from_kopf(info: Any) -> Credentials:
    """Build :class:`Credentials` from a :class:`kopf.ConnectionInfo`.

    Args:
        info: a ConnectionInfo (server, CA, client certificate, token or basic auth).

    Returns:
        Credentials with an SSL context honouring the CA, client certificate and ``insecure``.
    """
    context: ssl.SSLContext | bool = True
    if info.server.startswith("https"):
        context = ssl.create_default_context()
        if info.insecure:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if info.ca_path:
            context.load_verify_locations(cafile=info.ca_path)
        elif info.ca_data:
            data = info.ca_data
            pem = base64.b64decode(data).decode() if isinstance(data, str | bytes) else data
            context.load_verify_locations(cadata=pem)
        cert = info.certificate_path
        key = info.private_key_path
        if info.certificate_data and info.private_key_data:
            cert = _write_temp(base64.b64decode(info.certificate_data))
            key = _write_temp(base64.b64decode(info.private_key_data))
        if cert:
            context.load_cert_chain(certfile=cert, keyfile=key)
    return Credentials(
        server=info.server.rstrip("/"), headers=info.as_http_headers(), ssl_context=context
    )


def _write_temp(data: bytes) -> str:
    with tempfile.NamedTemporaryFile(prefix="wavepp-", suffix=".pem", delete=False) as f:
        f.write(data)
        return f.name


class KubeClient:
    """Async client over one aiohttp session; open with ``async with`` or call :meth:`close`."""

    def __init__(
        self,
        credentials: Credentials,
        *,
        relogin: Callable[[], Credentials] | None = None,
        timeout_s: float = 30.0,
        user_agent: str = "wavepp-operator",
    ) -> None:
        """Open a session (no request yet).

        Args:
            credentials: server, auth headers, TLS.
            relogin: called once on HTTP 401 to fetch fresh credentials (rotated tokens).
            timeout_s: total time limit of one request, in seconds.
            user_agent: User-Agent header (audit logs tell the operator's writes apart).
        """
        self._credentials = credentials
        self._relogin = relogin
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=timeout_s), headers={"User-Agent": user_agent}
        )

    async def __aenter__(self) -> KubeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the HTTP session."""
        await self._session.close()

    async def _request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: dict[str, str] | None = None,
        content_type: str = "application/json",
        retry_auth: bool = True,
    ) -> dict[str, Any]:
        data = None if body is None else json.dumps(body)
        creds = self._credentials
        async with self._session.request(
            method,
            creds.server + path,
            data=data,
            params=params,
            headers=creds.headers | {"Content-Type": content_type, "Accept": "application/json"},
            ssl=creds.ssl_context,
        ) as response:
            text = await response.text()
            payload = json.loads(text) if text else {}
            if response.status == 401 and retry_auth and self._relogin is not None:
                self._credentials = self._relogin()
                return await self._request(
                    method,
                    path,
                    body=body,
                    params=params,
                    content_type=content_type,
                    retry_auth=False,
                )
            if response.status >= 400:
                raise KubeError(
                    response.status,
                    str(payload.get("reason", response.reason)),
                    str(payload.get("message", text[:200])),
                )
            return payload

    async def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist (404)."""
        try:
            return await self._request("GET", resource_path(kind, namespace, name))
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(
        self, kind: str, namespace: str | None, label_selector: str | None = None
    ) -> list[dict[str, Any]]:
        """Objects of ``kind`` in ``namespace`` (all namespaces when None) matching the selector.

        NOTE: the selector is also applied here (equality terms only), so a server that ignores
        ``labelSelector`` (the test emulator) returns the same answer as a real one.
        """
        params = {"labelSelector": label_selector} if label_selector else None
        payload = await self._request("GET", resource_path(kind, namespace), params=params)
        items = payload.get("items") or []
        if label_selector:
            wanted = dict(term.split("=", 1) for term in label_selector.split(","))
            items = [
                item
                for item in items
                if all(
                    (item.get("metadata", {}).get("labels") or {}).get(k) == v
                    for k, v in wanted.items()
                )
            ]
        return items

    async def create(self, body: dict[str, Any]) -> dict[str, Any]:
        """Create ``body`` (its kind and namespace name the collection)."""
        meta = body["metadata"]
        return await self._request(
            "POST", resource_path(body["kind"], meta.get("namespace")), body=body
        )

    async def patch(
        self,
        kind: str,
        namespace: str | None,
        name: str,
        patch: dict[str, Any],
        *,
        subresource: str | None = None,
    ) -> dict[str, Any]:
        """JSON merge patch (``application/merge-patch+json``) of an object or a subresource."""
        return await self._request(
            "PATCH",
            resource_path(kind, namespace, name, subresource),
            body=patch,
            content_type="application/merge-patch+json",
        )

    async def delete(self, kind: str, namespace: str | None, name: str) -> bool:
        """Delete with background propagation; False when it was already gone."""
        try:
            await self._request(
                "DELETE",
                resource_path(kind, namespace, name),
                body={
                    "kind": "DeleteOptions",
                    "apiVersion": "v1",
                    "propagationPolicy": "Background",
                },
            )
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
        return True


def with_last_applied(desired: dict[str, Any]) -> dict[str, Any]:
    """``desired`` plus the annotation that records it (canonical JSON, sorted keys)."""
    record = json.dumps(desired, sort_keys=True, separators=(",", ":"))
    meta = dict(desired["metadata"])
    meta["annotations"] = dict(meta.get("annotations") or {}) | {LAST_APPLIED: record}
    return desired | {"metadata": meta}


def _scalar_drift(live: dict[str, Any], desired: dict[str, Any]) -> dict[str, Any]:
    """Scalars of ``desired`` (in nested dicts, not in lists) whose live value differs."""
    drift: dict[str, Any] = {}
    for key, value in desired.items():
        current = live.get(key)
        if isinstance(value, dict):
            sub = _scalar_drift(current if isinstance(current, dict) else {}, value)
            if sub:
                drift[key] = sub
        elif not isinstance(value, list) and current != value:
            drift[key] = value
    return drift


def _deep_merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    merged = dict(a)
    for key, value in b.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def apply_patch(existing: dict[str, Any], desired: dict[str, Any]) -> dict[str, Any]:
    """The merge patch that brings ``existing`` to ``desired``; ``{}`` when nothing changes.

    Three-way, as ``kubectl apply``: fields that left the desired manifest since the last apply
    are deleted; fields that changed are set; scalars that someone else changed on the live
    object (``spec.replicas`` set by a direct patch) are set back. Lists are compared with the
    last applied manifest only: the server adds defaults inside them (containers, ports).
    An object without the annotation (created by someone else) gets the whole manifest.
    """
    desired_full = with_last_applied(desired)
    annotations = existing.get("metadata", {}).get("annotations") or {}
    try:
        last = json.loads(annotations[LAST_APPLIED])
    except (KeyError, ValueError):
        return desired_full
    patch = merge_patch(with_last_applied(last), desired_full) if last != desired else {}
    return _deep_merge(patch, _scalar_drift(existing, desired_full))


_UNKNOWN: Any = object()


async def apply(client: KubeClient, desired: dict[str, Any], existing: Any = _UNKNOWN) -> str:
    """Create ``desired`` or patch the existing object towards it.

    Args:
        client: the API client.
        desired: the manifest.
        existing: the live object if the caller has just listed it (None: absent); omitted,
            it is fetched. A stale "absent" is corrected: a 409 on create falls back to a GET.

    Returns:
        "created", "patched" or "unchanged".
    """
    meta = desired["metadata"]
    if existing is _UNKNOWN:
        existing = await client.get(desired["kind"], meta.get("namespace"), meta["name"])
    if existing is None:
        try:
            await client.create(with_last_applied(desired))
            return "created"
        except KubeError as exc:
            if exc.status != 409:
                raise
        existing = await client.get(desired["kind"], meta.get("namespace"), meta["name"])
        if existing is None:
            raise KubeError(409, "Conflict", f"{meta['name']} exists and does not")
    patch = apply_patch(existing, desired)
    if not patch:
        return "unchanged"
    await client.patch(desired["kind"], meta.get("namespace"), meta["name"], patch)
    return "patched"
