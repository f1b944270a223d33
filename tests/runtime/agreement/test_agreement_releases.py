"""Releases ride along with the next agreement round (``KVBatch.releases``): one
message per stage per round for the finished requests and the new ones, the releases applied
first; alone, they go out at once in a release batch."""

from __future__ import annotations

import asyncio

import pytest
from agreement_support import local_stages
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from kv_wire_support import chain

from wavepp.api.kv_batch import (
    BatchOp,
    KVBatch,
    KVWireError,
    ReserveEntry,
    decode_batch,
    encode_batch,
)
from wavepp.api.kv_reply import EntryStatus, decode_reply
from wavepp.runtime.agreement import AgreementController, AgreementRefused, LocalStageClient
from wavepp.runtime.agreement.stage_handler import handle_kv_batch
from wavepp.runtime.kv import BlockPool, StageKVManager
from wavepp.runtime.request import PromptRequest

BLOCK = 4
MODEL_ID = "tiny-llama:seed=0"


def _reserve(rid: str, n: int, root: int = 0) -> ReserveEntry:
    return ReserveEntry(rid, chain(n, root), n + 1)


# --------------------------------------------------------------------------- wire format


def test_a_probe_reserve_batch_carries_its_releases() -> None:
    with_releases = KVBatch(
        BatchOp.PROBE_RESERVE, (_reserve("n1", 2),), 5.0, "adm", 3, releases=("o1", "o2")
    )
    payload = encode_batch(with_releases)
    decoded = decode_batch(payload)
    assert decoded == with_releases and decoded.releases == ("o1", "o2")
    plain = KVBatch(BatchOp.PROBE_RESERVE, (_reserve("n1", 2),), 5.0, "adm", 4)
    assert decode_batch(encode_batch(plain)).releases == ()
    # releases only: a round with no new request is still a probe-reserve batch of 0 entries
    only = KVBatch(BatchOp.PROBE_RESERVE, (), 5.0, "adm", 5, releases=("o3",))
    assert decode_batch(encode_batch(only)) == only


def test_releases_outside_a_probe_reserve_batch_are_refused() -> None:
    with pytest.raises(KVWireError, match="releases: only in a probe-reserve batch"):
        encode_batch(KVBatch(BatchOp.RELEASE, ("a",), releases=("b",)))
    # a release batch carries no release section: bytes past its ids are refused
    payload = encode_batch(KVBatch(BatchOp.RELEASE, ("a",)))
    with_section = payload[:-32] + b"\x00\x00\x00\x00" + payload[-32:]
    with pytest.raises(KVWireError, match="after the last entry"):
        decode_batch(with_section)


@pytest.mark.parametrize(
    ("cut", "field"),
    [(4, "num_releases"), (2, "request_id"), (1, "request_id")],
)
def test_a_truncated_release_section_names_the_field(cut: int, field: str) -> None:
    batch = KVBatch(BatchOp.PROBE_RESERVE, (_reserve("n", 1),), 5.0, releases=("ab",))
    body = encode_batch(batch)[:-32]  # unsigned: the mac is 32 zero bytes
    # the release section is u32 count | u16 length | b"ab": cut into it from the end
    tail = {4: 4 + 2 + 2, 2: 2 + 2, 1: 1}[cut]
    with pytest.raises(KVWireError, match=field):
        decode_batch(body[:-tail] + bytes(32))


# --------------------------------------------------------------------------- the stage side


def test_the_stage_releases_first_so_the_round_can_use_the_freed_blocks() -> None:
    """A pool of 4 blocks, all held by ``old``: a round that releases ``old`` and reserves 4
    blocks for ``new`` fits; the same round without the release is refused."""
    manager = StageKVManager(BlockPool(4, BLOCK))
    first = KVBatch(BatchOp.PROBE_RESERVE, (_reserve("old", 3, root=1),), 5.0, "adm", 1)
    assert decode_reply(handle_kv_batch(manager, 0, encode_batch(first))).results[0].ok
    assert manager.pool.num_free_blocks == 0
    without = KVBatch(BatchOp.PROBE_RESERVE, (_reserve("new", 3, root=2),), 5.0, "adm", 2)
    [result] = decode_reply(handle_kv_batch(manager, 0, encode_batch(without))).results
    assert result.status is EntryStatus.REFUSED and manager.request_ids() == ["old"]
    with_release = KVBatch(
        BatchOp.PROBE_RESERVE, (_reserve("new", 3, root=2),), 5.0, "adm", 3, releases=("old",)
    )
    [result] = decode_reply(handle_kv_batch(manager, 0, encode_batch(with_release))).results
    assert result.ok and manager.request_ids() == ["new"]


def test_a_batch_releases_only_its_owners_requests_and_even_while_out_of_service() -> None:
    manager = StageKVManager(BlockPool(16, BLOCK))
    for owner, rid in (("adm", "mine"), ("other", "theirs")):
        batch = KVBatch(BatchOp.PROBE_RESERVE, (_reserve(rid, 1, root=len(rid)),), 5.0, owner, 1)
        handle_kv_batch(manager, 0, encode_batch(batch))
    batch = KVBatch(
        BatchOp.PROBE_RESERVE,
        (_reserve("next", 1, root=9),),
        5.0,
        "adm",
        2,
        releases=("mine", "theirs"),
    )
    reply = decode_reply(handle_kv_batch(manager, 0, encode_batch(batch), refuse="re-forming"))
    assert reply.results[0].status is EntryStatus.INVALID  # out of service: no reservation
    assert manager.request_ids() == ["theirs"]  # the release applied; another owner's kept


# --------------------------------------------------------------------------- rounds


class LoggingClient(LocalStageClient):
    """An in-process client that records each batch it carried: (rank, op, entries,
    releases)."""

    def __init__(self, manager: StageKVManager, rank: int, log: list[tuple]) -> None:
        super().__init__(manager, rank)
        self.log = log
        self.fail = False

    async def call_batch(self, payload: bytes) -> bytes:
        batch = decode_batch(payload)
        self.log.append((self.rank, batch.op.name, len(batch.entries), batch.releases))
        await asyncio.sleep(0.001)
        if self.fail:
            raise ConnectionError(f"stage {self.rank} is gone")
        return await super().call_batch(payload)


def _controller(num_stages: int = 3) -> tuple[list[StageKVManager], AgreementController, list]:
    managers = [StageKVManager(BlockPool(64, BLOCK)) for _ in range(num_stages)]
    log: list[tuple] = []
    clients = [LoggingClient(m, r, log) for r, m in enumerate(managers)]
    return managers, AgreementController(clients, block_size=BLOCK, model_id=MODEL_ID), log


def _request(i: int) -> PromptRequest:
    return PromptRequest(f"r{i}", list(range(100 * i, 100 * i + 9)))


async def test_a_release_and_new_agreements_share_one_message_per_stage() -> None:
    managers, controller, log = _controller()
    first = [_request(i) for i in range(4)]
    assert all(await asyncio.gather(*(controller.agree(r) for r in first)))
    log.clear()
    # the next requests wait for a round when the finished requests' release comes
    second = [_request(i) for i in range(4, 8)]
    *tickets, _ = await asyncio.gather(
        *(controller.agree(r) for r in second),
        controller.release([r.request_id for r in first]),
    )
    assert all(tickets)
    released = tuple(r.request_id for r in first)
    assert sorted(log) == [(rank, "PROBE_RESERVE", 4, released) for rank in range(3)]
    for manager in managers:
        assert sorted(manager.request_ids()) == sorted(r.request_id for r in second)


async def test_a_release_with_no_agreement_waiting_goes_out_at_once() -> None:
    """Nothing waits for a round: the release is its own batch, sent before ``release``
    returns control (never later than a release before ride-along was)."""
    managers, controller, log = _controller()
    requests = [_request(i) for i in range(3)]
    assert all(await asyncio.gather(*(controller.agree(r) for r in requests)))
    log.clear()
    await controller.release([r.request_id for r in requests])
    assert sorted(log) == [(rank, "RELEASE", 3, ()) for rank in range(3)]
    for manager in managers:
        assert manager.num_requests == 0 and manager.pool.num_pinned_blocks == 0


async def test_a_release_whose_round_fails_raises_and_the_round_fails_too() -> None:
    managers, controller, log = _controller()
    requests = [_request(i) for i in range(2)]
    assert all(await asyncio.gather(*(controller.agree(r) for r in requests)))
    controller.stages[1].fail = True  # type: ignore[attr-defined]
    results = await asyncio.gather(
        controller.agree(_request(5)),
        controller.release([requests[0].request_id]),
        return_exceptions=True,
    )
    assert all(isinstance(r, ConnectionError) for r in results), results
    # the lease will free what the release could not; the other stages applied it
    assert "r0" not in managers[0].request_ids() and "r0" in managers[1].request_ids()


async def test_an_id_agreed_again_waits_for_its_release_left_to_a_later_round() -> None:
    """Releases past ``max_batch`` wait for a later round; an id among them agreed again must
    wait with them: in the earlier round a stage would answer its probe-reserve from the old
    table and hit (idempotent by id: an L* the new prompt never had), and the late release
    would then free the new ticket's blocks."""
    managers = [StageKVManager(BlockPool(64, BLOCK)) for _ in range(2)]
    clients = [LoggingClient(m, r, []) for r, m in enumerate(managers)]
    controller = AgreementController(clients, block_size=BLOCK, model_id=MODEL_ID, max_batch=4)
    seed = PromptRequest("seed", list(range(1000, 1012)))  # 3 blocks, cached on both stages
    assert await controller.agree(seed)
    for manager in managers:
        manager.start_chunk("seed", 0)
        manager.mark_computed("seed", 12, controller.block_hashes(seed))
    await controller.release(["seed"])
    old = [_request(i) for i in range(5)] + [PromptRequest("r5", [*range(1000, 1012), 7])]
    assert (await asyncio.gather(*(controller.agree(r) for r in old)))[-1].stage_hits == (3, 3)
    # in one pass of the loop: a request waits for a round, the six are released (two groups
    # of max_batch), and r5 is agreed again with a prompt nothing cached shares
    again = PromptRequest("r5", [*range(5000, 5012), 8])
    *_, ticket = await asyncio.gather(
        controller.agree(_request(9)),
        controller.release([r.request_id for r in old]),
        controller.agree(again),
    )
    assert ticket.stage_hits == (0, 0) and ticket.num_agreed_blocks == 0
    for manager in managers:
        assert sorted(manager.request_ids()) == ["r5", "r9"]
        assert manager.block_hashes("r5") == tuple(controller.block_hashes(again))


_steps = st.lists(  # each step: actions started in one pass of the event loop
    st.lists(
        st.one_of(
            st.tuples(st.just("agree"), st.integers(0, 5), st.integers(0, 2)),
            st.tuples(st.just("release"), st.sets(st.integers(0, 5), max_size=6)),
        ),
        min_size=1,
        max_size=6,
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=_steps, max_batch=st.integers(1, 3))
@example(  # r2's release, sent alone after r0's, overtaken by r2 agreed again
    steps=[
        [("agree", 0, 0), ("agree", 1, 0), ("agree", 2, 0)],
        [("release", {0, 1, 2}), ("agree", 2, 0)],
    ],
    max_batch=1,
)
@example(  # r2's release waits for a later round; r2 agreed again must wait too
    steps=[
        [("agree", 0, 0), ("agree", 1, 0), ("agree", 2, 0)],
        [("agree", 3, 2), ("release", {0, 1, 2}), ("agree", 2, 2)],
    ],
    max_batch=2,
)
def test_mixed_agreements_and_releases_keep_the_stages_in_step(
    steps: list[list[tuple]], max_batch: int
) -> None:
    """Agreements and releases of a few ids, reused, started together (releases riding rounds,
    queued past ``max_batch``): after each step every stage holds exactly the ids the controller
    holds live, each with the prompt its ticket agreed (never an earlier prompt's table), and
    nothing is left held at the end."""

    async def scenario() -> None:
        managers, controller = local_stages(
            [96, 96], block_size=BLOCK, model_id=MODEL_ID, max_batch=max_batch
        )
        prompts: dict[str, PromptRequest] = {}
        for step in steps:
            live = controller.live_request_ids
            calls, agreed = [], []
            for action in step:
                if action[0] == "agree":
                    rid = f"r{action[1]}"
                    # variants share a cached prefix (0, 1) or not (2)
                    tokens = [action[2] // 2 * 500 + t for t in range(8)] + [action[2], rid[1:]]
                    request = PromptRequest(rid, [int(t) for t in tokens])
                    calls.append(controller.agree(request))
                    agreed.append(request)
                else:
                    ids = sorted(f"r{i}" for i in action[1] if f"r{i}" in live)
                    live = live - set(ids)
                    calls.append(controller.release(ids))
                    agreed.append(None)
            results = await asyncio.gather(*calls, return_exceptions=True)
            for request, result in zip(agreed, results, strict=True):
                if isinstance(result, AgreementRefused):
                    continue  # the id was agreeing or live already: refused, nothing changed
                assert not isinstance(result, BaseException), result
                if request is not None and result is not None:
                    prompts[request.request_id] = request
                    for manager in managers:  # computed: later prompts hit it
                        manager.start_chunk(request.request_id, result.num_cached_tokens)
                        manager.mark_computed(request.request_id, 8)
            for manager in managers:
                assert sorted(manager.request_ids()) == sorted(controller.live_request_ids)
                for rid in controller.live_request_ids:
                    assert manager.block_hashes(rid) == tuple(controller.block_hashes(prompts[rid]))
        await controller.release(sorted(controller.live_request_ids))
        for manager in managers:
            assert manager.num_requests == 0 and manager.pool.num_pinned_blocks == 0
            manager.pool.check_invariants()

    asyncio.run(scenario())
