"""The operator renders each pipeline's NATS credentials: one Secret, each pod mounting only its
own users; the rendered users work against a real nats-server that trusts the account, and only
the gateway's may publish the prefill request path."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path
from typing import Any

import pytest

from wavepp.api.natsauth import TrustRoot
from wavepp.api.signing import BusKey
from wavepp.api.subjects import ReplicaSubjects, prefill_subject, replica_prefix
from wavepp.operator.reconcile import Apply, Defaults, Observed, plan
from wavepp.runtime.transport.natsio import EmbeddedNatsServer, connect, flush_in_order

SPEC = {"model": {"name": "tiny-llama"}, "stages": 2, "replicas": 2}
BUS_KEY_ITEM = {"key": "bus.key", "path": "bus.key"}


@pytest.fixture(scope="module")
def trust() -> TrustRoot:
    return TrustRoot.new()


def _body(spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "metadata": {"name": "p", "namespace": "ns", "uid": "u1", "generation": 1},
        "spec": spec,
    }


def _rendered_files(trust: TrustRoot, tmp_path: Path) -> tuple[dict[str, str], Path]:
    """The rendered Secret's ``.creds`` files written out (user -> path) and the nats-server
    config of the trust root."""
    creds: dict[str, str] = {}
    for key, value in _applied(trust)[0]["data"].items():
        path = tmp_path / key
        path.write_bytes(base64.b64decode(value))
        creds[key.removesuffix(".creds")] = str(path)
    config = tmp_path / "server.conf"
    config.write_text(trust.server_config(str(tmp_path / "js")))
    return creds, config


def _applied(trust: TrustRoot | None, spec: dict[str, Any] = SPEC) -> list[dict[str, Any]]:
    defaults = Defaults(
        image="img:1",
        nats_url="nats://n:4222",
        nats_account_seed=trust.account_seed if trust else None,
    )
    result = plan(_body(spec), Observed(), 1_000_000.0, defaults)
    return [a.manifest for a in result.actions if isinstance(a, Apply)]


def _find(manifests: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(m for m in manifests if m["kind"] == kind and m["metadata"]["name"] == name)


def _pod(manifests: list[dict[str, Any]], kind: str, name: str) -> tuple[list[str], dict]:
    pod = _find(manifests, kind, name)["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "nats-creds")
    return pod["containers"][0]["args"], volume["secret"]


def test_secret_first_and_each_pod_mounts_only_its_own_users(trust: TrustRoot) -> None:
    manifests = _applied(trust)
    secret = manifests[0]
    assert secret["kind"] == "Secret" and secret["metadata"]["name"] == "p-nats-creds"
    assert sorted(secret["data"]) == sorted(
        ["gateway-p.creds", "admission-p-r0.creds", "admission-p-r1.creds", "bus.key"]
        + [f"stage-p-r{i}-{r}.creds" for i in range(2) for r in range(2)]
    )
    args, volume = _pod(manifests, "StatefulSet", "p-r1")
    assert args[args.index("--nats-creds") + 1] == "/etc/wavepp-nats/stage-$(WAVEPP_RANK).creds"
    assert volume["items"] == [
        {"key": "stage-p-r1-0.creds", "path": "stage-0.creds"},
        {"key": "stage-p-r1-1.creds", "path": "stage-1.creds"},
        BUS_KEY_ITEM,
    ]
    args, volume = _pod(manifests, "Deployment", "p-r0-admission")
    assert args[args.index("--nats-creds") + 1] == "/etc/wavepp-nats/creds"
    assert volume["items"] == [{"key": "admission-p-r0.creds", "path": "creds"}, BUS_KEY_ITEM]
    args, volume = _pod(manifests, "Deployment", "p-gateway")
    assert volume["items"] == [{"key": "gateway-p.creds", "path": "creds"}, BUS_KEY_ITEM]


def test_every_pod_reads_the_pipelines_bus_key_derived_from_the_seed(trust: TrustRoot) -> None:
    """In the cluster, as under wavepp up, every bus message is signed: each pod gets
    the pipeline's bus key (stable across reconciles, different per pipeline and namespace)."""
    manifests = _applied(trust)
    key = base64.b64decode(manifests[0]["data"]["bus.key"]).decode()
    BusKey.from_hex(key)  # 64 hex digits: a usable key
    assert key == base64.b64decode(_applied(trust)[0]["data"]["bus.key"]).decode()
    other = plan(
        {"metadata": {"name": "p", "namespace": "other", "uid": "u2", "generation": 1},
         "spec": SPEC},
        Observed(), 1_000_000.0,
        Defaults(image="img:1", nats_url="nats://n:4222", nats_account_seed=trust.account_seed),
    )  # fmt: skip
    other_secret = next(a.manifest for a in other.actions if isinstance(a, Apply))
    assert other_secret["data"]["bus.key"] != manifests[0]["data"]["bus.key"]
    for kind, name in (("StatefulSet", "p-r0"), ("Deployment", "p-r0-admission"),
                       ("Deployment", "p-gateway")):  # fmt: skip
        container = _find(manifests, kind, name)["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["WAVEPP_BUS_KEY_FILE"] == "/etc/wavepp-nats/bus.key", (kind, name)
    # Without an account seed the operator renders no credentials and no key (warned at start).
    container = _find(_applied(None), "Deployment", "p-gateway")["spec"]["template"]["spec"]
    assert "WAVEPP_BUS_KEY_FILE" not in {e["name"] for e in container["containers"][0]["env"]}


def test_rendering_again_gives_the_same_secret_and_scaling_rolls_only_the_gateway(
    trust: TrustRoot,
) -> None:
    first, again = _applied(trust), _applied(trust)
    assert first[0] == again[0]
    scaled = _applied(trust, SPEC | {"replicas": 3})
    for key, value in first[0]["data"].items():
        assert scaled[0]["data"][key] == value or key == "gateway-p.creds"
    assert scaled[0]["data"]["gateway-p.creds"] != first[0]["data"]["gateway-p.creds"]

    def annotation(manifests: list[dict[str, Any]]) -> str:
        template = _find(manifests, "Deployment", "p-gateway")["spec"]["template"]
        return template["metadata"]["annotations"]["wavepp.dev/nats-gateway-permissions"]

    assert annotation(scaled) != annotation(first)


def test_an_own_credentials_secret_or_no_seed_renders_none(trust: TrustRoot) -> None:
    own = _applied(trust, SPEC | {"nats": {"credentialsSecret": "mine"}})
    assert not any(m["kind"] == "Secret" for m in own)
    args, volume = _pod(own, "Deployment", "p-gateway")
    assert volume == {"secretName": "mine"}
    assert args[args.index("--nats-creds") + 1] == "/etc/wavepp-nats/creds"
    bare = _applied(None)
    assert not any(m["kind"] == "Secret" for m in bare)
    assert (
        "--nats-creds"
        not in _find(bare, "Deployment", "p-gateway")["spec"]["template"]["spec"]["containers"][0][
            "args"
        ]
    )


async def test_rendered_users_against_a_real_server(trust: TrustRoot, tmp_path: Path) -> None:
    """Only the gateway's rendered user may publish ``wavepp.ns.p.prefill``; a stage's may publish
    its done but not the plan; a client without credentials is refused."""
    creds, config = _rendered_files(trust, tmp_path)
    p0 = ReplicaSubjects(replica_prefix("p-r0", namespace="ns"))
    with EmbeddedNatsServer(config_file=str(config)) as server:

        async def publish(user: str, subject: str) -> list[str]:
            errors: list[str] = []

            async def on_error(exc: Exception) -> None:
                errors.append(str(exc).lower())

            nc = await connect(server.url, name=user, creds=creds[user], error_cb=on_error)
            try:
                await nc.publish(subject, b"{}")
                await flush_in_order(nc)
                await asyncio.sleep(0.2)  # a refusal's callback is a task
            finally:
                await nc.close()
            return errors

        assert await publish("gateway-p", prefill_subject("p", namespace="ns")) == []
        assert await publish("stage-p-r0-1", p0.done) == []
        for user, subject in [
            ("stage-p-r0-0", prefill_subject("p", namespace="ns")),
            ("admission-p-r0", prefill_subject("p", namespace="ns")),
            ("stage-p-r0-1", p0.plan),
            ("stage-p-r1-0", p0.done),  # another replica's stage
        ]:
            errors = await publish(user, subject)
            assert any("permissions violation for publish" in e for e in errors), (user, errors)
        with pytest.raises(Exception, match="Authorization Violation"):
            await connect(server.url, name="anonymous", allow_reconnect=False)


async def test_rendered_users_send_a_round_to_every_stage_with_one_publish(
    trust: TrustRoot, tmp_path: Path
) -> None:
    """Under the rendered JWT credentials: replica 0's admission publishes one round on
    ``{p}.stages.kvb`` and both of its stages answer it into its inbox; a stage may not
    publish there, and replica 1's stage may not read it."""
    from wavepp.api.kv_batch import BatchOp, KVBatch, encode_batch
    from wavepp.api.kv_reply import decode_reply
    from wavepp.runtime.agreement import StageUnavailableError
    from wavepp.runtime.agreement.nats_client import NatsStageClient, serve_stage_kv
    from wavepp.runtime.kv import BlockPool, StageKVManager

    creds, config = _rendered_files(trust, tmp_path)
    p0 = ReplicaSubjects(replica_prefix("p-r0", namespace="ns"))
    with EmbeddedNatsServer(config_file=str(config)) as server:
        errors: dict[str, list[str]] = {}

        async def open_as(user: str):  # noqa: ANN202
            errors[user] = []

            async def on_error(exc: Exception) -> None:
                errors[user].append(str(exc).lower())

            return await connect(server.url, name=user, creds=creds[user], error_cb=on_error)

        stages = [await open_as(f"stage-p-r0-{rank}") for rank in (0, 1)]
        admission = await open_as("admission-p-r0")
        other = await open_as("stage-p-r1-0")
        try:
            for rank, nc in enumerate(stages):
                await serve_stage_kv(nc, p0.prefix, rank, StageKVManager(BlockPool(8, 4)))
                await flush_in_order(nc)
            clients = NatsStageClient.for_replica(admission, p0.prefix, 2, timeout_s=5.0)
            payload = encode_batch(KVBatch(BatchOp.RELEASE, ("nothing",)))
            replies = None
            for _ in range(10):  # the stages' interest reaches the admission a moment later
                try:
                    replies = await NatsStageClient.call_batch_all(clients, payload)
                    break
                except StageUnavailableError:
                    await asyncio.sleep(0.1)
            assert replies is not None and [decode_reply(r).rank for r in replies] == [0, 1]
            assert not any(errors.values()), errors
            await stages[1].publish(p0.stages_kv_batch, payload)
            await other.subscribe(p0.stages_kv_batch)
            for nc in (stages[1], other):
                await flush_in_order(nc)
            await asyncio.sleep(0.2)  # a refusal's callback is a task
            assert any("permissions violation for publish" in e for e in errors["stage-p-r0-1"])
            assert any(
                "permissions violation for subscription" in e for e in errors["stage-p-r1-0"]
            )
        finally:
            for nc in (*stages, admission, other):
                await nc.close()


async def test_rendered_stage_users_meet_through_the_rendezvous_watch(
    trust: TrustRoot, tmp_path: Path
) -> None:
    """Under the rendered JWT credentials both stages of replica 0 open their rendezvous bucket,
    join epoch 1 through its KV watch and see each other's beats, with no permission refused."""
    from wavepp.runtime.stage.rendezvous import open_rendezvous

    creds, config = _rendered_files(trust, tmp_path)
    with EmbeddedNatsServer(config_file=str(config)) as server:
        errors: list[str] = []

        async def on_error(exc: Exception) -> None:
            errors.append(str(exc).lower())

        ncs = [
            await connect(server.url, name=u, creds=creds[u], error_cb=on_error)
            for u in ("stage-p-r0-0", "stage-p-r0-1")
        ]
        ranks = [
            await open_rendezvous(nc, "p-r0", rank, 2, namespace="ns")
            for rank, nc in enumerate(ncs)
        ]
        try:
            assert all(r is not None for r in ranks)
            assert await asyncio.gather(*(r.first_epoch() for r in ranks)) == [1, 1]
            joined = asyncio.gather(*(r.join(1) for r in ranks))
            assert await asyncio.wait_for(joined, 10) == [True, True]
            await ranks[1].beat(1, 7)
            deadline = asyncio.get_running_loop().time() + 5
            while (await ranks[0].peer_beats(1))[1] != b"7":
                assert asyncio.get_running_loop().time() < deadline, errors
                await asyncio.sleep(0.05)
            assert errors == []
        finally:
            for r in ranks:
                if r is not None:
                    await r.close()
            for nc in ncs:
                await nc.close()


async def test_deletion_cleanup_under_nats_auth_removes_exactly_the_pools_streams(
    trust: TrustRoot, tmp_path: Path
) -> None:
    """The finalizer's stream cleanup connects as the pool's cleanup user minted from the
    account seed (anonymous is refused under auth); it removes team-a/tiny's streams and
    buckets and leaves team-b/tiny's; the user may delete nothing but what it found."""
    from nats.js.api import KeyValueConfig

    from wavepp.api.permissions import NatsUser, Permissions, cleanup_user
    from wavepp.api.subjects import intake_stream, intake_subject, rendezvous_bucket, results_bucket
    from wavepp.operator.nats_cleanup import delete_pool_streams

    config = tmp_path / "server.conf"
    config.write_text(trust.server_config(str(tmp_path / "js")))
    admin = tmp_path / "admin.creds"
    admin.write_text(trust.user_creds(NatsUser("admin", "admin", Permissions((">",), (">",)))))
    with EmbeddedNatsServer(config_file=str(config)) as server:
        nc = await connect(server.url, name="admin", creds=str(admin))
        js = nc.jetstream()
        for ns in ("team-a", "team-b"):
            await js.add_stream(
                name=intake_stream("tiny-r0", namespace=ns),
                subjects=[intake_subject("tiny-r0", namespace=ns)],
            )
            await js.create_key_value(KeyValueConfig(bucket=results_bucket("tiny", namespace=ns)))
            await js.create_key_value(
                KeyValueConfig(bucket=rendezvous_bucket("tiny-r0", namespace=ns))
            )
        with pytest.raises(Exception, match="Authorization Violation"):
            await delete_pool_streams(server.url, "tiny", namespace="team-a", timeout_s=2)
        removed = await delete_pool_streams(
            server.url, "tiny", namespace="team-a", timeout_s=2, account_seed=trust.account_seed
        )
        assert sorted(removed) == [
            "KV_WAVEPP_RDZV_team-a_tiny-r0",
            "KV_WAVEPP_RESULTS_team-a_tiny",
            "WAVEPP_INTAKE_team-a_tiny-r0",
        ]
        left = sorted(info.config.name for info in await js.streams_info())
        assert left == [
            "KV_WAVEPP_RDZV_team-b_tiny-r0",
            "KV_WAVEPP_RESULTS_team-b_tiny",
            "WAVEPP_INTAKE_team-b_tiny-r0",
        ]
        await nc.drain()
    publish = cleanup_user("tiny", ["S1"], namespace="team-a").permissions.publish
    assert [p for p in publish if "DELETE" in p] == ["$JS.API.STREAM.DELETE.S1"]
