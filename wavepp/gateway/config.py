"""The gateway's configuration (``GatewayConfig``: what ``wavepp up`` and the operator write for
the gateway process, one ``ReplicaInfo`` per replica) and the errors its engine
(``gateway.core.Gateway``) raises to the HTTP layer. Pure: no NATS, no I/O."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

from wavepp.gateway.router import RoutingPolicy
from wavepp.gateway.tenants import TenantPolicy
from wavepp.gateway.validation import PromptLimits
from wavepp.telemetry.settings import TelemetrySettings

# Seconds a client is told to wait (``Retry-After``) when the intake refuses a request.
INTAKE_RETRY_AFTER_S = 2.0
# Seconds a client is told to wait when the replica failed its request for a transient cause
# (``PrefillResult.retryable``: a stage not answering, its replica re-forming).
REPLICA_RETRY_AFTER_S = 2.0


class IntakeUnavailable(Exception):
    """JetStream refused the request before accepting it (store full, JetStream disabled):
    HTTP 503 with ``Retry-After`` = ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ReplicaInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pipeline: str
    num_stages: int = Field(ge=1)
    # KV blocks of each stage: the router's index of that stage holds at most this many hashes
    # (empty: router.DEFAULT_STAGE_BLOCKS each).
    stage_blocks: list[int] = Field(default_factory=list)


class GatewayConfig(BaseModel):
    """Everything the gateway process needs (``wavepp up`` writes it from the spec)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    pool: str
    # NOTE: the pool's Kubernetes namespace ($WAVEPP_NAMESPACE; "local" for wavepp up): part of
    # every subject, stream and bucket name (wavepp.api.subjects).
    namespace: str = Field("local", pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
    replicas: list[ReplicaInfo] = Field(min_length=1)
    model_name: str
    model_id: str
    block_size: int = Field(ge=1)
    vocab_size: int = Field(ge=1)
    max_prompt_tokens: int = Field(ge=1)
    tenants: list[TenantPolicy] = Field(min_length=1)
    routing: RoutingPolicy = "prefix"
    max_outstanding_per_replica: int = Field(8, ge=1)
    # NOTE: a global bound on requests queued or running in this gateway. Past it a request is
    # refused at once (429, field "queue") instead of waiting: when the stages cannot reserve
    # (memory pressure) the fair-share queue would otherwise grow without bound.
    max_queued_requests: int = Field(1024, ge=1)
    queue_retry_after_s: float = Field(1.0, gt=0)
    request_timeout_s: float = Field(120.0, gt=0)
    replica_timeout_s: float = Field(3.0, gt=0)
    # NOTE: a replica silent this long is dropped from the router (scaled away); one that
    # beats again is added back. Replicas of this pool beyond max_replicas are not added.
    replica_forget_s: float = Field(60.0, gt=0)
    # NOTE: a request published to a replica in the pool that then leaves it (a stage died)
    # with no other replica to take it fails this long after (503), instead of waiting for the
    # replica to re-form; one published while no replica was in the pool waits (durable intake).
    replica_unready_fail_s: float = Field(3.0, gt=0)
    max_replicas: int = Field(256, ge=1)
    tokenizer: str | None = None
    # Decode endpoints (base URLs of OpenAI-compatible vLLM servers with WavePP's KV connector
    # as kv_consumer): with any, /v1/completions serves whole completions (gateway.decode_flow),
    # max_tokens up to decode_max_tokens; without, prefill only (max_tokens 1).
    decode_urls: list[Annotated[str, Field(pattern=r"^https?://[^/\s]+/?$")]] = Field(
        default_factory=list, max_length=256
    )
    decode_max_tokens: int = Field(4096, ge=2)
    decode_timeout_s: float = Field(120.0, gt=0)
    # Tracing of the gateway process (the pipeline's exporter and sampling ratio; spans of
    # whole completions, gateway.decode_flow). The gateway serves its metrics on its own HTTP
    # port: telemetry.metrics_port is refused here.
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)
    # API keys (wavepp.gateway.auth): on when any tenant has api_keys_file.
    auth_poll_s: float = Field(1.0, ge=0)
    auth_failure_burst: int = Field(10, ge=1)
    auth_failures_per_s: float = Field(0.2, gt=0)

    @model_validator(mode="after")
    def _check_telemetry(self) -> GatewayConfig:
        if self.telemetry.metrics_port is not None:
            raise ValueError(
                "telemetry.metrics_port: the gateway serves /metrics on its own port; leave it "
                "unset here"
            )
        return self

    @property
    def limits(self) -> PromptLimits:
        return PromptLimits(
            vocab_size=self.vocab_size,
            max_prompt_tokens=self.max_prompt_tokens,
            tenants=frozenset(t.name for t in self.tenants),
            max_new_tokens=self.decode_max_tokens if self.decode_urls else 1,
        )


class ReplicaUnavailable(RuntimeError):
    """The replica a request was admitted on left the pool and no other replica is in it."""
