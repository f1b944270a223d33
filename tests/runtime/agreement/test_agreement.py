"""Prefix agreement: the controller over in-process stages and over a real nats-server."""

from __future__ import annotations

import asyncio

import pytest
from agreement_support import local_stages, served_stages
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wavepp.api.kv_batch import BatchOp, KVBatch, encode_batch
from wavepp.api.kv_reply import KVBatchReply, decode_reply, encode_reply
from wavepp.api.messages import PROTOCOL_VERSION, KVReply, Renew
from wavepp.api.signing import BusKey
from wavepp.api.subjects import ReplicaSubjects
from wavepp.runtime.agreement import (
    AgreementController,
    AgreementRefused,
    StageUnavailableError,
    handle_kv_request,
)
from wavepp.runtime.agreement.nats_client import NatsStageClient
from wavepp.runtime.kv import BlockPool, StageKVManager
from wavepp.runtime.request import PromptRequest
from wavepp.runtime.transport.natsio import EmbeddedNatsServer, connect, flush_in_order

BLOCK = 4
MODEL_ID = "tiny-llama:seed=0"


def make_stages(capacities: list[int]) -> tuple[list[StageKVManager], AgreementController]:
    return local_stages(
        capacities, block_size=BLOCK, model_id=MODEL_ID, lease_s=30.0, stage_capacities=capacities
    )


def compute_all(
    managers: list[StageKVManager],
    controller: AgreementController,
    req: PromptRequest,
    num_agreed_blocks: int = 0,
) -> None:
    """What the stages do once the request's chunks ran (the first at L*): cache its full
    blocks."""
    hashes = controller.block_hashes(req)
    for manager in managers:
        manager.start_chunk(req.request_id, num_agreed_blocks * BLOCK)
        manager.mark_computed(req.request_id, req.num_tokens, hashes)


async def test_agreed_prefix_is_min_over_stages_and_capped_one_token_short() -> None:
    managers, controller = make_stages([32, 32, 32])
    prompt = list(range(20))  # 5 full blocks
    first = await controller.agree(PromptRequest("a", prompt))
    assert first is not None and first.num_agreed_blocks == 0
    compute_all(managers, controller, first.request)
    await controller.release(["a"])
    # Evict the tail of the chain on stage 1 only: the local hits now differ.
    hashes = controller.block_hashes(PromptRequest("x", prompt))
    managers[1].pool.check_invariants()
    assert managers[1].probe_pin("probe", hashes, 5.0) == 5
    managers[1].release("probe")
    filler = managers[1].pool.allocate(32 - 3)  # evicts LRU cached blocks: the chain's tail first
    assert filler is not None
    managers[1].pool.free(filler)
    hit1 = len(managers[1].pool.find_longest_cache_hit(hashes))
    assert 0 < hit1 < 5
    same = await controller.agree(PromptRequest("b", prompt))
    assert same is not None
    assert same.stage_hits[0] == 5 and same.stage_hits[2] == 5 and same.stage_hits[1] == hit1
    # Capped one token short: a fully cached prompt still computes its last block.
    assert same.num_agreed_blocks == min(hit1, (len(prompt) - 1) // BLOCK)
    for manager in managers:
        assert len(manager.block_table("b")) == 5
    await controller.release(["b"])
    for manager in managers:
        assert manager.pool.num_pinned_blocks == 0


async def test_refused_reservation_leaves_no_pins_anywhere() -> None:
    managers, controller = make_stages([16, 6, 16])
    hog = await controller.agree(PromptRequest("hog", list(range(16))))  # 4 blocks each
    assert hog is not None
    refused = await controller.agree(PromptRequest("big", list(range(100, 112))))  # 3 blocks
    assert refused is None
    assert controller.num_refusals == 1
    for manager in managers:
        assert manager.num_requests == 1  # only "hog"
    assert managers[0].pool.num_pinned_blocks == 4
    await controller.release(["hog"])
    retried = await controller.agree(PromptRequest("big", list(range(100, 112))))
    assert retried is not None


async def test_prompt_larger_than_a_stage_is_refused_with_the_numbers() -> None:
    _, controller = make_stages([64, 8])
    with pytest.raises(AgreementRefused, match=r"needs 9 blocks of 4; stage 1 holds 8"):
        await controller.agree(PromptRequest("huge", list(range(33))))


def test_bad_kv_message_gets_a_clear_error_and_changes_nothing() -> None:
    manager = StageKVManager(BlockPool(8, BLOCK))
    reply = handle_kv_request(
        manager, 3, b'{"op": "renew", "request_ids": ["r"], "lease_s": "soon"}'
    )
    assert not reply.ok and reply.rank == 3 and "lease_s" in reply.error
    reply = handle_kv_request(manager, 3, b"not json")
    assert not reply.ok and "invalid KV request" in reply.error
    other = PROTOCOL_VERSION + 1
    reply = handle_kv_request(manager, 3, b'{"v": %d, "op": "health"}' % other)
    assert not reply.ok and "v" in reply.error
    reply = handle_kv_request(manager, 3, b'{"op": "probe_pin", "request_id": "r"}')
    assert not reply.ok and "op" in reply.error  # the two-message agreement is not spoken
    renew = Renew(request_ids=["never-probed"], lease_s=5)
    assert handle_kv_request(manager, 3, renew.model_dump_json().encode()).ok
    assert manager.num_requests == 0 and manager.pool.num_pinned_blocks == 0
    assert not manager.request_ids()


prompts = st.lists(
    st.tuples(
        st.integers(0, 3),  # which shared prefix
        st.integers(1, 24),  # suffix length
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    capacities=st.lists(st.integers(8, 40), min_size=2, max_size=4),
    workload=prompts,
    release_every=st.integers(1, 4),
)
def test_agreement_properties(
    capacities: list[int], workload: list[tuple[int, int]], release_every: int
) -> None:
    """L* never exceeds a stage's hit; a refusal leaves no pins; nothing leaks after release."""

    async def scenario() -> None:
        managers, controller = make_stages(capacities)
        live: list[PromptRequest] = []
        for i, (prefix_id, suffix_len) in enumerate(workload):
            tokens = [prefix_id * 1000 + t for t in range(12)] + [
                i * 100 + t for t in range(suffix_len)
            ]
            request = PromptRequest(f"r{i}", tokens)
            try:
                ticket = await controller.agree(request)
            except AgreementRefused:
                continue
            if ticket is None:
                for manager in managers:  # refused: this request holds nothing anywhere
                    assert request.request_id not in manager._requests  # noqa: SLF001
            else:
                assert ticket.num_agreed_blocks <= min(ticket.stage_hits)
                assert ticket.num_agreed_blocks * BLOCK < request.num_tokens
                for manager, hit in zip(managers, ticket.stage_hits, strict=True):
                    assert manager.num_hit_blocks(request.request_id) == hit  # kept whole
                compute_all(managers, controller, request, ticket.num_agreed_blocks)
                for manager in managers:
                    assert manager.num_agreed_blocks(request.request_id) == ticket.num_agreed_blocks
                live.append(request)
            if len(live) >= release_every:
                await controller.release([r.request_id for r in live])
                live.clear()
            for manager in managers:
                manager.pool.check_invariants()
        await controller.release([r.request_id for r in live])
        for manager in managers:
            assert manager.num_requests == 0
            assert manager.pool.num_pinned_blocks == 0
            assert manager.pool.num_free_blocks == manager.pool.num_blocks

    asyncio.run(scenario())


# --------------------------------------------------------------------------- over real NATS


async def test_agreement_over_a_real_nats_server(nc) -> None:  # noqa: ANN001
    managers, controller = await served_stages(
        nc, "wavepp.t", [32, 12, 32], block_size=BLOCK, model_id=MODEL_ID, timeout_s=2.0,
        fanout=False,
    )  # fmt: skip
    prompt = list(range(16))
    ticket = await controller.agree(PromptRequest("a", prompt))
    assert ticket is not None and ticket.stage_hits == (0, 0, 0)
    hashes = controller.block_hashes(ticket.request)
    for manager in managers:
        manager.mark_computed("a", 16, hashes)
    await controller.release(["a"])
    again = await controller.agree(PromptRequest("b", prompt + [99]))
    assert again is not None and again.num_agreed_blocks == 4 and again.stage_hits == (4, 4, 4)
    too_big = await controller.agree(PromptRequest("c", list(range(500, 540))))  # 10 blocks
    assert too_big is None  # stage 1 has 12 - 5 (pinned by "b") free
    assert all(m.num_requests == 1 for m in managers)
    replies = await controller.health()
    assert [r.rank for r in replies] == [0, 1, 2] and all(isinstance(r, KVReply) for r in replies)


async def test_no_responders_and_timeouts_are_reported_apart(nc) -> None:  # noqa: ANN001
    nobody = NatsStageClient(nc, "wavepp.none", 0, timeout_s=0.5)
    probe = Renew(request_ids=["r"], lease_s=1.0)
    with pytest.raises(StageUnavailableError, match="no stage listens"):
        await nobody.call(probe)

    async def silent(msg) -> None:  # noqa: ANN001
        return None

    await nc.subscribe("wavepp.slow.stage.0.kv", cb=silent)
    await flush_in_order(nc)
    slow = NatsStageClient(nc, "wavepp.slow", 0, timeout_s=0.3)
    with pytest.raises(StageUnavailableError, match="no reply"):
        await slow.call(probe)


async def test_a_batch_fans_out_to_every_stage_and_names_a_missing_one(nc) -> None:  # noqa: ANN001
    """``call_batch_all``: one publish per stage, replies on one subscription, in stage order;
    a stage with no listener or no answer fails the call naming that stage."""

    def answering(rank: int):  # noqa: ANN202
        async def answer(msg) -> None:  # noqa: ANN001
            await msg.respond(bytes([rank]) + msg.data)

        return answer

    async def silent(msg) -> None:  # noqa: ANN001
        return None

    for rank in (0, 1, 2):
        await nc.subscribe(f"wavepp.fan.stage.{rank}.kvb", cb=answering(rank))
    await nc.subscribe("wavepp.fan.stage.3.kvb", cb=silent)
    await flush_in_order(nc)
    clients = [NatsStageClient(nc, "wavepp.fan", rank, timeout_s=0.3) for rank in range(5)]
    for _ in range(3):  # calls reuse the one reply subscription
        replies = await NatsStageClient.call_batch_all(clients[:3], b"x")
        assert replies == [b"\x00x", b"\x01x", b"\x02x"]
    assert await clients[2].call_batch(b"y") == b"\x02y"
    with pytest.raises(StageUnavailableError, match="stage 4: no stage listens"):
        await NatsStageClient.call_batch_all([clients[0], clients[4]], b"x")
    with pytest.raises(StageUnavailableError, match="stage 3: no reply"):
        await NatsStageClient.call_batch_all(clients[:4], b"x")
    assert not clients[0].batch_mux._calls  # nothing left waiting


# ---- one publish per round to a whole replica ({p}.stages.kvb) ------------------------------


def _reply(rank: int, data: bytes = b"") -> bytes:
    """A stage's encoded reply naming ``rank`` (its free-block count carries ``len(data)``)."""
    return encode_reply(KVBatchReply(BatchOp.PROBE_RESERVE, rank, len(data), 8))


class _Spy:
    """Counts the messages on a subject (a second subscriber: the stages still get them)."""

    def __init__(self) -> None:
        self.count = 0

        async def cb(msg) -> None:  # noqa: ANN001
            self.count += 1

        self.cb = cb


async def _stage(nc, prefix: str, rank: int, *, delay_s: float = 0.0, fanout: bool = True):  # noqa: ANN001, ANN202
    """A stage answering batches (after ``delay_s``) on its own subject and, with ``fanout``,
    the replica-wide one; and health asks on its KV subject."""

    async def on_batch(msg) -> None:  # noqa: ANN001
        await asyncio.sleep(delay_s)
        await msg.respond(_reply(rank, msg.data))

    async def on_kv(msg) -> None:  # noqa: ANN001
        await msg.respond(b'{"rank": %d, "ok": true}' % rank)

    subjects = ReplicaSubjects(prefix)
    subs = [
        await nc.subscribe(subjects.stage_kv_batch(rank), cb=on_batch),
        await nc.subscribe(subjects.stage_kv(rank), cb=on_kv),
    ]
    if fanout:
        subs.append(await nc.subscribe(subjects.stages_kv_batch, cb=on_batch))
    await flush_in_order(nc)
    return subs


async def test_a_round_to_a_whole_replica_is_one_publish_answered_in_rank_order(nc) -> None:  # noqa: ANN001
    """``call_batch_all`` over ``for_replica`` clients publishes once on ``{p}.stages.kvb`` (none
    on the per-stage subjects); every stage answers on one reply subject, and the replies come
    back in rank order whatever order they arrive in (stage 0 answers last here)."""
    prefix = "wavepp.one"
    for rank in range(3):
        await _stage(nc, prefix, rank, delay_s=0.03 * (2 - rank))
    fanout, per_stage = _Spy(), _Spy()
    await nc.subscribe(ReplicaSubjects(prefix).stages_kv_batch, cb=fanout.cb)
    await nc.subscribe(ReplicaSubjects(prefix).stage_kv_batch("*"), cb=per_stage.cb)
    await flush_in_order(nc)
    clients = NatsStageClient.for_replica(nc, prefix, 3, timeout_s=2.0)
    for round_ in range(3):
        replies = await NatsStageClient.call_batch_all(clients, b"x" * round_)
        assert [decode_reply(r).rank for r in replies] == [0, 1, 2]
        assert {decode_reply(r).num_free_blocks for r in replies} == {round_}
    await flush_in_order(nc)
    await asyncio.sleep(0.05)
    assert (fanout.count, per_stage.count) == (3, 0)
    # a single stage's call keeps its own subject
    assert decode_reply(await clients[1].call_batch(b"y")).rank == 1
    await flush_in_order(nc)
    await asyncio.sleep(0.05)
    assert (fanout.count, per_stage.count) == (3, 1)
    assert not clients[0].batch_mux._calls


async def test_a_subset_of_a_replica_is_sent_per_stage_never_to_the_others(nc) -> None:  # noqa: ANN001
    """Clients that are not a whole replica (two of three, or made without ``num_stages``) keep
    one publish per stage: the fan-out subject would reach a stage the call does not name."""
    prefix = "wavepp.sub"
    for rank in range(3):
        await _stage(nc, prefix, rank)
    fanout = _Spy()
    await nc.subscribe(ReplicaSubjects(prefix).stages_kv_batch, cb=fanout.cb)
    await flush_in_order(nc)
    clients = NatsStageClient.for_replica(nc, prefix, 3, timeout_s=2.0)
    replies = await NatsStageClient.call_batch_all(clients[:2], b"x")
    assert [decode_reply(r).rank for r in replies] == [0, 1]
    plain = [NatsStageClient(nc, prefix, rank, timeout_s=2.0) for rank in range(3)]
    replies = await NatsStageClient.call_batch_all(plain, b"x")
    assert [decode_reply(r).rank for r in replies] == [0, 1, 2]
    await flush_in_order(nc)
    await asyncio.sleep(0.05)
    assert fanout.count == 0
    with pytest.raises(ValueError, match=r"rank=3: must be in \[0, num_stages=3\)"):
        NatsStageClient(nc, prefix, 3, num_stages=3)


async def test_a_fanout_round_names_a_dead_stage_before_its_time_out(nc) -> None:  # noqa: ANN001
    """Stage 2 of 3 has no subscription (its process died): the round's fan-out reaches the
    others, the health ask on stage 2's own subject finds no listener, and the round fails naming
    stage 2 long before its time-out."""
    prefix = "wavepp.dead"
    for rank in range(2):
        await _stage(nc, prefix, rank)
    clients = NatsStageClient.for_replica(nc, prefix, 3, timeout_s=30.0, liveness_check_s=0.05)
    # "no stage listens on" its own subject: the health ask's answer, not the 30 s time-out's
    with pytest.raises(StageUnavailableError, match=r"stage 2: no stage listens on wavepp\.dead"):
        await asyncio.wait_for(NatsStageClient.call_batch_all(clients, b"x"), timeout=20)
    assert not clients[0].batch_mux._calls


async def test_a_fanout_round_names_a_silent_stage_at_its_time_out(nc) -> None:  # noqa: ANN001
    """Stage 1 listens (it answers health asks) but never answers the round: the time-out names
    it and the fan-out subject; a reply naming no stage of the replica, or no reply at all, is
    dropped rather than taken for one."""
    prefix = "wavepp.quiet"
    subjects = ReplicaSubjects(prefix)
    await _stage(nc, prefix, 0)

    async def rogue(msg) -> None:  # noqa: ANN001 - answers for a rank the replica lacks, and junk
        await msg.respond(_reply(7))
        await msg.respond(b"junk")

    async def health_only(msg) -> None:  # noqa: ANN001
        await msg.respond(b'{"rank": 1, "ok": true}')

    await nc.subscribe(subjects.stages_kv_batch, cb=rogue)
    await nc.subscribe(subjects.stage_kv(1), cb=health_only)
    await flush_in_order(nc)
    clients = NatsStageClient.for_replica(nc, prefix, 2, timeout_s=1.5, liveness_check_s=0.05)
    with pytest.raises(
        StageUnavailableError, match=r"stage 1: no reply on wavepp\.quiet\.stages\.kvb within 1.5s"
    ):
        await NatsStageClient.call_batch_all(clients, b"x")
    assert not clients[0].batch_mux._calls


async def test_stages_without_the_fanout_subject_are_reached_one_by_one(nc) -> None:  # noqa: ANN001
    """Nobody listens on ``{p}.stages.kvb`` (stages of a version before it): nobody received the
    round, so it is sent again per stage and answered; with no stage at all, the first is named."""
    prefix = "wavepp.old"
    for rank in range(2):
        await _stage(nc, prefix, rank, fanout=False)
    clients = NatsStageClient.for_replica(nc, prefix, 2, timeout_s=2.0)
    replies = await NatsStageClient.call_batch_all(clients, b"x")
    assert [decode_reply(r).rank for r in replies] == [0, 1]
    nobody = NatsStageClient.for_replica(nc, "wavepp.nobody", 2, timeout_s=2.0)
    with pytest.raises(StageUnavailableError, match=r"stage 0: no stage listens on wavepp\.nobody"):
        await NatsStageClient.call_batch_all(nobody, b"x")


async def test_a_fanout_round_through_the_stage_handlers_pins_on_every_stage(nc) -> None:  # noqa: ANN001
    """The real stage side (``serve_stage_kv``: each stage subscribes to the fan-out subject)
    and the real controller: an agreement over a whole replica's clients pins the agreed prefix
    on every stage, and a repeated round (same seq) is refused by every stage as before."""
    prefix = "wavepp.real"
    key = BusKey(b"k" * 32).for_replica("real")
    managers, controller = await served_stages(
        nc, prefix, [64] * 3, block_size=4, model_id="m", timeout_s=2.0, bus_key=key
    )
    clients = controller.stages
    ticket = await controller.agree(PromptRequest("r1", list(range(20))))
    assert ticket is not None
    assert all(m.held_blocks("r1") for m in managers)
    batch = KVBatch(BatchOp.RELEASE, ("r1",), owner="repeater", seq=1)
    payload = encode_batch(batch, key)
    first = await NatsStageClient.call_batch_all(clients, payload)
    again = await NatsStageClient.call_batch_all(clients, payload)
    assert all(not decode_reply(r).error for r in first)
    assert all("seq" in decode_reply(r).error for r in again)


async def test_a_fanout_round_fails_at_a_reconnect_not_at_its_time_out() -> None:
    """A round waiting on a stage when nats-server restarts fails as soon as the connection
    reconnects (its publish or reply may be lost with the server), naming the stage it waited
    for, not after its 20 s time-out (as ``fail_on_reconnect`` does for a single request)."""
    with EmbeddedNatsServer() as server:
        nc = await connect(server.url, name="fanout-reconnect")
        try:
            await _stage(nc, "wavepp.rc", 0)

            async def silent(msg) -> None:  # noqa: ANN001 - alive (health), never answers rounds
                return None

            async def health(msg) -> None:  # noqa: ANN001
                await msg.respond(b'{"rank": 1, "ok": true}')

            subjects = ReplicaSubjects("wavepp.rc")
            await nc.subscribe(subjects.stages_kv_batch, cb=silent)
            await nc.subscribe(subjects.stage_kv(1), cb=health)
            await flush_in_order(nc)
            clients = NatsStageClient.for_replica(nc, "wavepp.rc", 2, timeout_s=20.0)
            call = asyncio.ensure_future(NatsStageClient.call_batch_all(clients, b"x"))
            await asyncio.sleep(0.3)
            assert not call.done()
            await asyncio.to_thread(server.restart)
            with pytest.raises(
                StageUnavailableError,
                match="stage 1: no reply to a batched round: NATS reconnected",
            ):
                await asyncio.wait_for(call, timeout=15)
        finally:
            await nc.close()
