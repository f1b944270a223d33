"""The results bucket as a replica sees it: what an answer is, what is kept, what is trusted.

``result_from_outcome`` turns a scheduler outcome into the client's ``PrefillResult``.
``ResultStore`` keeps each answer in the pool's JetStream results bucket under its key
(``{tenant}.{request_id}``) so a redelivery or a duplicate is answered from it, not run again;
an entry is trusted only when its reader's check accepts it (``result_is_authentic``: signed
by the replica it names). The admission service and the gateway each own one store.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError

from wavepp.api.prefill import IntakeRequest, PrefillResult, StageTiming
from wavepp.api.signing import BusKey
from wavepp.runtime.request import RequestOutcome
from wavepp.runtime.transport.jetstream import ensure_results
from wavepp.runtime.transport.natsio import resend_after_reconnect

log = logging.getLogger(__name__)


def result_from_outcome(
    request: IntakeRequest,
    outcome: RequestOutcome,
    *,
    replica: str,
    stages: list[StageTiming],
    transfer: dict[str, Any] | None = None,
) -> PrefillResult:
    """The client's answer from a scheduler outcome. Times in seconds; TTFT from the gateway's
    arrival (``request.arrival_s``, wall clock) to the first token. ``transfer``: a handed-off
    request's ``kv_transfer_params`` (``serving.handoff``)."""
    return PrefillResult(
        request_id=request.request_id,
        tenant=request.tenant,
        replica=replica,
        first_token_id=outcome.first_token_id,
        num_prompt_tokens=outcome.num_prompt_tokens,
        num_cached_tokens=outcome.num_cached_tokens,
        ttft_s=max(0.0, outcome.finished_s - request.arrival_s),
        queue_s=request.queued_s,
        agreement_s=outcome.agreement_s,
        admission_s=max(0.0, (outcome.admitted_s or outcome.finished_s) - outcome.arrival_s),
        execute_s=max(0.0, outcome.finished_s - (outcome.first_scheduled_s or outcome.finished_s)),
        stage_hits=list(outcome.stage_hits),
        stage_host_hits=list(outcome.stage_host_hits),
        stages=stages,
        error=outcome.error,
        retryable=outcome.is_retryable,
        kv_transfer_params=transfer,
    )


def result_is_authentic(bus_key: BusKey | None, key: str, result: PrefillResult) -> bool:
    """A results-bucket entry under ``key`` (``{tenant}.{request_id}``) is a result for that
    key signed by the replica it names; without a bus key, any result for ``key``."""
    if f"{result.tenant}.{result.request_id}" != key:
        return False
    return bus_key is None or bus_key.for_replica(result.replica).verify(result)


class StoredResult(NamedTuple):
    """A trusted results-bucket entry: its bytes as stored (republished as they are) and the
    result they hold."""

    data: bytes
    result: PrefillResult


class ResultStore:
    """The pool's results bucket, read and written by an admission service and a gateway.

    Args:
        nc: the process's NATS connection (owned by the caller).
        js: its JetStream context (calls wait out a paused server for its timeout).
        trusted: whether an entry under a key (``{tenant}.{request_id}``) is one a replica of
            the pool stored (``result_is_authentic``, or the gateway's ``BusGuard.stored``);
            an entry it refuses is never an answer.
    """

    def __init__(
        self, nc: NATS, js: JetStreamContext, trusted: Callable[[str, PrefillResult], bool]
    ) -> None:
        self.nc = nc
        self.js = js
        self.trusted = trusted
        self._kv = None  # the results bucket, opened right before the intake subscription

    @property
    def is_open(self) -> bool:
        """``open`` returned: the bucket exists and is bound."""
        return self._kv is not None

    async def open(self, pool: str, namespace: str) -> None:
        """Create (or bind) the pool's results bucket."""
        self._kv = await ensure_results(self.js, pool, namespace=namespace)

    async def put(self, key: str, data: bytes) -> None:
        """Keep the result for duplicates and redeliveries. A store that refuses it (full,
        JetStream disabled) or stays silent past the JetStream context's timeout costs only
        that record: the result is still answered and the message acked, never redelivered to
        run again and again against a full store (which held accepted requests until the
        gateway's 504)."""
        assert self._kv is not None, "results bucket opened before serving"
        try:
            await resend_after_reconnect(
                self.nc, functools.partial(self._kv.put, key, data), what=f"result of {key}"
            )
        except Exception as exc:  # noqa: BLE001 - APIError, NoResponders, timeout: same answer
            log.warning("result of %s not stored (%r); answered without the record", key, exc)

    async def get(self, key: str) -> StoredResult | None:
        """The stored result for ``key``; None when there is none, or it is not a
        ``PrefillResult`` the ``trusted`` check accepts (an entry planted by a client).

        Raises:
            what the lookup raises past a reconnect (a server that stays away).
        """
        assert self._kv is not None, "results bucket opened before serving"
        try:
            entry = await resend_after_reconnect(
                self.nc, functools.partial(self._kv.get, key), what=f"results lookup of {key}"
            )
        except KeyNotFoundError:
            return None
        try:
            result = PrefillResult.model_validate_json(entry.value or b"")
        except ValueError:
            result = None
        if result is None or not self.trusted(key, result):
            log.error("results bucket entry %s ignored: not a result a replica stored", key)
            return None
        return StoredResult(entry.value or b"", result)
