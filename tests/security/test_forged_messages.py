"""One test per forgery kind, on the pure cores.

A forger is any client of the NATS server without the bus key (``wavepp.api.signing``). Each
test makes the attack against the real cores (``forgery_support.MiniPipeline``:
agreement controller, scheduler core and stage cores, no I/O) and checks that the answers, the
pins and the progress of the genuine requests are as without the forger. The gateway's side
(results on the subject, planted bucket entries, heartbeats over a real nats-server) is in
``test_gateway_forgery.py``.
"""

from __future__ import annotations

import pytest
from forgery_support import BLOCK, MiniPipeline, first_token, forged_done, prompt, snapshot

from wavepp.api.kv_batch import BatchOp, KVBatch, ReserveEntry, encode_batch
from wavepp.api.kv_reply import EntryStatus
from wavepp.api.messages import (
    KVEventBatch,
    MicroBatchPlan,
    PlannedChunk,
    PlanResendReply,
    Renew,
    RequestResult,
)
from wavepp.api.prefill import Heartbeat, PrefillResult
from wavepp.api.signing import BusKey
from wavepp.gateway.router import PoolRouter
from wavepp.gateway.trust import BusGuard
from wavepp.runtime.kv import BlockPool, StageKVManager, hash_prompt_blocks
from wavepp.runtime.request import PromptRequest
from wavepp.runtime.serving.results import result_is_authentic

KEY = BusKey(b"k" * 32)
WRONG_KEY = BusKey(b"w" * 32)


def _requests(n: int = 3) -> list[PromptRequest]:
    return [PromptRequest(f"r{i}", prompt(i, 9 + 11 * i)) for i in range(n)]


def _expected(requests: list[PromptRequest]) -> dict[str, tuple[int, str]]:
    return {r.request_id: (first_token(r.request_id), "") for r in requests}


# ---- done ------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", [KEY, None], ids=["signed", "insecure"])
def test_forged_last_stage_done_with_empty_epoch_is_dropped(key: BusKey | None) -> None:
    """A last-stage done with an empty epoch is dropped like any other forgery: it answers no
    request and releases no pin while the micro-batch computes."""
    pipe = MiniPipeline(key)
    requests = _requests()
    held_before: list[list[str]] = []

    def attacker(tap):  # noqa: ANN001, ANN202
        if tap.point != "plan":
            return
        plan = tap.plans_seen[-1]
        held_before.append([rid for s in pipe.stages for rid in s.manager.request_ids()])
        tap.done(
            forged_done(
                pipe.num_stages - 1,
                plan.microbatch_id,
                [
                    RequestResult(request_id=c.request_id, first_token_id=999_999)
                    for c in plan.chunks
                ],
            )
        )
        # The stages still hold every request the plan names: nothing was released.
        for stage in pipe.stages:
            for c in plan.chunks:
                assert c.request_id in stage.manager.request_ids(), "pins released by a forger"

    answers = pipe.run(requests, attacker)
    assert answers == _expected(requests)
    assert pipe.core.num_forged_dones >= 1


def test_forged_done_with_the_right_epoch_but_no_key_is_dropped() -> None:
    """With a bus key, a done needs the stage's tag: the scheduler's epoch (visible in every
    plan) is not enough; nor is a tag made with another key."""
    pipe = MiniPipeline(KEY)
    requests = _requests()

    def attacker(tap):  # noqa: ANN001, ANN202
        if tap.point != "plan":
            return
        plan = tap.plans_seen[-1]
        forged = forged_done(
            pipe.num_stages - 1,
            plan.microbatch_id,
            [RequestResult(request_id=c.request_id, first_token_id=7) for c in plan.chunks],
            epoch=plan.epoch,
        )
        tap.done(forged)
        tap.done(WRONG_KEY.for_replica("p0").sign(forged))

    assert pipe.run(requests, attacker) == _expected(requests)
    assert pipe.core.num_forged_dones >= 2


def test_a_result_for_a_request_the_microbatch_did_not_finish_is_dropped() -> None:
    """A stage's done may answer only the requests whose last chunk its plan carried (here a
    genuine, signed done of micro-batch m carrying a result for another request)."""
    pipe = MiniPipeline(KEY)
    requests = [PromptRequest("long", prompt(1, 40)), PromptRequest("short", prompt(2, 5))]
    forged_once: list[bool] = []

    def attacker(tap):  # noqa: ANN001, ANN202
        if tap.point != "done" or forged_once:
            return
        plan = tap.plans_seen[-1]
        last_ids = {c.request_id for c in plan.chunks if c.is_last}
        if "long" in last_ids:
            return
        # What a buggy (or compromised) last stage could send: right key, wrong request.
        done = tap.dones_seen[-1].model_copy(
            update={
                "results": [RequestResult(request_id="long", first_token_id=5)],
                "rank": pipe.num_stages - 1,
                "mac": "",
            }
        )
        tap.done(pipe.key.sign(done))
        forged_once.append(True)

    assert pipe.run(requests, attacker) == _expected(requests)
    assert forged_once and pipe.core.num_forged_dones >= 1


# ---- plan id ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mac", ["", "0" * 32, "wrong-key"])
def test_forged_plan_with_the_next_id_cannot_make_the_real_one_a_duplicate(mac: str) -> None:
    """A forged plan carrying the scheduler's epoch and the next id is dropped, so no stage
    takes the real plan for a duplicate and the request completes."""
    pipe = MiniPipeline(KEY)
    requests = _requests()

    def attacker(tap):  # noqa: ANN001, ANN202
        if tap.point != "plan":
            return
        real = tap.plans_seen[-1]
        forged = MicroBatchPlan(
            microbatch_id=real.microbatch_id,
            chunks=[
                PlannedChunk(
                    request_id=c.request_id,
                    chunk_index=c.chunk_index,
                    context_offset=c.context_offset,
                    token_ids=[1] * len(c.token_ids),
                    is_last=False,  # run, the real last chunks would never be
                )
                for c in real.chunks
            ],
            epoch=real.epoch,
        )
        if mac == "wrong-key":
            forged = WRONG_KEY.for_replica("p0").sign(forged)
        else:
            forged = forged.model_copy(update={"mac": mac})
        for rank in range(pipe.num_stages):
            tap.plan(rank, forged)

    assert pipe.run(requests, attacker) == _expected(requests)
    assert all(stage.num_forged >= 1 for stage in pipe.stages)
    assert all(stage.sequencer.num_duplicates == 0 for stage in pipe.stages)


def test_a_plan_of_an_epoch_the_stage_left_is_dropped() -> None:
    """A captured genuine plan of an earlier scheduler, sent again, cannot reset a stage's
    sequence (it would make the current epoch's next plans wait on a hole)."""
    old = MiniPipeline(KEY)
    old.run(_requests(1))
    old_plan = old.genuine_plans[0]
    pipe = MiniPipeline(KEY)
    for rank in range(pipe.num_stages):  # the stages served the earlier scheduler first
        pipe.deliver_plan(rank, old_plan)
    pipe.pending_dones.clear()
    requests = _requests()
    sent: list[bool] = []

    def attacker(tap):  # noqa: ANN001, ANN202
        if tap.point == "done" and not sent:
            for rank in range(pipe.num_stages):
                tap.plan(rank, old_plan)
            sent.append(True)

    assert pipe.run(requests, attacker) == _expected(requests)
    assert all(stage.sequencer.epoch == pipe.core.epoch for stage in pipe.stages)


def test_forged_resend_reply_is_ignored() -> None:
    """A resend reply decides which ids a stage skips: one without the scheduler's tag is not
    applied (the worker asks again)."""
    pipe = MiniPipeline(KEY)
    pipe.run(_requests(1))
    stage = pipe.stages[0]
    forged = PlanResendReply(epoch=pipe.core.epoch, next_id=10**6, plans=[])
    assert stage.resend_items(forged) is None
    genuine = pipe.key.sign(PlanResendReply(epoch=pipe.core.epoch, next_id=3, plans=[]))
    assert stage.resend_items(genuine) == []


# ---- reservation hog, release of in-flight ids -----------------------------------------------


def _hog(num_blocks: int, *, owner: str = "", seq: int = 1, lease_s: float = 3600) -> KVBatch:
    """A round probe-reserving ``num_blocks`` blocks for one request, id "hog"."""
    hashes = hash_prompt_blocks(list(range(1, num_blocks * BLOCK + 1)), BLOCK, "m")
    entry = ReserveEntry("hog", tuple(hashes), num_blocks)
    return KVBatch(BatchOp.PROBE_RESERVE, (entry,), lease_s, owner=owner, seq=seq)


@pytest.mark.parametrize("key", [None, WRONG_KEY])
def test_forged_reservation_hog_is_refused(key: BusKey | None) -> None:
    """A forged round reserving every free block with a 3,600 s lease (renewable), unsigned or
    signed with another key, is refused whole; so is its renewal."""
    pipe = MiniPipeline(KEY)
    stage = pipe.stages[0]
    before = snapshot(stage.manager)
    round_reply = pipe.send_kv(0, encode_batch(_hog(stage.manager.pool.num_free_blocks), key))
    assert "mac" in round_reply.error and not round_reply.results
    renew = Renew(request_ids=["hog"], lease_s=3600, mac="f" * 32 if key else "")
    reply = stage.handle_kv(renew.model_dump_json().encode())
    assert not reply.ok and "mac" in reply.error
    assert snapshot(stage.manager) == before
    requests = _requests()
    assert pipe.run(requests) == _expected(requests)


def test_a_lease_past_the_replicas_lease_is_refused_even_when_signed() -> None:
    """A signed op (a confused or compromised owner) still cannot hold blocks for an hour."""
    pipe = MiniPipeline(KEY)
    stage = pipe.stages[0]
    reply = pipe.send_kv(0, encode_batch(_hog(1, owner="o"), pipe.key))
    (result,) = reply.results
    assert result.status is EntryStatus.INVALID and "max_lease_s" in result.error
    assert stage.manager.num_requests == 0


def test_an_owner_cannot_hold_more_than_its_cap() -> None:
    manager = StageKVManager(BlockPool(32, BLOCK), max_blocks_per_owner=8)
    hashes = hash_prompt_blocks(list(range(1, 41)), BLOCK, "m")
    manager.probe_pin("a", hashes, 30.0, owner="o1")
    assert manager.reserve("a", 10, 30.0, owner="o1") is None  # 10 > 8: refused, pins gone
    assert manager.num_requests == 0
    manager.probe_pin("b", hashes[:6], 30.0, owner="o1")
    assert manager.reserve("b", 6, 30.0, owner="o1") is not None
    manager.probe_pin("c", hashes[:3], 30.0, owner="o1")
    assert manager.reserve("c", 3, 30.0, owner="o1") is None  # 6 + 3 > 8
    manager.probe_pin("d", hashes[:8], 30.0, owner="o2")
    assert manager.reserve("d", 8, 30.0, owner="o2") is not None  # another owner's cap


def _is_release(payload: bytes) -> bool:
    return payload[:3] == b"WKB" and payload[4] == BatchOp.RELEASE


@pytest.mark.parametrize("how", ["unsigned", "other-owner", "repeated"])
def test_release_of_in_flight_ids_by_a_forger_frees_nothing(how: str) -> None:
    """A forged release naming in-flight request ids (visible in the plans) must not free
    blocks in use. Unsigned, signed by another owner, or a captured signed release sent again:
    none frees a pinned block, and every answer is right."""
    pipe = MiniPipeline(KEY)
    requests = _requests()
    sent = []

    def attacker(tap):  # noqa: ANN001, ANN202
        if tap.point != "plan":
            return
        ids = tuple(c.request_id for c in tap.plans_seen[-1].chunks)
        if how == "unsigned":
            release = KVBatch(BatchOp.RELEASE, ids, owner=pipe.controller.owner, seq=10**6)
            payload = encode_batch(release)
        elif how == "other-owner":
            release = KVBatch(BatchOp.RELEASE, ids, owner="someone-else", seq=1)
            payload = encode_batch(release, pipe.key)
        else:
            releases = [p for r, p in tap.kv_seen if _is_release(p) and r == 0]
            if not releases:
                return
            payload = releases[-1]  # a genuine, signed release seen earlier
        for rank in range(pipe.num_stages):
            before = snapshot(pipe.stages[rank].manager)
            tap.kv(rank, payload)
            assert snapshot(pipe.stages[rank].manager) == before
        sent.append(payload)

    assert pipe.run(requests, attacker) == _expected(requests)
    assert sent  # the attack was made


def test_a_repeated_signed_round_is_refused() -> None:
    """Capturing the owner's own signed rounds and sending them again (to re-pin a finished
    request's blocks, or to release another's) is refused by the op numbers."""
    pipe = MiniPipeline(KEY)
    requests = _requests()
    pipe.run(requests)
    stage = pipe.stages[0]
    before = snapshot(stage.manager)
    captured = [payload for rank, payload in pipe.kv_log if rank == 0]
    assert any(_is_release(p) for p in captured) and not all(_is_release(p) for p in captured)
    for payload in captured:
        assert "repeated" in pipe.send_kv(0, payload).error
    assert snapshot(stage.manager) == before


# ---- heartbeat -------------------------------------------------------------------------------


def _beat(ready: bool, seq: int, sent_at_s: float, instance: str = "i1") -> Heartbeat:
    return Heartbeat(
        pipeline="p0",
        ready=ready,
        num_stages_formed=2,
        num_inflight=0,
        instance=instance,
        seq=seq,
        sent_at_s=sent_at_s,
    )


def test_forged_heartbeats_are_refused_and_beats_are_rate_limited() -> None:
    """A forged heartbeat neither flaps /readyz (``ready: false``) nor keeps a dead replica
    routed (``ready: true``). Refused: unsigned, another replica's tag, the wrong subject, a
    repeated (or too old) genuine one; and at most one per 0.1 s per replica."""
    guard = BusGuard(KEY, ["p0", "p1"])
    key0 = KEY.for_replica("p0")
    wall = 5000.0
    assert guard.heartbeat("p0", key0.sign(_beat(True, 1, wall)), 0.0, wall)
    assert not guard.heartbeat("p0", _beat(False, 2, wall), 0.5, wall)  # unsigned
    assert not guard.heartbeat("p0", KEY.for_replica("p1").sign(_beat(False, 2, wall)), 0.5, wall)
    assert not guard.heartbeat("p1", key0.sign(_beat(False, 2, wall)), 0.5, wall)  # subject
    assert not guard.heartbeat("p0", key0.sign(_beat(True, 1, wall)), 0.5, wall)  # repeated
    assert not guard.heartbeat("p0", key0.sign(_beat(True, 9, wall - 60)), 0.5, wall)  # old
    assert guard.heartbeat("p0", key0.sign(_beat(True, 2, wall)), 0.5, wall)
    # A burst of genuine-looking beats: one per min_heartbeat_interval_s counts.
    accepted = sum(
        guard.heartbeat("p0", key0.sign(_beat(True, 3 + i, wall)), 1.0 + i * 0.001, wall)
        for i in range(100)
    )
    assert accepted == 1
    assert guard.num_refused["heartbeat"] == 3


def test_a_drains_first_beat_passes_the_rate_limit_once() -> None:
    """A drain's first beat arriving within 0.1 s of the one before (beats bunch in transit on
    a loaded host) was refused, so the gateway kept a leaving replica ready. It passes the
    rate limit once; repeats and alternations are still limited."""
    guard = BusGuard(KEY, ["p0"])
    key0 = KEY.for_replica("p0")
    wall = 5000.0

    def beat(seq: int, draining: bool) -> Heartbeat:
        return key0.sign(_beat(not draining, seq, wall).model_copy(update={"draining": draining}))

    assert guard.heartbeat("p0", beat(1, False), 0.0, wall)
    assert guard.heartbeat("p0", beat(2, True), 0.02, wall)  # the drain starts: not limited
    assert not guard.heartbeat("p0", beat(3, True), 0.04, wall)  # a second: limited
    assert not guard.heartbeat("p0", beat(4, False), 0.06, wall)
    assert guard.heartbeat("p0", beat(5, False), 0.2, wall)
    accepted = sum(
        guard.heartbeat("p0", beat(6 + i, i % 2 == 1), 0.35 + i * 0.001, wall) for i in range(100)
    )
    assert accepted == 2  # one ordinary beat, one drain start: the flood stays bounded


# ---- results, planted results ------------------------------------------------------------------


def _result(replica: str, token: int = 1) -> PrefillResult:
    return PrefillResult(request_id="r1", tenant="t", replica=replica, first_token_id=token)


def test_results_only_from_the_replica_routed_to_and_signed_by_it() -> None:
    guard = BusGuard(KEY, ["p0", "p1"])
    genuine = KEY.for_replica("p0").sign(_result("p0"))
    assert guard.result(genuine, {"p0"})
    assert not guard.result(_result("p0", 9), {"p0"})  # unsigned
    assert not guard.result(KEY.for_replica("p1").sign(_result("p1")), {"p0"})  # not routed
    assert not guard.result(WRONG_KEY.for_replica("p0").sign(_result("p0")), {"p0"})


def test_planted_bucket_entries_are_not_answers() -> None:
    """An entry planted in the results bucket is not an answer for its request id, to the
    gateway or to a redelivering admission service."""
    guard = BusGuard(KEY, ["p0"])
    genuine = KEY.for_replica("p0").sign(_result("p0"))
    assert guard.stored("t.r1", genuine)
    assert not guard.stored("t.r1", _result("p0", 9))
    assert not guard.stored("t.other", genuine)  # a genuine entry moved under another key
    assert result_is_authentic(KEY, "t.r1", genuine)
    assert not result_is_authentic(KEY, "t.r1", _result("p0", 9))
    assert not result_is_authentic(KEY, "t.r2", genuine)


# ---- KV-event flood ----------------------------------------------------------------------------


def test_kv_event_flood_cannot_grow_the_router_index_past_the_stage_block_count() -> None:
    """A flood of stored-block events does not grow the gateway's index without bound: each
    stage's index holds at most that stage's block count; the newest hashes stay."""
    router = PoolRouter([("p0", 2, [64, 32])])
    batch = [bytes([i % 256, i // 256 % 256, i // 65536]) + b"\0" * 29 for i in range(100_000)]
    for start in range(0, len(batch), 1000):
        router.on_kv_events("p0", 0, [batch[start : start + 1000]], [])
        router.on_kv_events("p0", 1, [batch[start : start + 1000]], [])
    state = router.by_name["p0"]
    assert [len(h) for h in state.held] == [64, 32]
    assert state.num_reusable_blocks(batch[-32:]) == 32  # the newest are kept
    guard = BusGuard(KEY, ["p0"])
    forged = KVEventBatch(rank=0, stored=[[b.hex() for b in batch[:2]]])
    assert not guard.kv_events("p0", forged, 2)
    assert guard.kv_events("p0", KEY.for_replica("p0").sign(forged), 2)
    assert not guard.kv_events(
        "p0", KEY.for_replica("p0").sign(forged.model_copy(update={"rank": 5})), 2
    )


def test_the_schedulers_eviction_counter_takes_only_its_stages_kv_events() -> None:
    """A forged batch neither inflates the eviction metric nor adds a label per made-up rank."""
    import asyncio
    from types import SimpleNamespace

    from wavepp.runtime.scheduling.stats import WaveStats
    from wavepp.telemetry.pipeline import PipelineTelemetry

    key = KEY.for_replica("p0")
    telemetry = PipelineTelemetry("p0", 2, WaveStats(), dict, bus_key=key)
    counted: list[tuple[int, int]] = []
    telemetry.kv_removed = lambda rank, n: counted.append((rank, n))  # type: ignore[method-assign]
    batch = KVEventBatch(rank=1, removed=[["ab" * 32, "cd" * 32]])
    for msg in (batch, batch.model_copy(update={"rank": 10**6}), key.sign(batch)):
        asyncio.run(telemetry._on_kv_events(SimpleNamespace(data=msg.model_dump_json().encode())))
    assert counted == [(1, 2)]


def _joining_beat(name: str) -> Heartbeat:
    return Heartbeat(
        pipeline=name, ready=True, num_stages_formed=1, num_inflight=0, instance="i",
        pool="p", num_stages=1, seq=1, sent_at_s=100.0,
    )  # fmt: skip


@pytest.mark.parametrize("keyed", [True, False], ids=["bus-key", "insecure"])
def test_added_replicas_are_authenticated_bounded_and_forgotten(keyed: bool) -> None:
    """``add_replica`` keeps a name only when its heartbeat names it (and, with the bus key, is
    signed with that replica's key), at most ``max_added`` added names; a forgotten added name
    frees its slot, a configured one stays."""
    key = KEY if keyed else None
    guard = BusGuard(key, ["p0"], max_added=2)

    def beat(name: str) -> Heartbeat:
        plain = _joining_beat(name)
        return KEY.for_replica(name).sign(plain) if keyed else plain

    if keyed:  # unsigned, or signed with another replica's key: nothing kept
        assert not guard.add_replica("x", _joining_beat("x"))
        assert not guard.add_replica("x", KEY.for_replica("y").sign(_joining_beat("x")))
        assert guard.replicas == ["p0"] and guard.num_refused["heartbeat_unknown"] == 2
    assert not guard.add_replica("x", beat("y"))  # a beat naming another replica
    assert guard.add_replica("a", beat("a")) and guard.add_replica("b", beat("b"))
    assert not guard.add_replica("c", beat("c"))  # max_added reached
    assert guard.add_replica("a", beat("a")) and guard.add_replica("p0", beat("p0"))  # known
    assert guard.heartbeat("a", beat("a"), now_s=1.0, wall_s=100.0)
    guard.forget_replica("a")
    guard.forget_replica("p0")  # configured: kept
    assert guard.replicas == ["p0", "b"] and "a" not in guard._last_beat_s  # noqa: SLF001
    assert not guard.heartbeat("a", beat("a"), now_s=2.0, wall_s=100.0)  # forgotten
    assert guard.add_replica("c", beat("c"))  # its slot is free again
    with pytest.raises(ValueError, match="pipeline"):
        Heartbeat.model_validate_json(
            _joining_beat("n").model_dump_json().replace('"n"', '"' + "n" * 259 + '"', 1)
        )
