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
| KV bucket ``WAVEPP_RDZV_{pipeline}``  | JetStream KV          | the stages' group epoch (stage.rendezvous) |

Pure functions of names; no I/O. Nothing else in WavePP builds a subject string.
"""

from __future__ import annotations

from dataclasses import dataclass


def replica_prefix(pipeline: str) -> str:
    """``wavepp.{pipeline}``: the prefix of every subject of one pipeline replica."""
    return f"wavepp.{pipeline}"


@dataclass(frozen=True)
class ReplicaSubjects:
    """The subjects of one pipeline replica, under its prefix ``{p}`` (``wavepp.{pipeline}``)."""

    prefix: str

    def stage_kv(self, rank: int) -> str:
        """``{p}.stage.{r}.kv``: the stage's agreement endpoint (request-reply)."""
        return f"{self.prefix}.stage.{rank}.kv"

    def stage_dones(self, rank: int) -> str:
        """``{p}.stage.{r}.dones``: replay of a stage's done messages (request-reply)."""
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
