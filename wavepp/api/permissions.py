"""Who may publish and subscribe where on the bus: the one table of NATS permissions.

Every component connects as its own NATS user; its permissions are built here from the subject
functions of ``wavepp.api.subjects`` (so a new subject cannot be used without a row here, and
the table cannot drift from the subjects). ``wavepp up`` and the operator both mint their users'
credentials from ``users_for_pool``; a client without credentials is refused by the server.

``{p}`` = ``wavepp.{ns}.{pipeline}``: every subject, stream and bucket carries the pipeline's
namespace (``users_for_pool(..., namespace=)``), so a user is granted nothing of another
namespace's pipelines. User names (and so their ``_INBOX.{user}`` inboxes) do not carry the
namespace: two same-named pools in two namespaces under one NATS account have same-named users
(an account per namespace is not done).

| user                          | publishes                                        | subscribes                                  |
| ----------------------------- | ------------------------------------------------ | ------------------------------------------- |
| ``stage-{pipeline}-{r}``      | ``{p}.done``, ``{p}.kv_events.{r}``, ``{p}.resync``, ``{p}.plan.resend`` (request), its rendezvous bucket ``WAVEPP_RDZV_{ns}_{pipeline}`` | ``{p}.stage.{r}.kv`` / ``.kvb``, ``{p}.stages.kvb``, ``{p}.stage.{r}.dones``, ``{p}.plan`` |
| ``admission-{pipeline}``      | ``{p}.plan``, ``{p}.stage.*.kv`` / ``.kvb`` / ``.dones``, ``{p}.stages.kvb`` (requests), heartbeat, ``wavepp.{ns}.{pool}.result.>``, ``$KV`` results, JetStream API of its intake stream and the results bucket | ``{p}.done``, ``{p}.cancel``, ``{p}.plan.resend``, ``{p}.resync``, ``{p}.kv_events.*`` |
| ``cleanup-{ns}-{pool}``       | the operator at deletion: ``$JS.API.STREAM.LIST``, then ``$JS.API.STREAM.DELETE`` of exactly the pool's streams | its inbox |
| ``gateway-{pool}``            | every replica's ``intake`` (JetStream) and ``cancel``, ``wavepp.{ns}.{pool}.prefill``, JetStream API of the intake streams and results bucket (read) | ``wavepp.{ns}.{pool}.result.>``, ``wavepp.{ns}.*.admission.heartbeat``, ``{p}.kv_events.*``, ``wavepp.{ns}.{pool}.prefill`` |

Every user also subscribes to its own reply inbox ``_INBOX.{user}.>`` (nobody else may, so
replies cannot be read by another component) and may answer requests it received
(``allow_responses``: one reply per request, to the request's reply subject only). Only the
gateway's user may publish on ``wavepp.{ns}.{pool}.prefill`` (the NATS request path is not a way
around the gateway's tenant checks).

Pure functions; no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from wavepp.api.subjects import (
    ReplicaSubjects,
    cancel_subject,
    heartbeat_subject,
    heartbeat_wildcard,
    inbox_prefix,
    intake_stream,
    intake_subject,
    jetstream_consumer_api,
    jetstream_info,
    jetstream_stream_api,
    jetstream_stream_delete,
    jetstream_stream_list,
    jetstream_watch_api,
    kv_stream,
    kv_subjects,
    prefill_subject,
    rendezvous_bucket,
    replica_prefix,
    result_subject,
    results_bucket,
)

# A NATS subject token: no dots, wildcards or whitespace (user names become inbox tokens).
_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")


@dataclass(frozen=True)
class Permissions:
    """One NATS user's subjects: what it may publish and subscribe to (wildcards allowed), and
    whether it may answer requests it received (``allow_responses``). Everything else is denied.
    """

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = True

    def to_jwt_claims(self) -> dict[str, object]:
        """The ``pub``/``sub``/``resp`` part of a NATS user JWT's ``nats`` claims (JWT v2)."""
        claims: dict[str, object] = {
            "pub": {"allow": list(self.publish)},
            "sub": {"allow": list(self.subscribe)},
        }
        if self.allow_responses:
            claims["resp"] = {"max": 1, "ttl": 0}
        return claims


@dataclass(frozen=True)
class NatsUser:
    """A component's NATS user: its name (also its inbox token) and its permissions."""

    name: str
    role: str  # "stage", "admission", "gateway" or "cleanup"
    permissions: Permissions = field(repr=False)

    @property
    def inbox(self) -> str:
        """The prefix of this user's reply inboxes (``nats.connect(inbox_prefix=...)``)."""
        return inbox_prefix(self.name)


def _token(value: str, what: str) -> str:
    if not _TOKEN.match(value):
        raise ValueError(
            f"{what} {value!r}: a NATS user name needs letters, digits, '-' or '_' only"
        )
    return value


def stage_user_name(pipeline: str, rank: int) -> str:
    return _token(f"stage-{pipeline}-{rank}", "pipeline")


def admission_user_name(pipeline: str) -> str:
    return _token(f"admission-{pipeline}", "pipeline")


def gateway_user_name(pool: str) -> str:
    return _token(f"gateway-{pool}", "pool")


def stage_user(pipeline: str, rank: int, *, namespace: str) -> NatsUser:
    """A stage: its own kv and done-resend endpoints, the replica's plans; publishes its dones,
    its KV events, resync, and asks the scheduler for missed plans."""
    name = stage_user_name(pipeline, rank)
    s = ReplicaSubjects(replica_prefix(pipeline, namespace=namespace))
    rendezvous = rendezvous_bucket(pipeline, namespace=namespace)
    return NatsUser(
        name,
        "stage",
        Permissions(
            publish=(
                s.done,
                s.kv_events(rank),
                s.resync,
                s.plan_resend,
                # the replica's group epoch (runtime.stage.rendezvous): re-form in place
                kv_subjects(rendezvous),
                jetstream_info(),
                *jetstream_stream_api(kv_stream(rendezvous)),
                *jetstream_watch_api(kv_stream(rendezvous)),
            ),
            subscribe=(
                s.stage_kv(rank),
                s.stage_kv_batch(rank),
                s.stages_kv_batch,  # a round to every stage of the replica at once
                s.stage_dones(rank),
                s.plan,
                f"{inbox_prefix(name)}.>",
            ),
        ),
    )


def admission_user(pipeline: str, pool: str, *, namespace: str) -> NatsUser:
    """A replica's admission service (scheduler): its stages' kv/dones endpoints, plans,
    heartbeat, the pool's results (subject and bucket) and its own intake stream (consumer)."""
    name = admission_user_name(pipeline)
    s = ReplicaSubjects(replica_prefix(pipeline, namespace=namespace))
    bucket = results_bucket(pool, namespace=namespace)
    intake = intake_stream(pipeline, namespace=namespace)
    return NatsUser(
        name,
        "admission",
        Permissions(
            publish=(
                s.plan,
                s.stage_kv("*"),
                s.stage_kv_batch("*"),
                s.stages_kv_batch,
                s.stage_dones("*"),
                heartbeat_subject(pipeline, namespace=namespace),
                result_subject(pool, ">", namespace=namespace),
                kv_subjects(bucket),
                jetstream_info(),
                *jetstream_stream_api(intake),
                *jetstream_consumer_api(intake),
                *jetstream_stream_api(kv_stream(bucket)),
            ),
            subscribe=(
                s.done,
                cancel_subject(pipeline, namespace=namespace),
                s.plan_resend,
                s.resync,
                s.kv_events("*"),
                f"{inbox_prefix(name)}.>",
            ),
        ),
    )


def gateway_user(pool: str, pipelines: list[str], *, namespace: str) -> NatsUser:
    """The pool's gateway: publishes every replica's intake; reads results, heartbeats, KV
    events; serves and alone may publish the NATS prefill request path."""
    name = gateway_user_name(pool)
    bucket = results_bucket(pool, namespace=namespace)
    prefill = prefill_subject(pool, namespace=namespace)
    publish: list[str] = [prefill, jetstream_info()]
    # every replica's heartbeat, including replicas added at run time (the gateway follows its
    # pool by them; a heartbeat names its pool, and the gateway keeps only its own)
    subscribe: list[str] = [
        result_subject(pool, ">", namespace=namespace),
        prefill,
        heartbeat_wildcard(namespace=namespace),
    ]
    for pipeline in pipelines:
        publish += [
            intake_subject(pipeline, namespace=namespace),
            cancel_subject(pipeline, namespace=namespace),
            *jetstream_stream_api(intake_stream(pipeline, namespace=namespace)),
        ]
        subscribe += [
            heartbeat_subject(pipeline, namespace=namespace),
            ReplicaSubjects(replica_prefix(pipeline, namespace=namespace)).kv_events("*"),
        ]
    publish += jetstream_stream_api(kv_stream(bucket))
    subscribe.append(f"{inbox_prefix(name)}.>")
    return NatsUser(name, "gateway", Permissions(tuple(publish), tuple(subscribe)))


def cleanup_user_name(pool: str, namespace: str) -> str:
    return _token(f"cleanup-{namespace}-{pool}", "pool")


def cleanup_user(pool: str, streams: list[str], *, namespace: str) -> NatsUser:
    """The operator's user that removes a deleted pool's JetStream state (the operator holds
    the account seed and mints it at deletion): it lists the account's streams (read-only) and
    may delete exactly ``streams`` (none: a user that only lists), answers no requests."""
    name = cleanup_user_name(pool, namespace)
    return NatsUser(
        name,
        "cleanup",
        Permissions(
            publish=(
                jetstream_info(),
                jetstream_stream_list(),
                *(jetstream_stream_delete(s) for s in streams),
            ),
            subscribe=(f"{inbox_prefix(name)}.>",),
            allow_responses=False,
        ),
    )


def users_for_pool(pool: str, replicas: dict[str, int], *, namespace: str) -> list[NatsUser]:
    """Every component user of a pool in ``namespace`` (the namespace token of every subject,
    stream and bucket the users are granted; see ``wavepp.api.subjects``): one gateway, and per
    replica (``pipeline -> number of stages``) one admission and one user per stage.

    Raises:
        ValueError: a pool or pipeline name that cannot be a NATS user name (see ``_TOKEN``).
    """
    users = [gateway_user(pool, list(replicas), namespace=namespace)]
    for pipeline, num_stages in replicas.items():
        users.append(admission_user(pipeline, pool, namespace=namespace))
        users += [stage_user(pipeline, rank, namespace=namespace) for rank in range(num_stages)]
    return users
