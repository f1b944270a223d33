"""Every NATS subject and JetStream object name WavePP uses, in one place.

Every name carries the pipeline's Kubernetes namespace ``{ns}`` (``RuntimeConfig.namespace``,
``$WAVEPP_NAMESPACE`` in a pod, ``local`` for ``wavepp up``) and its name, so two same-named
pipelines in two namespaces on one NATS server share no subject, stream or bucket. ``{p}`` is a
replica's subject prefix ``wavepp.{ns}.{pipeline}`` (``RuntimeConfig.subject_prefix``), ``{pool}``
the pool's name, ``{key}`` = ``{tenant}.{request_id}``, ``{r}`` a stage rank. Namespaces are DNS
labels (no ``.`` or ``_``), so the names below never collide across namespaces.

| subject / object                      | kind                  | payload (``wavepp.api``)             |
| ------------------------------------- | --------------------- | ------------------------------------ |
| ``{p}.stage.{r}.kv``                  | request-reply         | Renew/Health -> KVReply              |
| ``{p}.stage.{r}.kvb``                 | request-reply         | KVBatch -> KVBatchReply (one stage)  |
| ``{p}.stages.kvb``                    | request, S replies    | KVBatch -> KVBatchReply from every stage (one publish per round) |
| ``{p}.plan``                          | publish               | MicroBatchPlan (scheduler -> stages) |
| ``{p}.plan.resend``                   | request-reply         | PlanResend -> PlanResendReply        |
| ``{p}.done``                          | publish               | MicroBatchDone (stages -> scheduler) |
| ``{p}.stage.{r}.dones``               | request-reply         | DoneResend -> DoneResendReply        |
| ``{p}.resync``                        | publish               | StageResync                          |
| ``{p}.kv_events.{r}``                 | publish               | KVEventBatch                         |
| ``{p}.intake``                        | JetStream stream subj | IntakeRequest; Nats-Msg-Id = key     |
| ``{p}.cancel``                        | publish               | IntakeCancel (gateway -> admission)  |
| stream ``WAVEPP_INTAKE_{ns}_{pipeline}`` | work queue, file   | dedup window: duplicates answered once |
| KV bucket ``WAVEPP_RESULTS_{ns}_{pool}`` | JetStream KV, TTL  | key -> PrefillResult (idempotence)   |
| ``wavepp.{ns}.{pool}.result.{key}``   | publish               | PrefillResult to the waiting gateway |
| ``{p}.admission.heartbeat``           | publish (0.5 s)       | Heartbeat                            |
| ``wavepp.{ns}.{pool}.prefill``        | request-reply, queue  | the NATS prefill API of the gateway  |
| KV bucket ``WAVEPP_RDZV_{ns}_{pipeline}`` | JetStream KV      | the stages' group epoch (stage.rendezvous) |
| ``_INBOX.{user}.>``                   | replies               | one NATS user's reply inbox          |
| ``$JS.API...`` / ``$KV.{bucket}.>``   | JetStream API         | named per stream, for permissions    |

Pure functions of names; no I/O. Nothing else in WavePP builds a subject string.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_POOL_NAME = 253
"""The longest pool name: a Kubernetes object name (the WavePipeline's ``metadata.name``)."""
MAX_PIPELINE_NAME = MAX_POOL_NAME + len("-r255")
"""The longest pipeline name: :func:`replica_pipeline_name` of the last replica (< 256)."""


def replica_pipeline_name(pool: str, replica: int) -> str:
    """Pipeline name (and NATS subject token) of replica ``replica`` of pool ``pool``."""
    return f"{pool}-r{replica}"


def replica_prefix(pipeline: str, *, namespace: str) -> str:
    """``wavepp.{ns}.{pipeline}``: the prefix of every subject of one pipeline replica."""
    return f"wavepp.{namespace}.{pipeline}"


@dataclass(frozen=True)
class ReplicaSubjects:
    """The subjects of one pipeline replica, under its prefix ``{p}`` (``wavepp.{ns}.{pipeline}``)."""

    prefix: str

    def stage_kv(self, rank: int | str) -> str:
        """``{p}.stage.{r}.kv``: the stage's agreement endpoint (request-reply); ``"*"``: all."""
        return f"{self.prefix}.stage.{rank}.kv"

    def stage_kv_batch(self, rank: int | str) -> str:
        """``{p}.stage.{r}.kvb``: the stage's batched agreement endpoint (request-reply, binary
        ``wavepp.api.kv_batch``); ``"*"``: all."""
        return f"{self.prefix}.stage.{rank}.kvb"

    @property
    def stages_kv_batch(self) -> str:
        """``{p}.stages.kvb``: every stage's batched agreement endpoint at once: one publish
        reaches all S stages of the replica, and each answers on the one reply subject with its
        rank in the reply (``wavepp.api.kv_batch``). Not matched by ``stage_kv_batch("*")``."""
        return f"{self.prefix}.stages.kvb"

    def stage_dones(self, rank: int | str) -> str:
        """``{p}.stage.{r}.dones``: resend of a stage's done messages (request-reply); ``"*"``: all."""
        return f"{self.prefix}.stage.{rank}.dones"

    def kv_events(self, rank: int | str) -> str:
        """``{p}.kv_events.{r}``: a stage's KV events; pass ``"*"`` to subscribe to all stages."""
        return f"{self.prefix}.kv_events.{rank}"

    @property
    def plan(self) -> str:
        """``{p}.plan``: micro-batch plans, scheduler -> every stage."""
        return f"{self.prefix}.plan"

    @property
    def plan_resend(self) -> str:
        """``{p}.plan.resend``: a stage asks the scheduler for plans it missed."""
        return f"{self.prefix}.plan.resend"

    @property
    def done(self) -> str:
        """``{p}.done``: micro-batch done messages, stages -> scheduler."""
        return f"{self.prefix}.done"

    @property
    def resync(self) -> str:
        """``{p}.resync``: a stage says it reconnected."""
        return f"{self.prefix}.resync"


def intake_subject(pipeline: str, *, namespace: str) -> str:
    """``{p}.intake``: the subject of a replica's intake stream."""
    return f"{replica_prefix(pipeline, namespace=namespace)}.intake"


def cancel_subject(pipeline: str, *, namespace: str) -> str:
    """``{p}.cancel``: the gateway withdraws an intake message it gave up on (IntakeCancel)."""
    return f"{replica_prefix(pipeline, namespace=namespace)}.cancel"


def intake_stream(pipeline: str, *, namespace: str) -> str:
    """``WAVEPP_INTAKE_{ns}_{pipeline}``: a replica's durable intake (JetStream work queue)."""
    return f"WAVEPP_INTAKE_{namespace}_{pipeline}"


def results_bucket(pool: str, *, namespace: str) -> str:
    """``WAVEPP_RESULTS_{ns}_{pool}``: a pool's results (JetStream KV)."""
    return f"WAVEPP_RESULTS_{namespace}_{pool}"


def result_subject(pool: str, key: str, *, namespace: str) -> str:
    """``wavepp.{ns}.{pool}.result.{key}``: a result to the waiting gateway."""
    return f"wavepp.{namespace}.{pool}.result.{key}"


def heartbeat_subject(pipeline: str, *, namespace: str) -> str:
    """``{p}.admission.heartbeat``: a replica's admission controller is alive."""
    return f"{replica_prefix(pipeline, namespace=namespace)}.admission.heartbeat"


def prefill_subject(pool: str, *, namespace: str) -> str:
    """``wavepp.{ns}.{pool}.prefill``: the gateway's NATS prefill API."""
    return f"wavepp.{namespace}.{pool}.prefill"


def pool_streams(names: list[str], pool: str, *, namespace: str) -> list[str]:
    """Of the JetStream stream names ``names``, those that belong to pool ``pool`` in
    ``namespace``: its replicas' intake streams (``{pool}-r{i}``), their rendezvous buckets'
    streams (``KV_WAVEPP_RDZV_{ns}_{pool}-r{i}``) and its results bucket's stream
    (``KV_WAVEPP_RESULTS_{ns}_{pool}``). What to remove when the pool is deleted."""
    per_replica = (f"WAVEPP_INTAKE_{namespace}_{pool}-r", f"KV_WAVEPP_RDZV_{namespace}_{pool}-r")
    bucket = f"KV_{results_bucket(pool, namespace=namespace)}"
    return [
        n
        for n in names
        if n == bucket or any(n.startswith(p) and n[len(p) :].isdigit() for p in per_replica)
    ]


def heartbeat_wildcard(*, namespace: str) -> str:
    """``wavepp.{ns}.*.admission.heartbeat``: every replica's admission heartbeat in
    ``namespace`` (the gateway follows its pool by these)."""
    return f"{replica_prefix('*', namespace=namespace)}.admission.heartbeat"


def rendezvous_bucket(pipeline: str, *, namespace: str) -> str:
    """``WAVEPP_RDZV_{ns}_{pipeline}``: the KV bucket where a replica's stages agree on their
    process group's epoch."""
    return f"WAVEPP_RDZV_{namespace}_{pipeline}"


# ---- NATS internals a permission must name (inboxes, JetStream API); see api.permissions ------


def inbox_prefix(user: str) -> str:
    """``_INBOX.{user}``: the reply inbox of one NATS user (only that user may subscribe there)."""
    return f"_INBOX.{user}"


def kv_stream(bucket: str) -> str:
    """``KV_{bucket}``: the stream behind a JetStream KV bucket."""
    return f"KV_{bucket}"


def kv_subjects(bucket: str) -> str:
    """``$KV.{bucket}.>``: every key of a KV bucket (a put is a publish here)."""
    return f"$KV.{bucket}.>"


def kv_key_subject(bucket: str, key: str) -> str:
    """``$KV.{bucket}.{key}``: the subject a put of ``key`` publishes to (its value is the
    message body)."""
    return f"$KV.{bucket}.{key}"


def jetstream_info() -> str:
    """``$JS.API.INFO``: the account's JetStream info (nats-py asks it on first use)."""
    return "$JS.API.INFO"


def jetstream_stream_api(stream: str) -> list[str]:
    """The JetStream API subjects that look up, create and read one stream (never delete or
    purge it): info, create, message get and direct get."""
    return [
        f"$JS.API.STREAM.INFO.{stream}",
        f"$JS.API.STREAM.CREATE.{stream}",
        f"$JS.API.STREAM.MSG.GET.{stream}",
        f"$JS.API.DIRECT.GET.{stream}",
        f"$JS.API.DIRECT.GET.{stream}.>",
    ]


def jetstream_stream_list() -> str:
    """``$JS.API.STREAM.LIST``: the account's streams and their configs (read-only)."""
    return "$JS.API.STREAM.LIST"


def jetstream_stream_delete(stream: str) -> str:
    """``$JS.API.STREAM.DELETE.{stream}``: remove one stream and its messages."""
    return f"$JS.API.STREAM.DELETE.{stream}"


def jetstream_watch_api(stream: str) -> list[str]:
    """The JetStream API subjects a KV watch of ``stream``'s bucket uses (an ephemeral ordered
    push consumer: nats-py's ``KeyValue.watch``): create it, read its info, delete it, and
    answer its flow control (``$JS.FC.{stream}.>``)."""
    return [
        f"$JS.API.CONSUMER.CREATE.{stream}",
        f"$JS.API.CONSUMER.CREATE.{stream}.>",
        f"$JS.API.CONSUMER.INFO.{stream}.>",
        f"$JS.API.CONSUMER.DELETE.{stream}.>",
        f"$JS.FC.{stream}.>",
    ]


def jetstream_consumer_api(stream: str) -> list[str]:
    """The JetStream API subjects a durable pull consumer of ``stream`` uses: create it, read its
    info, fetch messages, and acknowledge them (``$JS.ACK.{stream}.>``)."""
    return [
        f"$JS.API.CONSUMER.CREATE.{stream}",
        f"$JS.API.CONSUMER.CREATE.{stream}.>",
        f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.>",
        f"$JS.API.CONSUMER.INFO.{stream}.>",
        f"$JS.API.CONSUMER.MSG.NEXT.{stream}.>",
        f"$JS.ACK.{stream}.>",
    ]
