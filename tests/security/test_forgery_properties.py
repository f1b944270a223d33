"""Property tests: a non-member's messages change nothing that matters.

Over the pure cores (``forgery_support.MiniPipeline``: agreement controller, scheduler core,
stage cores, sharing a replica's bus key), an attacker without the key injects, before every
plan and every batch of done messages, arbitrary forged plans, done messages and KV requests
(any epoch, id, rank, owner, op number, lease; unsigned, with a made-up tag, or signed with
another key), and repeats, duplicates and reorders the genuine messages it captured. Then:

* every answer is the one the run without the attacker gives (never changes an answer);
* every request is answered in the same round as without the attacker (never stalls one);
* no forged or repeated KV request changes a stage's pins, tables or free blocks, and no
  message of the attacker makes a stage drop a request the scheduler still has live (never
  frees a pinned block).
"""

from __future__ import annotations

from forgery_support import MiniPipeline, Tap, forged_done, prompt, snapshot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wavepp.api.kv_batch import BatchOp, KVBatch, ReserveEntry, encode_batch
from wavepp.api.kv_reply import KVBatchReply
from wavepp.api.messages import (
    MicroBatchDone,
    MicroBatchPlan,
    PlannedChunk,
    Renew,
    RequestResult,
)
from wavepp.api.signing import BusKey
from wavepp.runtime.request import PromptRequest

KEY = BusKey(b"p" * 32)
WRONG_KEY = BusKey(b"x" * 32).for_replica("p0")

HASH = "ab" * 32


def _requests(lengths: list[int]) -> list[PromptRequest]:
    return [PromptRequest(f"r{i}", prompt(i, n)) for i, n in enumerate(lengths)]


def _baseline(lengths: list[int]) -> MiniPipeline:
    pipe = MiniPipeline(KEY)
    pipe.run(_requests(lengths))
    return pipe


def _tagged(data: st.DataObject, msg):  # noqa: ANN001, ANN202
    how = data.draw(st.sampled_from(["none", "garbage", "wrong-key"]))  # never the replica's
    if how == "wrong-key":
        return WRONG_KEY.sign(msg)
    if how == "garbage":
        return msg.model_copy(update={"mac": data.draw(st.text("0123456789abcdef", max_size=32))})
    return msg


def _likely(data: st.DataObject, plausible, *others):  # noqa: ANN001, ANN202
    """``plausible`` three times in four (what a forger who reads the bus would send)."""
    return data.draw(st.sampled_from([plausible] * (3 * len(others)) + list(others)))


def _epoch(data: st.DataObject, real: str) -> str:
    return _likely(data, real, "", "0" * 16)


def _forge_plan(data: st.DataObject, tap: Tap) -> None:
    seen = tap.plans_seen[-1]
    chunks = [
        PlannedChunk(
            request_id=c.request_id,
            chunk_index=c.chunk_index,
            context_offset=c.context_offset,
            token_ids=data.draw(st.lists(st.integers(0, 999), max_size=8)),
            is_last=data.draw(st.booleans()),
        )
        for c in seen.chunks
        if _likely(data, True, False)
    ]
    plan = MicroBatchPlan(
        microbatch_id=max(
            0, seen.microbatch_id + _likely(data, 0 if tap.point == "plan" else 1, -1, 2)
        ),
        chunks=chunks,
        epoch=_epoch(data, seen.epoch),
    )
    tap.plan(data.draw(st.integers(0, tap.pipe.num_stages - 1)), _tagged(data, plan))


def _forge_done(data: st.DataObject, tap: Tap) -> None:
    seen = tap.plans_seen[-1]
    done = forged_done(
        _likely(data, tap.pipe.num_stages - 1, 0, -1, tap.pipe.num_stages),
        seen.microbatch_id + _likely(data, 0, -1, 1),
        [
            RequestResult(request_id=c.request_id, first_token_id=999_999)
            for c in seen.chunks
            if _likely(data, True, False)
        ],
        error=_likely(data, "", "forged error"),
        epoch=_epoch(data, seen.epoch),
    )
    tap.done(_tagged(data, done))


def _forge_kv(data: st.DataObject, tap: Tap) -> None:
    pipe = tap.pipe
    ids = sorted({c.request_id for p in tap.plans_seen for c in p.chunks}) or ["r0"]
    rid = data.draw(st.sampled_from(ids))
    owner = data.draw(st.sampled_from([pipe.controller.owner, "", "intruder"]))
    seq = data.draw(st.sampled_from([0, 1, 10**9]))
    lease = data.draw(st.sampled_from([1.0, 30.0, 3600.0]))
    op = data.draw(st.sampled_from(["probe-reserve", "release", "renew"]))
    rank = data.draw(st.integers(0, pipe.num_stages - 1))
    if op == "renew":
        msg = Renew(request_ids=ids, lease_s=lease, owner=owner, seq=seq)
        _kv_unchanged(tap, rank, _tagged(data, msg).model_dump_json().encode())
        return
    if op == "probe-reserve":
        total = data.draw(st.integers(1, 2))
        entry = ReserveEntry(rid, (bytes.fromhex(HASH),), total)
        batch = KVBatch(BatchOp.PROBE_RESERVE, (entry,), lease, owner=owner, seq=seq)
    else:
        batch = KVBatch(BatchOp.RELEASE, tuple(ids), owner=owner, seq=seq)
    _kv_unchanged(tap, rank, _tagged_batch(data, batch))


def _tagged_batch(data: st.DataObject, batch: KVBatch) -> bytes:
    """``batch`` encoded unsigned, with a made-up mac, or signed with another key."""
    how = data.draw(st.sampled_from(["none", "garbage", "wrong-key"]))  # never the replica's
    if how == "wrong-key":
        return encode_batch(batch, WRONG_KEY)
    payload = encode_batch(batch)
    if how == "garbage":
        return payload[:-32] + data.draw(st.binary(min_size=32, max_size=32))
    return payload


def _kv_unchanged(tap: Tap, rank: int, payload: bytes) -> None:
    manager = tap.pipe.stages[rank].manager
    before = snapshot(manager)
    reply = tap.kv(rank, payload)
    refused = bool(reply.error) if isinstance(reply, KVBatchReply) else not reply.ok
    assert refused, reply
    assert snapshot(manager) == before


def _repeat(data: st.DataObject, tap: Tap) -> None:
    what = data.draw(st.sampled_from(["kv", "plan", "done"]))
    if what == "kv" and tap.kv_seen:
        rank, payload = data.draw(st.sampled_from(tap.kv_seen))
        if b'"op":"health"' not in payload:
            _kv_unchanged(tap, rank, payload)
    elif what == "plan":
        plan = data.draw(st.sampled_from(tap.plans_seen))
        if plan is not tap.plans_seen[-1] or tap.point == "done":  # not ahead of the stages
            tap.plan(data.draw(st.integers(0, tap.pipe.num_stages - 1)), plan)
    elif what == "done" and tap.dones_seen:
        tap.done(data.draw(st.sampled_from(tap.dones_seen)))


def _attacker(data: st.DataObject):  # noqa: ANN202
    def attack(tap: Tap) -> None:
        for _ in range(data.draw(st.integers(0, 3))):
            unanswered = {
                (rank, rid)
                for rank, stage in enumerate(tap.pipe.stages)
                for rid in stage.manager.request_ids()
                if rid not in tap.pipe.answers
            }
            action = data.draw(st.sampled_from([_forge_plan, _forge_done, _forge_kv, _repeat]))
            action(data, tap)
            still = {
                (rank, rid)
                for rank, stage in enumerate(tap.pipe.stages)
                for rid in stage.manager.request_ids()
            }
            # A request keeps its pins while the scheduler has it live (the last stage's genuine
            # report of its last micro-batch releases it; a repeated genuine done may be that).
            lost = {(r, rid) for r, rid in unanswered - still if rid in tap.pipe.core.live}
            assert not lost, f"{action.__name__} freed pins of unanswered requests: {lost}"

    return attack


LENGTHS = st.lists(st.integers(1, 40), min_size=1, max_size=4)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=LENGTHS, data=st.data())
def test_a_non_members_messages_never_change_an_answer_a_pin_or_the_timing(
    lengths: list[int], data: st.DataObject
) -> None:
    expected = _baseline(lengths)
    pipe = MiniPipeline(KEY)
    answers = pipe.run(_requests(lengths), _attacker(data))
    assert answers == expected.answers
    assert pipe.answered_round == expected.answered_round
    assert all(not err for _, err in answers.values())
    for stage in pipe.stages:
        stage.manager.pool.check_invariants()
        assert stage.manager.num_requests == 0


@settings(max_examples=40, deadline=None)
@given(lengths=LENGTHS, data=st.data())
def test_duplicated_and_reordered_done_messages_never_change_an_answer(
    lengths: list[int], data: st.DataObject
) -> None:
    """The bus may duplicate and reorder (a replay answer and a late original): same answers,
    same rounds."""
    expected = _baseline(lengths)

    def shuffle(dones: list[MicroBatchDone]) -> list[MicroBatchDone]:
        doubled = dones + data.draw(st.lists(st.sampled_from(dones), max_size=4)) if dones else []
        return data.draw(st.permutations(doubled))

    pipe = MiniPipeline(KEY)
    assert pipe.run(_requests(lengths), shuffle_dones=shuffle) == expected.answers
    assert pipe.answered_round == expected.answered_round


# ---- the gateway: heartbeats -----------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_forged_heartbeats_never_change_the_pool_or_readiness(data: st.DataObject) -> None:
    """Genuine heartbeats every 0.5 s (the replica dies at some point); forged ones (any
    fields, unsigned or another key's, or a genuine one repeated) at any time: the router's
    view (in the pool, ready) at every step equals the one from the genuine beats alone."""
    from wavepp.api.prefill import Heartbeat
    from wavepp.gateway.router import PoolRouter
    from wavepp.gateway.trust import BusGuard

    key = KEY.for_replica("p0")
    death_s = data.draw(st.floats(0.0, 6.0))
    genuine = [
        key.sign(
            Heartbeat(
                pipeline="p0",
                ready=t >= 1.0,
                num_stages_formed=2,
                num_inflight=0,
                instance="i1",
                seq=i + 1,
                sent_at_s=1000.0 + t,
            )
        )
        for i, t in enumerate(x * 0.5 for x in range(12))
        if t < death_s
    ]

    def run(with_forger: bool) -> list[tuple[bool, bool]]:
        guard, router = BusGuard(KEY, ["p0", "p1"]), PoolRouter([("p0", 2), ("p1", 2)])
        views = []
        for step in range(24):  # every 0.25 s
            now = step * 0.25
            if step % 2 == 0 and step // 2 < len(genuine):
                beat = genuine[step // 2]
                if guard.heartbeat("p0", beat, now, 1000.0 + now):
                    router.on_heartbeat("p0", now, is_ready=beat.ready)
            for _ in range(data.draw(st.integers(0, 2)) if with_forger else 0):
                forged = Heartbeat(
                    pipeline=data.draw(st.sampled_from(["p0", "p1"])),
                    ready=data.draw(st.booleans()),
                    num_stages_formed=data.draw(st.integers(0, 2)),
                    num_inflight=0,
                    instance=data.draw(st.sampled_from(["i1", "i2"])),
                    seq=data.draw(st.integers(0, 100)),
                    sent_at_s=1000.0 + now + data.draw(st.sampled_from([0.0, -60.0])),
                )
                how = data.draw(st.sampled_from(["unsigned", "wrong-key", "replay"]))
                if how == "wrong-key":
                    forged = WRONG_KEY.sign(forged)
                elif how == "replay" and genuine[: step // 2 + 1]:  # one sent already
                    forged = data.draw(st.sampled_from(genuine[: step // 2 + 1]))
                subject = data.draw(st.sampled_from(["p0", "p1"]))
                if guard.heartbeat(subject, forged, now, 1000.0 + now):
                    router.on_heartbeat(subject, now, is_ready=forged.ready)
            views.append(
                (
                    router.is_alive("p0", now),
                    router.by_name["p0"].is_ready,
                    router.is_alive("p1", now),
                )
            )
        return views

    assert run(with_forger=True) == run(with_forger=False)
