"""kopf handlers of the WavePipeline operator: thin, they only list, apply and report.

One daemon per WavePipeline runs the reconcile loop: list the children, ask
:func:`wavepp.operator.reconcile.plan` what to do, apply the actions in order (children by
server-side apply, :mod:`wavepp.operator.kube`), write the status. It wakes up on any event of
the pipeline or of its pods (a pod became ready, failed, went away), when a drain timeout is due,
and every ``resync_s`` seconds. Only the daemon writes, under a per-pipeline lock that the delete
handler shares, so two writers never race. A failed pass raises :class:`kopf.TemporaryError`:
kopf calls the daemon again after the delay.

Settings live in one startup handler; the API client is opened there and closed at cleanup
(kopf's documented pattern for shared settings and clients).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import kopf

from wavepp.api.spec import API_GROUP, API_VERSION, PLURAL
from wavepp.operator import kube
from wavepp.operator.naming import LABEL_PIPELINE
from wavepp.operator.observe import LISTED_KINDS
from wavepp.operator.reconcile import Apply, Create, Defaults, Delete, Observed, Patch, plan
from wavepp.operator.status import apply_failed_status

FINALIZER = "wavepp.dev/operator"
# What a deleted pipeline's handler deletes, in this order: every listed kind but the pods
# (their StatefulSets and Deployments take them) and the optional CRDs' kinds.
CHILD_KINDS = tuple(k for k in LISTED_KINDS if k not in ("Pod", "PodGroup", "InferencePool"))
RETRY_FIRST_S = 0.5  # delay after the first failed pass; doubles per failure in a row
RETRY_MAX_S = 30.0


@dataclass
class OperatorOptions:
    """Operator-wide settings (CLI flags / Helm values)."""

    default_image: str | None = None
    default_nats_url: str | None = None
    default_otlp_endpoint: str | None = None
    resync_s: float = 10.0
    post_events: bool = True
    fast_exit: bool = False  # tests: short kopf idle timeouts so that the operator stops quickly
    nats_account_seed: str | None = None  # set: render each pipeline's NATS credentials
    # Removing a deleted pool's JetStream streams: tries (2 s apart), seconds per try.
    nats_cleanup_tries: int = 3
    nats_cleanup_timeout_s: float = 5.0

    @classmethod
    def from_env(cls) -> OperatorOptions:
        """Defaults from ``WAVEPP_DEFAULT_IMAGE``, ``..._NATS_URL``, ``..._OTLP_ENDPOINT``."""
        return cls(
            default_image=os.environ.get("WAVEPP_DEFAULT_IMAGE") or None,
            default_nats_url=os.environ.get("WAVEPP_DEFAULT_NATS_URL") or None,
            default_otlp_endpoint=os.environ.get("WAVEPP_DEFAULT_OTLP_ENDPOINT") or None,
        )


@dataclass
class OperatorState:
    """Shared by all handlers through kopf's memo (shallow-copied per object, so shared)."""

    options: OperatorOptions
    client: kube.KubeClient | None = None
    wakeups: dict[tuple[str, str], asyncio.Event] = field(default_factory=dict)
    locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)
    unexpected_errors: list[str] = field(default_factory=list)
    # NOTE: set by the cleanup handler before it closes the client: a daemon that kopf has not
    # stopped yet then ends quietly instead of failing against the closed client.
    closing: bool = False
    last_phase: dict[tuple[str, str], str] = field(default_factory=dict)
    reconciled_specs: dict[tuple[str, str], Any] = field(default_factory=dict)
    failures: dict[tuple[str, str], int] = field(default_factory=dict)  # failed passes in a row
    # pipeline -> (kind, name) -> (manifest as canonical JSON, resourceVersion after our apply)
    applied: dict[tuple[str, str], dict[tuple[str, str], tuple[str, str]]] = field(
        default_factory=dict
    )

    def wakeup(self, namespace: str, name: str) -> asyncio.Event:
        """The event that wakes the daemon of one pipeline (created on first use)."""
        return self.wakeups.setdefault((namespace, name), asyncio.Event())

    def lock(self, namespace: str, name: str) -> asyncio.Lock:
        """The lock that serialises writes to one pipeline's children."""
        return self.locks.setdefault((namespace, name), asyncio.Lock())

    def wake(self, namespace: str | None, name: str | None) -> None:
        """Wake the daemon of a pipeline, if it runs."""
        if namespace and name and (namespace, name) in self.wakeups:
            self.wakeups[(namespace, name)].set()

    def retry_delay(self, namespace: str, name: str) -> float:
        """Count one more failed pass; seconds until the next (0.5, 1, 2, ... 30)."""
        count = self.failures.get((namespace, name), 0)
        self.failures[(namespace, name)] = count + 1
        return min(RETRY_FIRST_S * 2**count, RETRY_MAX_S)

    def forget(self, namespace: str, name: str) -> None:
        """Drop what is kept about a pipeline whose daemon stopped for good."""
        tables = (self.wakeups, self.reconciled_specs, self.last_phase, self.failures, self.applied)
        for table in tables:
            table.pop((namespace, name), None)


def connection_info(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """In-cluster service account, else kubeconfig (kopf's parsers; exec plugins via client)."""
    info = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
    has_secret = info is not None and (
        info.token or info.certificate_path or info.certificate_data or info.password
    )
    if info is not None and not has_secret and info.server.startswith("https"):
        try:
            return kopf.login_via_client(**kwargs) or info
        except Exception:  # noqa: BLE001 - fall back to what kopf parsed
            return info
    return info


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """Credentials for kopf itself; the operator's own client uses the same."""
    return connection_info(**kwargs)


def _state(memo: Any) -> OperatorState:
    state = getattr(memo, "state", None)
    if state is None:
        raise kopf.PermanentError("operator state missing: the startup handler did not run")
    return state


@kopf.on.startup()
async def startup(
    settings: kopf.OperatorSettings, memo: Any, logger: logging.Logger, **_: Any
) -> None:
    """Configure kopf, open the API client."""
    options = getattr(memo, "options", None) or OperatorOptions.from_env()
    settings.posting.enabled = options.post_events
    settings.posting.reporting_component = "wavepp-operator"
    settings.scanning.disabled = True  # resources are known; no CRD/namespace watching (RBAC)
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="wavepp.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="wavepp.dev", key="last-handled-configuration"
    )
    settings.watching.server_timeout = 300
    settings.background.instant_exit_timeout = 0.2  # the daemon exits on `stopped` at once
    if options.fast_exit:
        settings.queueing.idle_timeout = 0.2
        settings.queueing.exit_timeout = 0.5
        settings.watching.reconnect_backoff = 0.05
    info = connection_info(settings=settings, logger=logger)
    if info is None:
        raise kopf.PermanentError("no Kubernetes credentials: no service account, no kubeconfig")

    def relogin() -> kopf.ConnectionInfo:
        return connection_info(settings=settings, logger=logger) or info

    memo.state = OperatorState(options=options, client=kube.KubeClient(info, relogin=relogin))
    logger.info(
        "wavepp operator: defaults image=%s nats=%s",
        options.default_image,
        options.default_nats_url,
    )


@kopf.on.cleanup()
async def cleanup(memo: Any, **_: Any) -> None:
    """Close the API client."""
    state = getattr(memo, "state", None)
    if state is not None and state.client is not None:
        state.closing = True
        for wake in state.wakeups.values():
            wake.set()
        await state.client.close()


# ---- reconcile ----------------------------------------------------------------------------


async def _observe(
    client: kube.KubeClient,
    namespace: str,
    name: str,
    *,
    pod_groups: bool = False,
    inference_pools: bool = False,
) -> Observed:
    """The pipeline's children; PodGroups and InferencePools only when its spec asks for them
    (their CRDs are optional)."""
    optional = {"PodGroup": pod_groups, "InferencePool": inference_pools}
    kinds = [kind for kind in LISTED_KINDS if optional.get(kind, True)]
    selector = {LABEL_PIPELINE: name}
    lists = await asyncio.gather(*(client.list(kind, namespace, selector) for kind in kinds))
    return Observed(**{LISTED_KINDS[kind]: objs for kind, objs in zip(kinds, lists, strict=True)})


def _api_error(exc: BaseException) -> str:
    """The API server's message of a failed call (its Status.message), else the error."""
    status = getattr(exc, "status", None)
    message = getattr(status, "message", None)
    response = getattr(exc, "response", None)
    if not message and response is not None:
        try:
            message = response.json().get("message")
        except (ValueError, AttributeError):
            message = None
    return str(message or exc)


def _resource_version(obj: dict[str, Any] | None) -> str | None:
    return ((obj or {}).get("metadata") or {}).get("resourceVersion")


async def _execute(
    client: kube.KubeClient,
    namespace: str,
    action: Any,
    listed: dict[tuple[str, str], dict[str, Any]],
    applied: dict[tuple[str, str], tuple[str, str]],
) -> None:
    """Carry out one action.

    Args:
        listed: the children as just listed, by (kind, name) (Create skips those).
        applied: what this process last applied to each child and the resourceVersion the
            server answered. NOTE: an Apply is skipped when the manifest is the same and the
            listed object still has that resourceVersion (nobody wrote it since, so the apply
            would change nothing): an unchanged pipeline costs no writes.
    """
    if isinstance(action, Apply):
        key = (action.manifest["kind"], action.manifest["metadata"]["name"])
        manifest = json.dumps(action.manifest, sort_keys=True, separators=(",", ":"))
        last = applied.get(key)
        if last is not None and last == (manifest, _resource_version(listed.get(key))):
            return
        result = await client.apply(action.manifest)
        version = _resource_version(result)
        if version is None:
            applied.pop(key, None)
        else:
            applied[key] = (manifest, version)
    elif isinstance(action, Create):
        meta = action.manifest["metadata"]
        if (action.manifest["kind"], meta["name"]) not in listed:
            try:
                await client.create(action.manifest)
            except kube.API_ERRORS as exc:
                if kube.status_code(exc) != 409:
                    raise
    elif isinstance(action, Patch):
        applied.pop((action.kind, action.name), None)  # a later Apply in this pass writes
        try:
            await client.patch(action.kind, namespace, action.name, action.patch)
        except kube.API_ERRORS as exc:
            if kube.status_code(exc) != 404:
                raise
    elif isinstance(action, Delete):
        applied.pop((action.kind, action.name), None)
        await client.delete(action.kind, namespace, action.name)
    else:  # pragma: no cover - plan() returns only the four kinds
        raise AssertionError(f"unknown action {action!r}")


def _target(action: Any) -> tuple[str, str]:
    """(kind, name) of the object an action writes."""
    if isinstance(action, Apply | Create):
        return action.manifest["kind"], action.manifest["metadata"]["name"]
    return action.kind, action.name


def _status_patch(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """Keys of ``new`` that differ from ``old``; ``None`` values delete (merge-patch)."""
    return {k: v for k, v in new.items() if old.get(k) != v and not (v is None and k not in old)}


async def reconcile_pipeline(
    state: OperatorState, namespace: str, name: str, logger: logging.Logger
) -> float | None:
    """One pass: observe, plan, act, report. Returns seconds until a timed step is due."""
    client = state.client
    assert client is not None, "startup opens the client before any daemon runs"
    body = await client.get("WavePipeline", namespace, name)
    if body is None or body.get("metadata", {}).get("deletionTimestamp"):
        return None
    opts = state.options
    raw_spec = body.get("spec") or {}
    observed = await _observe(
        client,
        namespace,
        name,
        pod_groups=bool((raw_spec.get("topology") or {}).get("podGroup")),
        inference_pools=bool((raw_spec.get("inferencePool") or {}).get("enabled")),
    )
    result = plan(
        body,
        observed,
        time.time(),
        Defaults(
            opts.default_image,
            opts.default_nats_url,
            opts.default_otlp_endpoint,
            nats_account_seed=opts.nats_account_seed,
        ),
    )
    listed = observed.index()
    applied = state.applied.setdefault((namespace, name), {})
    refused: str | None = None
    for action in result.actions:
        try:
            await _execute(client, namespace, action, listed, applied)
        except kube.API_ERRORS as exc:
            code = kube.status_code(exc)
            if code is None or not 400 <= code < 500 or code in (404, 409, 429):
                raise
            kind, child = _target(action)
            refused = f"{kind} {child}: HTTP {code}: {_api_error(exc)}"
            break
    status = result.status
    if refused is not None:
        status = apply_failed_status(body, status, refused, time.time())
    else:
        state.reconciled_specs[(namespace, name)] = body.get("spec")
    patch = _status_patch(body.get("status") or {}, status)
    if patch:
        await client.patch("WavePipeline", namespace, name, {"status": patch}, subresource="status")
    if refused is not None:
        logger.warning("the API server refused a child: %s", refused)
        raise kube.ApplyRefused(refused)
    phase = result.status.get("phase", "")
    if state.last_phase.get((namespace, name)) != phase:
        state.last_phase[(namespace, name)] = phase
        message = "; ".join(str(i) for i in result.issues) or f"phase {phase}"
        if result.issues:
            logger.warning("invalid spec: %s", message)
            kopf.warn(body, reason="InvalidSpec", message=message)
        else:
            logger.info("phase %s", phase)
            kopf.info(body, reason=phase or "Unknown", message=message)
    return result.requeue_after_s


@kopf.daemon(API_GROUP, API_VERSION, PLURAL, cancellation_backoff=2.0, cancellation_timeout=5.0)
async def pipeline_daemon(
    name: str,
    namespace: str,
    memo: Any,
    stopped: kopf.DaemonStopped,
    logger: logging.Logger,
    **_: Any,
) -> None:
    """Reconcile loop of one pipeline.

    A failed pass (API error, or a bug: logged and recorded) raises :class:`kopf.TemporaryError`
    with a delay of 0.5 s doubling to 30 s over failures in a row (a pass that succeeds resets
    it); kopf calls the daemon again after it. The state kept about the pipeline survives the
    retry and is dropped when the daemon stops (or by :func:`pipeline_deleted`).
    """
    state = _state(memo)
    wake = state.wakeup(namespace, name)
    while not stopped and not state.closing:
        wake.clear()
        try:
            async with state.lock(namespace, name):
                due_s = await reconcile_pipeline(state, namespace, name, logger)
        except Exception as exc:
            if state.closing:  # the operator is shutting down: its client is closed
                return
            expected = (*kube.API_ERRORS, kube.ApplyRefused)
            if not isinstance(exc, expected):  # a bug must not stop the other pipelines
                logger.exception("unexpected error reconciling %s/%s", namespace, name)
                state.unexpected_errors.append(f"{namespace}/{name}: {exc!r}")
            delay_s = state.retry_delay(namespace, name)
            raise kopf.TemporaryError(
                f"reconcile of {namespace}/{name} failed, retrying in {delay_s:.1f} s: {exc}",
                delay=delay_s,
            ) from exc
        state.failures.pop((namespace, name), None)
        timeout_s = min(t for t in (state.options.resync_s, due_s) if t is not None)
        waiters = [
            asyncio.ensure_future(wake.wait()),
            asyncio.ensure_future(stopped.wait(timeout_s)),
        ]
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()
    state.forget(namespace, name)


@kopf.on.event(API_GROUP, API_VERSION, PLURAL)
def pipeline_event(name: str, namespace: str, spec: Any, meta: Any, memo: Any, **_: Any) -> None:
    """Spec edits (scale subresource included): reconcile now.

    NOTE: events of the operator's own status writes are skipped (spec unchanged since the
    last reconcile), else every status write would cost one more reconcile. A deletion mark
    stops the daemon (kopf sets ``stopped``) and runs :func:`pipeline_deleted`.
    """
    state = getattr(memo, "state", None)
    if state is None:
        return
    if state.reconciled_specs.get((namespace, name)) != dict(spec):
        state.wake(namespace, name)


@kopf.on.event("v1", "pods", labels={LABEL_PIPELINE: kopf.PRESENT})
def pod_event(labels: dict[str, str], namespace: str, memo: Any, **_: Any) -> None:
    """A stage or admission pod changed: reconcile its pipeline now."""
    state = getattr(memo, "state", None)
    if state is not None:
        state.wake(namespace, labels.get(LABEL_PIPELINE))


@kopf.on.delete(API_GROUP, API_VERSION, PLURAL)
async def pipeline_deleted(
    name: str,
    namespace: str,
    spec: Any,
    retry: int,
    memo: Any,
    logger: logging.Logger,
    **_: Any,
) -> None:
    """Delete the children now (owner references let the garbage collector do it too)."""
    state = _state(memo)
    assert state.client is not None, "startup opens the client"
    selector = {LABEL_PIPELINE: name}
    async with state.lock(namespace, name):
        for kind in CHILD_KINDS:
            for obj in await state.client.list(kind, namespace, selector):
                await state.client.delete(kind, namespace, obj["metadata"]["name"])
    await _remove_streams(state, namespace, name, spec, retry, logger)
    state.forget(namespace, name)  # the daemon may have been stopped while kopf delayed a retry
    logger.info("deleted the children of %s/%s", namespace, name)


async def _remove_streams(
    state: OperatorState,
    namespace: str,
    name: str,
    spec: Any,
    retry: int,
    logger: logging.Logger,
) -> None:
    """Remove the pool's JetStream streams and results bucket (external state the garbage
    collector cannot see; the reason the pipeline carries a finalizer). An unreachable NATS is
    retried (``OperatorOptions.nats_cleanup_tries``), then left with a warning (deletion never
    hangs on it)."""
    from wavepp.operator.nats_cleanup import delete_pool_streams

    nats = dict((spec or {}).get("nats") or {})
    url = nats.get("url") or state.options.default_nats_url
    if not url:
        return
    try:
        timeout_s = state.options.nats_cleanup_timeout_s
        removed = await asyncio.wait_for(
            delete_pool_streams(
                url,
                name,
                namespace=namespace,
                timeout_s=timeout_s,
                account_seed=state.options.nats_account_seed,
            ),
            2 * timeout_s,
        )
    except Exception as exc:  # noqa: BLE001 - NATS down, auth refused: retry, then give up
        if retry + 1 < state.options.nats_cleanup_tries:
            message = f"removing the streams of {namespace}/{name}: {exc}"
            raise kopf.TemporaryError(message, delay=2) from exc
        logger.warning("left the JetStream streams of %s/%s on %s: %s", namespace, name, url, exc)
        return
    if removed:
        logger.info("removed JetStream streams %s", removed)
