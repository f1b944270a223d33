"""Replica health that routing obeys, and the pieces of an in-place re-form: the router's pool
is the ready replicas; the gateway follows heartbeats at run time and is ready while one replica
admits; the admission's pause/resume decisions; the stages' epoch
rendezvous over a real nats-server with JetStream; and a gloo group re-formed in one process
after a member left (what ``StageWorker._reform`` relies on)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
import torch.distributed as dist
from gateway_support import tiny_gateway_config

from wavepp.api.prefill import Heartbeat
from wavepp.api.subjects import heartbeat_subject
from wavepp.gateway.config import GatewayConfig, ReplicaInfo, ReplicaUnavailable
from wavepp.gateway.core import Gateway
from wavepp.gateway.router import PoolRouter
from wavepp.gateway.validation import ParsedRequest
from wavepp.runtime.serving.reform import ReformTracker
from wavepp.runtime.stage.rendezvous import (
    EpochRendezvous,
    StageGroupFactory,
    decide_join,
    open_rendezvous,
    parse_dist_url,
)
from wavepp.runtime.transport.natsio import EmbeddedNatsServer, connect, flush_in_order, free_port

pytestmark = pytest.mark.timeout(60)


# ---- the router's pool ---------------------------------------------------------------------


def test_a_replica_that_is_not_ready_leaves_the_pool_and_gets_no_request() -> None:
    router = PoolRouter([("a", 2), ("b", 2)], timeout_s=3.0)
    router.on_heartbeat("a", 10.0, is_ready=True)
    router.on_heartbeat("b", 10.0, is_ready=True)
    assert [r.name for r in router.pool(10.5)] == ["a", "b"]
    router.on_heartbeat("a", 11.0, is_ready=False)  # a stage died: alive, not ready
    assert router.is_alive("a", 11.0) and not router.in_pool("a", 11.0)
    assert [r.name for r in router.pool(11.0)] == ["b"]
    assert {router.choose([b"h"], 11.0)[0].name for _ in range(4)} == {"b"}
    router.on_heartbeat("a", 12.0, is_ready=True)
    assert {router.choose([b"h"], 12.0)[0].name for _ in range(4)} == {"a", "b"}


def test_replicas_join_and_leave_at_run_time() -> None:
    router = PoolRouter([("a", 2)], timeout_s=3.0)
    router.add_replica("c", 3)
    assert router.add_replica("c", 3) is router.by_name["c"]
    router.on_heartbeat("c", 1.0, is_ready=True)
    router.on_kv_events("c", 2, [[b"x"]], [])
    assert [r.name for r in router.pool(1.0)] == ["c"]
    router.forget("a")
    router.forget("unknown")
    assert [r.name for r in router.replicas] == ["c"]
    assert router.choose([b"x"], 1.5) == (router.by_name["c"], 0)
    with pytest.raises(ValueError, match="num_stages=0"):
        router.add_replica("d", 0)


def _gateway_config(**overrides: object) -> GatewayConfig:
    return tiny_gateway_config(model_id="m", max_prompt_tokens=1024, **overrides)


async def test_gateway_follows_the_pool_and_is_ready_while_one_replica_admits() -> None:
    now = [100.0]
    with EmbeddedNatsServer(jetstream=True) as server:
        nc = await connect(server.url, name="test-gateway")
        gateway = Gateway(_gateway_config(replica_forget_s=30.0), nc, clock=lambda: now[0])
        await gateway.start()
        try:

            async def beat(
                pipeline: str, *, ready: bool, pool: str = "p", namespace: str = "local"
            ) -> None:
                data = Heartbeat(
                    pipeline=pipeline,
                    ready=ready,
                    num_stages_formed=2 if ready else 1,
                    num_inflight=0,
                    instance="i",
                    pool=pool,
                    num_stages=2,
                ).model_dump_json()
                await nc.publish(heartbeat_subject(pipeline, namespace=namespace), data.encode())
                await flush_in_order(nc)
                await asyncio.sleep(0.2)
                now[0] += 0.2  # the gateway takes one heartbeat per replica per 0.1 s

            assert not gateway.is_ready()
            await beat("p-r1", ready=True)  # scaled up: not configured
            await beat("q-r0", ready=True, pool="q")  # another pool's replica
            # the same pool name in another namespace is another pool
            await beat("p-r2", ready=True, namespace="other")
            assert sorted(gateway.router.by_name) == ["p-r0", "p-r1"]
            assert gateway.is_ready(), "one replica of two admits: ready"
            await beat("p-r0", ready=True)
            await beat("p-r1", ready=False)  # a stage of r1 died
            assert [r.name for r in gateway.router.pool(now[0])] == ["p-r0"]
            assert gateway.load().is_replica_up == {"p-r0": True, "p-r1": False}
            assert gateway.is_ready()
            now[0] += 31.0  # r1 scaled away: silent past replica_forget_s
            await beat("p-r0", ready=True)
            assert sorted(gateway.router.by_name) == ["p-r0"]
            await beat("p-r1", ready=True)  # and back
            assert sorted(gateway.router.by_name) == ["p-r0", "p-r1"]
        finally:
            await gateway.stop()
            await nc.close()


async def test_a_request_on_a_replica_that_left_the_pool_fails_fast_without_another() -> None:
    """Admitted on p-r0 while it was in the pool; p-r0 turns not ready (a stage died) and no
    replica takes over: the request fails with ReplicaUnavailable within seconds (it waited
    for request_timeout_s, 120 s, before)."""
    with EmbeddedNatsServer(jetstream=True) as server:
        nc = await connect(server.url, name="test-gateway-unready")
        gateway = Gateway(_gateway_config(replica_unready_fail_s=1.0), nc)
        await gateway.start()
        try:

            async def beat(*, ready: bool) -> None:
                data = Heartbeat(
                    pipeline="p-r0",
                    ready=ready,
                    num_stages_formed=2 if ready else 1,
                    num_inflight=0,
                    instance="i",
                    pool="p",
                    num_stages=2,
                ).model_dump_json()
                await nc.publish(heartbeat_subject("p-r0", namespace="local"), data.encode())
                await flush_in_order(nc)
                await asyncio.sleep(0.1)

            await beat(ready=True)
            request = ParsedRequest(tenant="default", request_id="r1", token_ids=[1, 2, 3])
            task = asyncio.create_task(gateway.prefill(request))
            await asyncio.sleep(0.5)
            assert not task.done()
            started = asyncio.get_running_loop().time()
            await beat(ready=False)
            with pytest.raises(ReplicaUnavailable, match="p-r0 left the pool"):
                await asyncio.wait_for(task, 10)
            assert asyncio.get_running_loop().time() - started < 3.0
        finally:
            await gateway.stop()
            await nc.close()


def test_a_draining_replica_leaves_the_pool_and_gets_nothing_new_while_others_exist() -> None:
    router = PoolRouter([("a", 1), ("b", 1)], timeout_s=3.0)
    router.on_heartbeat("a", 10.0, is_ready=True)
    router.on_heartbeat("b", 10.0, is_ready=True, is_draining=True)  # told to stop
    assert [r.name for r in router.pool(10.0)] == ["a"]
    assert router.is_finishing("b", 10.0) and not router.is_finishing("a", 10.0)
    assert not router.is_finishing("b", 13.5), "silent: no longer finishing anything"
    router.on_heartbeat("a", 11.0, is_ready=False)  # a stage of a died: no replica in the pool
    assert {router.choose([b"h"], 11.0)[0].name for _ in range(4)} == {"a"}, "b takes nothing"
    assert router.choose([b"h"], 11.0, exclude=["a"])[0].name == "b"  # the last resort


async def test_the_gateway_waits_for_a_draining_replica_and_reroutes_only_if_it_goes_silent() -> (
    None
):
    """p-r0 drains (a scale-down) with a request of ours: the gateway neither re-sends it to
    p-r1 nor fails it while p-r0 beats, and takes p-r0's answer; a second request on p-r0 is
    re-sent to p-r1 once p-r0 falls silent (it exited without answering)."""
    from wavepp.api.prefill import PrefillResult
    from wavepp.api.subjects import intake_stream, result_subject

    now = [100.0]
    with EmbeddedNatsServer(jetstream=True) as server:
        nc = await connect(server.url, name="test-gateway-drain")
        config = _gateway_config(replica_unready_fail_s=0.5)
        config.replicas.append(ReplicaInfo(pipeline="p-r1", num_stages=2))
        gateway = Gateway(config, nc, clock=lambda: now[0])
        await gateway.start()
        js = nc.jetstream()

        async def beat(pipeline: str, *, ready: bool, draining: bool = False) -> None:
            data = Heartbeat(
                pipeline=pipeline,
                ready=ready,
                num_stages_formed=2,
                num_inflight=1,
                instance="i",
                pool="p",
                num_stages=2,
                draining=draining,
            ).model_dump_json()
            await nc.publish(heartbeat_subject(pipeline, namespace="local"), data.encode())
            await flush_in_order(nc)
            await asyncio.sleep(0.15)
            now[0] += 0.15

        async def queued(pipeline: str) -> int:
            info = await js.stream_info(intake_stream(pipeline, namespace="local"))
            return info.state.messages

        try:
            await beat("p-r0", ready=True)
            request = ParsedRequest(tenant="default", request_id="r1", token_ids=[1, 2, 3])
            task = asyncio.create_task(gateway.prefill(request))
            await asyncio.sleep(0.3)
            assert await queued("p-r0") == 1
            await beat("p-r1", ready=True)
            for _ in range(6):  # ~1 s of draining beats, past replica_unready_fail_s
                await beat("p-r0", ready=False, draining=True)
                await beat("p-r1", ready=True)
            assert not task.done() and await queued("p-r1") == 0, "re-routed from a drain"
            assert [r.name for r in gateway.router.pool(now[0])] == ["p-r1"]
            answer = PrefillResult(
                request_id="r1", tenant="default", replica="p-r0", first_token_id=7,
                num_prompt_tokens=3, num_cached_tokens=0, ttft_s=0.1,
            )  # fmt: skip
            await nc.publish(
                result_subject("p", "default.r1", namespace="local"),
                answer.model_dump_json().encode(),
            )
            result, _ = await asyncio.wait_for(task, 5)
            assert result.replica == "p-r0" and result.first_token_id == 7
            # a request still on p-r0 when it exits (drain timeout): re-sent once it is silent
            gateway.router.on_heartbeat("p-r1", now[0], is_ready=False)  # route to p-r0 only
            gateway.router.on_heartbeat("p-r0", now[0], is_ready=True)
            request = ParsedRequest(tenant="default", request_id="r2", token_ids=[4, 5, 6])
            task = asyncio.create_task(gateway.prefill(request))
            await asyncio.sleep(0.3)
            assert await queued("p-r0") == 2
            await beat("p-r0", ready=False, draining=True)
            await beat("p-r1", ready=True)
            now[0] += 3.5  # p-r0 exited: no beat past replica_timeout_s
            await beat("p-r1", ready=True)
            # The jump also outdates the gateway's last answer from the server (its bus check
            # runs every 0.5 s on this fake clock): until the next one the bus reads as silent
            # and nothing is re-routed; then the silent replica's request moves.
            for _ in range(30):
                if await queued("p-r1") == 1:
                    break
                await asyncio.sleep(0.1)
            assert await queued("p-r1") == 1, "not re-routed from a silent replica"
            task.cancel()
        finally:
            await gateway.stop()
            await nc.close()


# ---- the admission around a re-form --------------------------------------------------------


def test_reform_tracker_pauses_then_readmits_only_on_a_new_epoch() -> None:
    tracker = ReformTracker()
    assert tracker.observe(True, (1, 1)) == "none"
    assert tracker.observe(False) == "pause"  # a stage died
    assert tracker.observe(False) == "none"
    assert tracker.is_paused
    assert tracker.observe(True, (2, 2)) == "readmit"  # re-formed in epoch 2
    assert not tracker.is_paused and tracker.num_reforms == 1
    assert tracker.observe(False) == "pause"  # a slow probe
    assert tracker.observe(True, (2, 2)) == "resume"
    assert tracker.observe(True, (3, 3)) == "readmit"  # re-formed between two probes
    assert tracker.num_reforms == 2


# ---- the rendezvous ------------------------------------------------------------------------


def test_decide_join_and_dist_url() -> None:
    assert decide_join(None, False).epoch == 1
    assert decide_join(4, False) == decide_join(4, False) and not decide_join(4, False).bump
    assert decide_join(4, True).epoch == 5 and decide_join(4, True).bump
    assert parse_dist_url("tcp://stage-0.p:29500") == ("stage-0.p", 29500)
    with pytest.raises(ValueError, match="--dist-url"):
        parse_dist_url("env://")


async def test_epoch_rendezvous_a_restarted_rank_starts_an_epoch_the_survivor_joins() -> None:
    with EmbeddedNatsServer(jetstream=True) as server:
        nc = await connect(server.url, name="test-rdzv")
        try:
            ranks = [await open_rendezvous(nc, "p-r0", rank, 2, namespace="t") for rank in range(2)]
            assert all(isinstance(r, EpochRendezvous) for r in ranks)
            first = await asyncio.gather(*(r.first_epoch() for r in ranks))
            assert first == [1, 1]
            assert await asyncio.gather(*(r.join(1) for r in ranks)) == [True, True]
            restarted = await open_rendezvous(nc, "p-r0", 1, 2, namespace="t")
            assert restarted is not None
            assert await restarted.first_epoch() == 2  # its former process was in epoch 1
            assert await asyncio.wait_for(ranks[0].wait_newer(1), 5) == 2
            joined = await asyncio.gather(ranks[0].join(2), restarted.join(2))
            assert joined == [True, True]
        finally:
            await nc.close()
    with EmbeddedNatsServer(jetstream=False) as plain:
        nc = await connect(plain.url, name="test-rdzv-plain")
        try:
            assert (
                await open_rendezvous(nc, "p-r0", 0, 2, namespace="t") is None
            )  # forms once, as before
        finally:
            await nc.close()


def test_gloo_group_reforms_in_process_after_a_member_left() -> None:
    """Rank 1 blocks receiving from rank 0; rank 0 drops its group (as ``_reform`` does): the
    receive fails at once; both form epoch 2 over the same rank-0 store and exchange again."""
    dist_url = f"tcp://127.0.0.1:{free_port()}"
    factories = [StageGroupFactory(dist_url, rank, 2, "gloo", timeout_s=20) for rank in range(2)]
    groups: list[dist.ProcessGroup | None] = [None, None]
    errors: list[BaseException] = []
    received: list[float] = []

    def form(rank: int, epoch: int) -> None:
        groups[rank] = factories[rank].form(epoch)

    def run(targets: list) -> None:  # noqa: ANN001
        threads = [threading.Thread(target=t, args=a) for t, a in targets]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)

    run([(form, (0, 1)), (form, (1, 1))])
    old = groups[1]
    assert old is not None

    def blocked_receive() -> None:
        try:
            old.recv([torch.zeros(4)], 0, 0).wait()
        except RuntimeError as exc:
            errors.append(exc)

    receiver = threading.Thread(target=blocked_receive)
    receiver.start()
    groups[0] = None  # rank 0 leaves epoch 1
    receiver.join(10)
    assert not receiver.is_alive() and errors, "the blocked receive did not fail"
    old = None  # rank 1 leaves too (its receive failed)
    groups[1] = None
    run([(form, (0, 2)), (form, (1, 2))])

    def send() -> None:
        groups[0].send([torch.full((4,), 7.0)], 1, 0).wait()  # type: ignore[union-attr]

    def receive() -> None:
        tensor = torch.zeros(4)
        groups[1].recv([tensor], 0, 0).wait()  # type: ignore[union-attr]
        received.append(float(tensor.sum()))

    run([(send, ()), (receive, ())])
    assert received == [28.0]
