"""Messages and names shared by the gateway and the admission service (``wavepp admission``).

Subjects and JetStream objects (``{p}`` = a replica's subject prefix ``wavepp.{ns}.{pipeline}``,
``{pool}`` = the pool's name, ``{key}`` = ``{tenant}.{request_id}``):

| name                                  | kind                  | payload / use                       |
| ------------------------------------- | --------------------- | ----------------------------------- |
| ``{p}.intake``                        | JetStream stream      | ``IntakeRequest``; Nats-Msg-Id=key  |
| stream ``WAVEPP_INTAKE_{ns}_{pipeline}`` | work queue, file   | dedup window = duplicates answered once |
| consumer ``admission``                | durable pull          | ack after the result is stored      |
| KV bucket ``WAVEPP_RESULTS_{ns}_{pool}`` | JetStream KV, TTL  | key -> ``PrefillResult`` (idempotence) |
| ``wavepp.{ns}.{pool}.result.{key}``   | publish               | ``PrefillResult`` to the waiting gateway |
| ``{p}.admission.heartbeat``           | publish (every 0.5 s) | ``Heartbeat``                       |
| ``wavepp.{ns}.{pool}.prefill``        | request-reply, queue  | the NATS prefill API of the gateway |
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from wavepp.api.subjects import MAX_PIPELINE_NAME, MAX_POOL_NAME

REQUEST_ID_PATTERN = r"^[A-Za-z0-9_=-][A-Za-z0-9_.=-]{0,127}$"


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid")
    v: int = 1


class IntakeRequest(_Msg):
    """A validated, admitted-by-the-gateway prefill request on its way to a replica."""

    key: str
    request_id: str
    tenant: str
    cache_salt: str
    token_ids: list[int]
    priority: int = 0
    arrival_s: float
    queued_s: float = 0.0  # time spent in the gateway's fair-share queue
    handoff: bool = False  # hand the prompt's KV to a decode engine (PromptRequest.handoff)
    # W3C traceparent of the gateway's span for this prefill ("": not traced there); the
    # admission's ``request`` span becomes its child, so the request is one trace
    traceparent: str = Field("", max_length=55)


class IntakeCancel(_Msg):
    """The gateway gave up on one intake message (it answered the client with an error, or the
    client left): the replica must not serve it, and the KV handoff lease of a prefill already
    under way is released when it ends, not at its expiry. Published to ``{p}.cancel`` of
    every replica the message was published to (``wavepp.api.subjects.cancel_subject``).

    ``key`` and ``arrival_s`` are the ``IntakeRequest``'s: a later request with the same key
    (a client retry, a new ``arrival_s``) is not cancelled by it.
    """

    key: str
    arrival_s: float
    reason: str = Field("", max_length=500)


class StageTiming(BaseModel):
    """One stage's share of a request: summed over the micro-batches holding its chunks."""

    rank: int
    prepare_s: float = 0.0
    execute_s: float = 0.0
    num_agreed_blocks: int = -1


class PrefillResult(_Msg):
    """The answer to one prefill request (HTTP body of ``POST /v1/prefill``)."""

    request_id: str
    tenant: str
    replica: str = ""
    first_token_id: int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    ttft_s: float = 0.0
    queue_s: float = 0.0
    agreement_s: float = 0.0
    admission_s: float = 0.0
    execute_s: float = 0.0
    stage_hits: list[int] = Field(default_factory=list)
    stage_host_hits: list[int] = Field(default_factory=list)  # the host-tier part of each
    stages: list[StageTiming] = Field(default_factory=list)
    error: str = ""
    # The error has a transient cause (a stage did not answer: down, or its replica re-forming):
    # the same request may succeed when sent again (the gateway answers 503 with Retry-After).
    retryable: bool = False
    # A handed-off request's (IntakeRequest.handoff): what the decode request consumes, the
    # shape of wavepp.runtime.serving.handoff.kv_transfer_params (it holds the pull token).
    kv_transfer_params: dict[str, Any] | None = None
    mac: str = Field(default="", max_length=64)  # wavepp.api.signing: HMAC tag, "" unsigned


class Heartbeat(_Msg):
    """An admission service's liveness: ``ready`` when every stage answered its last probe
    (its group formed, the engine built) and no re-form is under way. ``pool`` and
    ``num_stages`` let a gateway add a replica it was not configured with ("": unknown).
    ``draining``: told to stop (SIGTERM on a scale-down or a rollout), it admits nothing new
    and finishes what its intake holds (its stages are formed); ``ready`` is then False."""

    pipeline: str = Field(max_length=MAX_PIPELINE_NAME)  # bounded: a gateway may remember it
    ready: bool
    num_stages_formed: int
    num_inflight: int
    instance: str = Field(max_length=64)
    pool: str = Field(default="", max_length=MAX_POOL_NAME)
    num_stages: int = 0
    draining: bool = False
    seq: int = Field(default=0, ge=0)  # grows by one per heartbeat of this instance
    sent_at_s: float = 0.0  # wall clock (time.time()) at publish
    mac: str = Field(default="", max_length=64)  # wavepp.api.signing: HMAC tag, "" unsigned
