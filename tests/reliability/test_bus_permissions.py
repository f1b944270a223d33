"""The bus refuses strangers and confines each component to its own subjects, against a real
nats-server configured by ``write_pool_auth`` (what ``wavepp up`` runs by default)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
from nats.errors import NoRespondersError
from reliability_support import wait_until

from wavepp.api.kv_batch import BatchOp, KVBatch, encode_batch
from wavepp.api.kv_reply import decode_reply
from wavepp.api.permissions import users_for_pool
from wavepp.api.subjects import (
    ReplicaSubjects,
    cancel_subject,
    heartbeat_subject,
    intake_subject,
    prefill_subject,
    replica_prefix,
    result_subject,
)
from wavepp.runtime.agreement import StageUnavailableError
from wavepp.runtime.agreement.nats_client import NatsStageClient, serve_stage_kv
from wavepp.runtime.kv import BlockPool, StageKVManager
from wavepp.runtime.transport.auth import PoolAuth, write_pool_auth
from wavepp.runtime.transport.natsio import EmbeddedNatsServer, connect, flush_in_order

POOL = "pool1"
REPLICAS = {"p1": 2, "p2": 1}
NS = "local"
P1 = ReplicaSubjects(replica_prefix("p1", namespace=NS))


@pytest.fixture(scope="module")
def auth(tmp_path_factory: pytest.TempPathFactory) -> PoolAuth:
    folder = tmp_path_factory.mktemp("bus-auth")
    return write_pool_auth(
        folder / "auth", pool=POOL, replicas=REPLICAS, namespace=NS, store_dir=folder / "js"
    )


@pytest.fixture(scope="module")
def server(auth: PoolAuth):  # noqa: ANN201
    with EmbeddedNatsServer(config_file=auth.server_config) as srv:
        yield srv


class Client:
    """A connection that records the server's errors (permission violations) and messages."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.got: list[tuple[str, bytes]] = []
        self.nc = None

    async def open(self, url: str, creds: str | None, name: str) -> Client:
        async def on_error(exc: Exception) -> None:
            self.errors.append(str(exc))

        self.nc = await asyncio.wait_for(
            connect(
                url,
                name=name,
                creds=creds,
                error_cb=on_error,
                allow_reconnect=False,
                connect_timeout=2,
            ),
            timeout=10,
        )
        return self

    async def on(self, subject: str) -> None:
        async def cb(msg) -> None:  # noqa: ANN001
            self.got.append((msg.subject, msg.data))

        await self.nc.subscribe(subject, cb=cb)
        await flush_in_order(self.nc)

    async def close(self) -> None:
        await self.nc.close()


async def _publish_outcome(
    url: str, auth: PoolAuth, publisher: str, receiver: str, subject: str
) -> tuple[bool, list[str]]:
    """(delivered, publisher's errors) for one publish of ``publisher`` on ``subject``, seen by a
    subscriber holding ``receiver``'s credentials (a user allowed to subscribe there)."""
    rx = await Client().open(url, auth.creds[receiver], "rx")
    tx = await Client().open(url, auth.creds[publisher], "tx")
    try:
        await rx.on(subject)
        # Both outcomes arrive through callbacks that run as tasks: a delivery (the subscription's
        # task appends to rx.got) or a refusal (-ERR, the error callback). Wait for either; a
        # check of rx.got alone raced the subscription's task (a flake: 1 run in 3). Rarely (1
        # run in ~15) neither came for a permitted publish made right after the subscriber's
        # flush: publish again, a few times, before concluding (a refused publish is refused
        # every time; a delivered one is delivered).
        for _ in range(5):
            await tx.nc.publish(subject, b"forged")
            await flush_in_order(tx.nc)  # the server has routed (or refused) the publish
            await flush_in_order(rx.nc)
            with contextlib.suppress(TimeoutError):
                await wait_until(lambda: rx.got or tx.errors, timeout_s=1)
            if rx.got or tx.errors:
                break
        return bool(rx.got), tx.errors
    finally:
        await tx.close()
        await rx.close()


async def test_anonymous_and_foreign_clients_are_refused(server: EmbeddedNatsServer) -> None:
    for creds in (None,):
        with pytest.raises(Exception, match="Authorization Violation"):
            await Client().open(server.url, creds, "anonymous")


@pytest.mark.parametrize(
    ("publisher", "receiver", "subject"),
    [
        # the positive controls: each component's own subjects work
        ("admission-p1", "stage-p1-0", P1.plan),
        ("admission-p1", "stage-p1-1", P1.stages_kv_batch),  # a round to every stage at once
        ("stage-p1-1", "admission-p1", P1.done),
        ("gateway-pool1", "gateway-pool1", prefill_subject(POOL, namespace=NS)),
        ("admission-p1", "gateway-pool1", result_subject(POOL, "t.r1", namespace=NS)),
        ("gateway-pool1", "admission-p1", cancel_subject("p1", namespace=NS)),
    ],
)
async def test_a_component_publishes_its_own_subjects(
    server: EmbeddedNatsServer, auth: PoolAuth, publisher: str, receiver: str, subject: str
) -> None:
    delivered, errors = await _publish_outcome(server.url, auth, publisher, receiver, subject)
    assert delivered and not errors, errors


@pytest.mark.parametrize(
    ("publisher", "receiver", "subject"),
    [
        # a stage forging its scheduler's plan, or another stage's KV events
        ("stage-p1-1", "stage-p1-0", P1.plan),
        # a stage forging an agreement round to its peers; another replica's admission or the
        # gateway sending one to p1's stages
        ("stage-p1-1", "stage-p1-0", P1.stages_kv_batch),
        ("admission-p2", "stage-p1-0", P1.stages_kv_batch),
        ("gateway-pool1", "stage-p1-0", P1.stages_kv_batch),
        ("stage-p1-1", "gateway-pool1", P1.kv_events(0)),
        # a stage or admission forging a result or a heartbeat for the gateway
        ("stage-p1-0", "gateway-pool1", result_subject(POOL, "t.r1", namespace=NS)),
        ("stage-p1-0", "gateway-pool1", heartbeat_subject("p1", namespace=NS)),
        ("admission-p2", "gateway-pool1", heartbeat_subject("p1", namespace=NS)),
        # another replica's admission planning p1's stages
        ("admission-p2", "stage-p1-0", P1.plan),
        # the gateway speaking for a stage
        ("gateway-pool1", "admission-p1", P1.done),
        # only the gateway's user may publish on the prefill request path
        ("stage-p1-0", "gateway-pool1", prefill_subject(POOL, namespace=NS)),
        ("admission-p1", "gateway-pool1", prefill_subject(POOL, namespace=NS)),
        # only the gateway withdraws a request (IntakeCancel): a stage or another replica's
        # admission cannot make a replica drop one
        ("stage-p1-0", "admission-p1", cancel_subject("p1", namespace=NS)),
        ("admission-p2", "admission-p1", cancel_subject("p1", namespace=NS)),
    ],
)
async def test_a_component_cannot_publish_another_components_subjects(
    server: EmbeddedNatsServer, auth: PoolAuth, publisher: str, receiver: str, subject: str
) -> None:
    delivered, errors = await _publish_outcome(server.url, auth, publisher, receiver, subject)
    assert not delivered
    assert any("permissions violation for publish" in e.lower() for e in errors), errors


@pytest.mark.parametrize(
    ("user", "subject"),
    [
        ("stage-p1-0", intake_subject("p1", namespace=NS)),  # every tenant's prompts
        ("stage-p1-0", "_INBOX.>"),  # every component's replies
        ("stage-p1-0", "_INBOX.admission-p1.>"),  # the scheduler's replies
        ("admission-p2", P1.plan),
        ("gateway-pool1", P1.stage_kv(0)),
        # p1's agreement rounds (every request's block hashes) read by another replica's
        # stage or admission, the gateway, or p1's own admission (it only sends them)
        ("stage-p2-0", P1.stages_kv_batch),
        ("admission-p2", P1.stages_kv_batch),
        ("gateway-pool1", P1.stages_kv_batch),
        ("admission-p1", P1.stages_kv_batch),
    ],
)
async def test_a_component_cannot_read_another_components_subjects(
    server: EmbeddedNatsServer, auth: PoolAuth, user: str, subject: str
) -> None:
    client = await Client().open(server.url, auth.creds[user], "snoop")
    try:
        await client.on(subject)
        await wait_until(lambda: client.errors, timeout_s=5)
    finally:
        await client.close()
    assert any("permissions violation for subscription" in e.lower() for e in client.errors)


async def test_replies_come_to_the_requesters_own_inbox(
    server: EmbeddedNatsServer, auth: PoolAuth
) -> None:
    """The scheduler asks a stage's KV endpoint; the stage answers (allow_responses) into the
    scheduler's own inbox; it works with nothing broader granted."""
    stage = await Client().open(server.url, auth.stage("p1", 0), "stage")
    scheduler = await Client().open(server.url, auth.admission("p1"), "scheduler")
    try:

        async def echo(msg) -> None:  # noqa: ANN001
            await msg.respond(b"ok:" + msg.data)

        await stage.nc.subscribe(P1.stage_kv(0), cb=echo)
        await flush_in_order(stage.nc)
        # The stage's interest reaches the scheduler's connection a moment after the stage's
        # own flush returns (seen once in CI: "no responders"); ask again within a second.
        reply = None
        for _ in range(10):
            try:
                reply = await scheduler.nc.request(P1.stage_kv(0), b"probe", timeout=5)
                break
            except NoRespondersError:
                await asyncio.sleep(0.1)
        assert reply is not None, "the stage's subscription never became visible"
        assert reply.data == b"ok:probe"
        assert reply.subject.startswith("_INBOX.admission-p1.")
        assert not stage.errors and not scheduler.errors
    finally:
        await stage.close()
        await scheduler.close()


async def test_a_round_reaches_every_stage_and_each_answers_into_the_admissions_inbox(
    server: EmbeddedNatsServer, auth: PoolAuth
) -> None:
    """One publish on ``{p}.stages.kvb`` by p1's admission reaches both of p1's stages; each
    answers the one reply subject (``allow_responses``: one reply per stage) and the round gets
    both replies, in rank order, with nothing broader granted."""
    stages = [await Client().open(server.url, auth.stage("p1", r), f"stage{r}") for r in (0, 1)]
    scheduler = await Client().open(server.url, auth.admission("p1"), "scheduler")
    try:
        for rank, stage in enumerate(stages):
            manager = StageKVManager(BlockPool(8, 4))
            await serve_stage_kv(stage.nc, P1.prefix, rank, manager)
            await flush_in_order(stage.nc)
        clients = NatsStageClient.for_replica(scheduler.nc, P1.prefix, 2, timeout_s=5.0)
        payload = encode_batch(KVBatch(BatchOp.RELEASE, ("nothing",)))
        replies = None
        for _ in range(10):  # the stages' interest reaches the scheduler's server a moment later
            try:
                replies = await NatsStageClient.call_batch_all(clients, payload)
                break
            except StageUnavailableError:
                await asyncio.sleep(0.1)
        assert replies is not None, "the stages' subscriptions never became visible"
        assert [decode_reply(r).rank for r in replies] == [0, 1]
        assert not scheduler.errors and not any(stage.errors for stage in stages)
    finally:
        for client in (*stages, scheduler):
            await client.close()


def test_only_the_replicas_admission_sends_rounds_and_only_its_stages_read_them() -> None:
    """The fan-out subject is granted exactly: p1's admission publishes it, p1's stages (and no
    one else, of this pool or a same-named pool in another namespace) subscribe to it."""
    for ns in (NS, "team-b"):
        for user in users_for_pool(POOL, REPLICAS, namespace=ns):
            publish, subscribe = user.permissions.publish, user.permissions.subscribe
            assert (P1.stages_kv_batch in publish) == (ns == NS and user.name == "admission-p1")
            assert (P1.stages_kv_batch in subscribe) == (
                ns == NS and user.name in ("stage-p1-0", "stage-p1-1")
            )
            for pattern in (*publish, *subscribe):  # no wildcard grant covers it either
                if pattern != P1.stages_kv_batch:
                    assert not _matches(pattern, P1.stages_kv_batch), (user.name, pattern)


def _matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` one token, ``>`` one or more trailing tokens."""
    want, have = pattern.split("."), subject.split(".")
    for index, token in enumerate(want):
        if token == ">":
            return len(have) > index
        if index >= len(have) or token not in ("*", have[index]):
            return False
    return len(want) == len(have)


def test_every_user_has_a_distinct_inbox_and_no_broad_wildcard() -> None:
    users = users_for_pool(POOL, REPLICAS, namespace=NS)
    assert len({u.name for u in users}) == len(users) == 1 + 2 + 3
    for user in users:
        for subject in (*user.permissions.publish, *user.permissions.subscribe):
            assert subject not in (">", "*", "_INBOX.>", "wavepp.>", "$JS.API.>"), (user, subject)


def test_creds_files_are_private(auth: PoolAuth) -> None:
    for path in [auth.server_config, *auth.creds.values()]:
        assert Path(path).stat().st_mode & 0o077 == 0, path
    assert Path(auth.server_config).parent.stat().st_mode & 0o077 == 0


def test_a_users_subjects_streams_and_buckets_are_all_of_its_namespace() -> None:
    """Two same-named pools in two namespaces: every subject, stream and bucket granted to a
    user of team-a carries team-a, and none is granted to both namespaces' users (apart from
    the account-wide JetStream info and the users' own inboxes)."""
    grants = {}
    for ns in ("team-a", "team-b"):
        users = users_for_pool(POOL, REPLICAS, namespace=ns)
        subjects = {s for u in users for s in (*u.permissions.publish, *u.permissions.subscribe)}
        for subject in subjects:
            if subject.startswith("wavepp."):
                assert subject.startswith(f"wavepp.{ns}."), subject
            elif subject.startswith(("$JS.API.STREAM", "$JS.API.CONSUMER", "$JS.API.DIRECT")):
                assert f"_{ns}_" in subject, subject
            elif subject.startswith(("$KV.", "$JS.ACK.", "$JS.FC.")):
                assert f"_{ns}_" in subject, subject
            else:
                assert subject == "$JS.API.INFO" or subject.startswith("_INBOX."), subject
        grants[ns] = {s for s in subjects if not s.startswith("_INBOX.") and s != "$JS.API.INFO"}
    assert not grants["team-a"] & grants["team-b"]
