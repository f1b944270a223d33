"""Messages between the admission (agreement controller, wave scheduler) and the stages.

Every message is a pydantic model serialised as JSON on a NATS subject. Each carries the protocol
version ``v`` (``PROTOCOL_VERSION``, also the version byte of the binary agreement rounds,
``wavepp.api.kv_batch`` and ``wavepp.api.kv_reply``); a receiver rejects a message of another
version with a clear error instead of misreading it, and an admission refuses stages whose health
reply names another version (``wavepp.runtime.agreement.coordinator.check_stage_versions``).
Block hashes travel as lowercase hex strings (32-byte sha256 digests).

Subjects (``{p}`` is the pipeline's subject prefix, e.g. ``wavepp.default``):

| subject                         | pattern        | payload                          |
| ------------------------------- | -------------- | -------------------------------- |
| ``{p}.stage.{rank}.kv``         | request-reply  | ``KVRequest`` -> ``KVReply``     |
| ``{p}.plan``                    | publish        | ``MicroBatchPlan`` (all stages)  |
| ``{p}.done``                    | publish        | ``MicroBatchDone`` (every stage) |
| ``{p}.kv_events.{rank}``        | publish        | ``KVEventBatch``                 |
| ``{p}.plan.resend``             | request-reply  | ``PlanResend`` -> ``PlanResendReply`` |
| ``{p}.stage.{rank}.dones``      | request-reply  | ``DoneResend`` -> ``DoneResendReply`` |
| ``{p}.resync``                  | publish        | ``StageResync`` (a stage reconnected) |

Plans and done messages are core NATS (at most once); the resend subjects make their delivery
gap-free across a NATS reconnect (see ``wavepp.runtime.stage.sequencing``).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator

PROTOCOL_VERSION = 2
"""The one version of the bus protocol: JSON messages (``v``), agreement batches and replies."""

RequestId = Annotated[str, Field(min_length=1, max_length=256)]
HexHash = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


def _this_version() -> int:
    return PROTOCOL_VERSION


class _Message(BaseModel):
    """A JSON bus message: ``v`` is this build's ``PROTOCOL_VERSION`` (the default), and a
    message naming another version is refused (a ValidationError on ``v``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    v: int = Field(default_factory=_this_version)

    @field_validator("v")
    @classmethod
    def _same_version(cls, value: int) -> int:
        if value != PROTOCOL_VERSION:
            raise ValueError(f"protocol version {value}; this build speaks {PROTOCOL_VERSION}")
        return value


# --------------------------------------------------------------------------- agreement (KV ops)


class Renew(_Message):
    """Extend the leases of ``request_ids`` by ``lease_s`` from now."""

    op: Literal["renew"] = "renew"
    request_ids: list[RequestId]
    lease_s: float = Field(gt=0, le=3600)
    owner: str = Field(default="", max_length=64)  # the admission instance holding it
    seq: int = Field(
        default=0, ge=0
    )  # grows by one per op of this owner (signed: a repeat is refused)
    mac: str = Field(default="", max_length=64)  # wavepp.api.signing: HMAC tag, "" unsigned


class Health(_Message):
    """Ask a stage whether it is formed (process group up, KV allocated, engine built)."""

    op: Literal["health"] = "health"  # read-only: never signed, never checked


KVRequestMessage = Renew | Health
"""Any message a stage's KV endpoint accepts (``{p}.stage.{rank}.kv``)."""

KVRequest = Annotated[KVRequestMessage, Field(discriminator="op")]
KV_REQUEST_ADAPTER: TypeAdapter[KVRequestMessage] = TypeAdapter(KVRequest)


class KVReply(_Message):
    """A stage's answer to a renew or health op.

    ``ok`` is False when the request was invalid (``error`` names the field). ``group_epoch``
    answers ``health``: the epoch of the stages' process group this stage serves in
    (``stage.rendezvous``; 0: formed once). ``v`` is the stage's ``PROTOCOL_VERSION``: any
    version (and fields it does not know) decodes, so that an admission can name a stage of
    another version and refuse it (``coordinator.check_stage_versions``).
    """

    model_config = ConfigDict(extra="ignore", frozen=True)
    rank: int
    ok: bool = True
    error: str = ""
    num_free_blocks: int = 0
    num_blocks: int = 0
    group_epoch: int = 0
    handoff_addr: str = ""  # health: the stage's KV transfer server "host:port" ("": none)

    @field_validator("v")
    @classmethod
    def _same_version(cls, value: int) -> int:
        return value  # any version: the admission names it in its refusal


# --------------------------------------------------------------------------- wave execution


class PlannedChunk(_Message):
    """One chunk of one request inside a micro-batch.

    Layout of the request's prompt (tokens)::

        [0 ............ context_offset) [context_offset ... context_offset + len(token_ids))
         cached or computed earlier       this chunk's new tokens
    """

    request_id: RequestId
    chunk_index: int = Field(ge=0)
    context_offset: int = Field(ge=0)
    token_ids: list[int]
    is_last: bool
    return_logits: bool = False
    # > 0 on a last chunk whose request is handed to a decode engine: every stage keeps the
    # request's blocks pinned until then (Unix seconds; wavepp.api.kv_handoff's token covers it)
    handoff_expires: float = Field(0.0, ge=0)


class MicroBatchPlan(_Message):
    """What every stage runs next, in ``microbatch_id`` order."""

    microbatch_id: int = Field(ge=0)
    chunks: list[PlannedChunk]
    published_at_s: float = 0.0
    traceparent: str = ""
    # The publishing scheduler instance; ids grow by one per plan within an epoch.
    epoch: str = Field(default="", max_length=64)
    mac: str = Field(default="", max_length=64)  # wavepp.api.signing: HMAC tag, "" unsigned


class RequestResult(_Message):
    """The last stage's answer for a request whose last chunk ran (first output token)."""

    request_id: RequestId
    first_token_id: int
    logits: list[float] | None = None


class MicroBatchDone(_Message):
    """A stage finished a micro-batch; wall-clock seconds (time.time()) of its phases."""

    rank: int
    microbatch_id: int
    num_tokens: int
    prepare_start_s: float
    prepare_end_s: float
    execute_start_s: float
    execute_end_s: float
    results: list[RequestResult] = []
    error: str = ""
    num_agreed_blocks: list[int] = []  # per plan chunk: the L* this stage committed (-1: none)
    epoch: str = Field(default="", max_length=64)  # the plan's epoch
    mac: str = Field(default="", max_length=64)  # wavepp.api.signing: HMAC tag, "" unsigned


class KVEventBatch(_Message):
    """Block hashes a stage stored or removed, in order (the pool's KV events)."""

    rank: int
    stored: list[list[HexHash]] = []
    removed: list[list[HexHash]] = []
    mac: str = Field(default="", max_length=64)  # wavepp.api.signing: HMAC tag, "" unsigned


# --------------------------------------------------------------------------- gap-free delivery


class PlanResend(_Message):
    """A stage asks the scheduler for the plans of ``epoch`` with ids in ``[from_id, to_id)``
    (``to_id`` None: no upper bound) that it missed."""

    epoch: str = Field(max_length=64)
    from_id: int = Field(ge=0)
    to_id: int | None = Field(default=None, ge=0)
    rank: int = Field(default=-1, ge=-1)


class PlanResendReply(_Message):
    """Every plan the scheduler still holds in the asked range, in id order. Any other id in
    the range below ``next_id`` is gone (it expired); ``epoch`` is the scheduler's own."""

    epoch: str = Field(max_length=64)
    next_id: int = Field(ge=0)
    plans: list[MicroBatchPlan] = []
    mac: str = Field(default="", max_length=64)  # wavepp.api.signing: HMAC tag, "" unsigned


class DoneResend(_Message):
    """The scheduler asks a stage for its done messages of ``microbatch_ids`` (lost ones)."""

    epoch: str = Field(max_length=64)
    microbatch_ids: list[int] = Field(max_length=4096)


class DoneResendReply(_Message):
    """The done messages the stage still has among those asked (the rest are not done yet)."""

    rank: int
    dones: list[MicroBatchDone] = []


class StageResync(_Message):
    """A stage reconnected to NATS: the scheduler asks it for done messages it may have lost."""

    rank: int
