"""Every NATS subject and JetStream object name WavePP uses, in one place.

``{p}`` is a replica's subject prefix ``wavepp.{pipeline}`` (``RuntimeConfig.subject_prefix``),
``{pool}`` the pool's name, ``{key}`` = ``{tenant}.{request_id}``, ``{r}`` a stage rank.

| subject / object                      | kind                  | payload (``wavepp.api``)             |
| ------------------------------------- | --------------------- | ------------------------------------ |
| ``{p}.stage.{r}.kv``                  | request-reply         | ProbePin/Commit/Release/Renew/Health -> KVReply |
| ``{p}.plan``                          | publish               | MicroBatchPlan (scheduler -> stages) |
| ``{p}.plan.replay``                   | request-reply         | PlanReplay -> PlanReplayReply        |
| ``{p}.done``                          | publish               | MicroBatchDone (stages -> scheduler) |
| ``{p}.stage.{r}.dones``               | request-reply         | DoneReplay -> DoneReplayReply        |
| ``{p}.resync``                        | publish               | StageResync                          |
| ``{p}.kv_events.{r}``                 | publish               | KVEventBatch                         |
| ``wavepp.{pipeline}.intake``          | JetStream stream subj | IntakeRequest; Nats-Msg-Id = key     |
| stream ``WAVEPP_INTAKE_{pipeline}``   | work queue, file      | dedup window: duplicates answered once |
| KV bucket ``WAVEPP_RESULTS_{pool}``   | JetStream KV, TTL     | key -> PrefillResult (idempotence)   |
| ``wavepp.{pool}.result.{key}``        | publish               | PrefillResult to the waiting gateway |
| ``wavepp.{pipeline}.admission.heartbeat`` | publish (0.5 s)   | Heartbeat                            |
| ``wavepp.{pool}.prefill``             | request-reply, queue  | the NATS prefill API of the gateway  |
| ``_INBOX.{user}.>``                   | replies               | one NATS user's reply inbox          |
| ``$JS.API...`` / ``$KV.{bucket}.>``   | JetStream API         | named per stream, for permissions    |
| KV bucket ``WAVEPP_RDZV_{pipeline}``  | JetStream KV          | the stages' group epoch (stage.rendezvous) |

Pure functions of names; no I/O. Nothing else in WavePP builds a subject string.
"""

from __future__ import annotations

from dataclasses import dataclass


def replica_pipeline_name(pool: str, replica: int) -> str:
    """Pipeline name (and NATS subject token) of replica ``replica`` of pool ``pool``."""
    return f"{pool}-r{replica}"


def replica_prefix(pipeline: str) -> str:
    """``wavepp.{pipeline}``: the prefix of every subject of one pipeline replica."""
    return f"wavepp.{pipeline}"


@dataclass(frozen=True)
class ReplicaSubjects:
    """The subjects of one pipeline replica, under its prefix ``{p}`` (``wavepp.{pipeline}``)."""

    prefix: str

    def stage_kv(self, rank: int | str) -> str:
        """``{p}.stage.{r}.kv``: the stage's agreement endpoint (request-reply); ``"*"``: all."""
        return f"{self.prefix}.stage.{rank}.kv"

    def stage_kv_batch(self, rank: int | str) -> str:
        """``{p}.stage.{r}.kvb``: the stage's batched agreement endpoint (request-reply, binary
        ``wavepp.api.kv_batch``); ``"*"``: all."""
        return f"{self.prefix}.stage.{rank}.kvb"

    def stage_dones(self, rank: int | str) -> str:
        """``{p}.stage.{r}.dones``: replay of a stage's done messages (request-reply); ``"*"``: all."""
        return f"{self.prefix}.stage.{rank}.dones"

    def kv_events(self, rank: int | str) -> str:
        """``{p}.kv_events.{r}``: a stage's KV events; pass ``"*"`` to subscribe to all stages."""
        return f"{self.prefix}.kv_events.{rank}"

    @property
    def plan(self) -> str:
        """``{p}.plan``: micro-batch plans, scheduler -> every stage."""
        return f"{self.prefix}.plan"

    @property
    def plan_replay(self) -> str:
        """``{p}.plan.replay``: a stage asks the scheduler for plans it missed."""
        return f"{self.prefix}.plan.replay"

    @property
    def done(self) -> str:
        """``{p}.done``: micro-batch done messages, stages -> scheduler."""
        return f"{self.prefix}.done"

    @property
    def resync(self) -> str:
        """``{p}.resync``: a stage says it reconnected."""
        return f"{self.prefix}.resync"


def intake_subject(pipeline: str) -> str:
    return f"{replica_prefix(pipeline)}.intake"


def intake_stream(pipeline: str) -> str:
    return f"WAVEPP_INTAKE_{pipeline}"


def results_bucket(pool: str) -> str:
    return f"WAVEPP_RESULTS_{pool}"


def result_subject(pool: str, key: str) -> str:
    return f"wavepp.{pool}.result.{key}"


def heartbeat_subject(pipeline: str) -> str:
    return f"{replica_prefix(pipeline)}.admission.heartbeat"


def heartbeat_wildcard() -> str:
    """Every replica's admission heartbeat (the gateway follows its pool by these)."""
    return f"{replica_prefix('*')}.admission.heartbeat"


def rendezvous_bucket(pipeline: str) -> str:
    """The KV bucket where a replica's stages agree on their process group's epoch."""
    return f"WAVEPP_RDZV_{pipeline}"


def prefill_subject(pool: str) -> str:
    return f"wavepp.{pool}.prefill"


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
