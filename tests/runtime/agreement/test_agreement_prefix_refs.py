"""Prefix references, the controller's side: a second round with the same prefixes sends each
as 64 bytes and agrees exactly as with references off; a stage that forgot (restarted) answers
UNRESOLVED and the request goes again in full, its caller none the wiser; a failed round
forgets the mirror. In process and over a real nats-server.

The wire format and the stage's side are in ``tests/runtime/agreement/test_kv_batch_refs.py``."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from agreement_support import served_stages
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_wire_support import CountingClient

from wavepp.api.kv_batch import BatchOp, KVWireError
from wavepp.api.kv_reply import EntryResult, EntryStatus, decode_reply, encode_reply
from wavepp.runtime.agreement import AgreementController, AgreementRefused
from wavepp.runtime.agreement.clients import StageUnavailableError
from wavepp.runtime.kv import BlockPool, RecentPrefixes, StageKVManager
from wavepp.runtime.request import PromptRequest

BLOCK = 4
MODEL_ID = "prefix-refs"


def workload(round_index: int, num_roots: int = 4, per_root: int = 3) -> list[PromptRequest]:
    """Prompts of ``num_roots`` 40-token (10-block) prefixes, each with a new 6-token suffix."""
    return [
        PromptRequest(
            f"q{round_index}-{root}-{i}",
            [root * 1000 + t for t in range(40)]
            + [round_index * 100 + i * 10 + t for t in range(6)],
        )
        for root in range(num_roots)
        for i in range(per_root)
    ]


def setup(
    num_stages: int = 3, *, prefix_refs: bool = True
) -> tuple[list[StageKVManager], list[CountingClient], AgreementController]:
    managers = [StageKVManager(BlockPool(512, BLOCK)) for _ in range(num_stages)]
    clients = [CountingClient(m, r) for r, m in enumerate(managers)]
    controller = AgreementController(
        clients, block_size=BLOCK, model_id=MODEL_ID, lease_s=30.0, prefix_refs=prefix_refs
    )
    return managers, clients, controller


async def one_round(controller: AgreementController, requests: list[PromptRequest]) -> list[object]:
    rounds = controller.num_rounds
    tickets = await asyncio.gather(*(controller.agree(r) for r in requests))
    assert controller.num_rounds == rounds + 1
    return tickets


async def test_a_second_round_names_its_prefixes_by_reference_and_agrees_the_same() -> None:
    """Rounds 2 and 3 send each root's prefix as 64 bytes; every ticket, stage hit and block
    table is what the same rounds give with references off."""
    outcomes = {}
    for refs in (True, False):
        managers, clients, controller = setup(prefix_refs=refs)
        tickets, tables = [], []
        for index in range(3):
            requests = workload(index)
            tickets += await one_round(controller, requests)
            tables += [list(m.block_table(r.request_id)) for m in managers for r in requests]
            # computed and released: the next round's prefixes are cached on every stage
            for manager in managers:
                for request in requests:
                    manager.mark_computed(
                        request.request_id, request.num_tokens, controller.block_hashes(request)
                    )
            await controller.release([r.request_id for r in requests])
        assert all(t is not None for t in tickets)
        tables.append([m.pool.block_hash(b) for m in managers for b in range(m.pool.num_blocks)])
        outcomes[refs] = (
            [(t.request.request_id, t.num_agreed_blocks, t.stage_hits) for t in tickets],
            tables,
            clients[0].payloads,
        )
        assert controller.num_unresolved == 0
    with_refs, without = outcomes[True], outcomes[False]
    assert with_refs[:2] == without[:2]
    assert [v for _, v in with_refs[2]] == [False, True, True]
    assert [v for _, v in without[2]] == [False, False, False]
    assert with_refs[2][0][0] == without[2][0][0]  # round 1: nothing remembered yet
    # 4 roots: each first entry sends 2 hashes, not 10
    assert without[2][1][0] - with_refs[2][1][0] == 4 * (10 - 2) * 32
    assert [t[1] for t in with_refs[0][12:]] == [10] * 24  # L*: the cached prefix


async def test_a_stage_that_forgot_answers_unresolved_and_the_request_goes_again_in_full() -> None:
    managers, clients, controller = setup(num_stages=4)
    first = workload(0)
    assert all(t is not None for t in await one_round(controller, first))
    managers[2].recent_prefixes = RecentPrefixes()  # stage 2 restarted: it remembers nothing
    second = workload(1)
    tickets = await asyncio.gather(*(controller.agree(r) for r in second))
    assert all(t is not None for t in tickets)  # the callers saw no refusal, no error
    # each root's first entry of round 2 referred to it, the others shared in-batch from those
    assert controller.num_unresolved == 12
    assert controller.num_rounds == 3  # they went again, in full, in a round of their own
    assert [v for _, v in clients[0].payloads] == [False, True, False]
    held = sorted(r.request_id for r in first + second)
    for manager in managers:  # nothing leaked: every stage holds exactly the admitted ones
        assert sorted(manager.request_ids()) == held
        manager.pool.check_invariants()
    await controller.release(held)
    for manager in managers:
        assert manager.num_requests == 0 and manager.pool.num_pinned_blocks == 0
    # stage 2 remembers again: a fourth round resolves everywhere
    assert all(t is not None for t in await one_round(controller, workload(2)))
    assert controller.num_unresolved == 12 and clients[0].payloads[-1][1]


class FlakyStage(CountingClient):
    """A stage that misses its ``fail_at``-th probe-reserve round (no reply)."""

    def __init__(self, manager: StageKVManager, rank: int, fail_at: int) -> None:
        super().__init__(manager, rank)
        self.fail_at = fail_at

    async def call_batch(self, payload: bytes) -> bytes:
        reply = await super().call_batch(payload)
        if payload[4] == BatchOp.PROBE_RESERVE and len(self.payloads) == self.fail_at:
            raise StageUnavailableError(self.rank, "no reply within 1s")
        return reply


async def test_a_failed_round_forgets_what_the_stages_remember() -> None:
    """After a round that failed, nothing is known of what the stages applied: the next round
    sends every hash (and the one after refers again)."""
    managers = [StageKVManager(BlockPool(512, BLOCK)) for _ in range(2)]
    clients = [CountingClient(managers[0], 0), FlakyStage(managers[1], 1, fail_at=2)]
    controller = AgreementController(clients, block_size=BLOCK, model_id=MODEL_ID)
    assert all(t is not None for t in await one_round(controller, workload(0)))
    results = await asyncio.gather(
        *(controller.agree(r) for r in workload(1)), return_exceptions=True
    )
    assert all(isinstance(r, StageUnavailableError) for r in results)
    assert all(t is not None for t in await one_round(controller, workload(2)))
    assert all(t is not None for t in await one_round(controller, workload(3)))
    assert [v for _, v in clients[0].payloads] == [False, True, False, True]
    assert controller.num_unresolved == 0


async def test_references_off_send_every_hash() -> None:
    _, clients, controller = setup(prefix_refs=False)
    for index in range(3):
        assert all(t is not None for t in await one_round(controller, workload(index)))
    assert [v for _, v in clients[0].payloads] == [False, False, False]


async def test_references_over_a_real_nats_server(nc) -> None:  # noqa: ANN001
    """Over NATS (one fan-out per round): round 2 is smaller; a stage that restarted answers
    UNRESOLVED and the controller resends transparently; nothing leaks."""
    managers, controller = await served_stages(
        nc, "wavepp.pr", [512] * 4, block_size=BLOCK, model_id=MODEL_ID, timeout_s=5.0,
        fanout=False,
    )  # fmt: skip
    sizes = []
    admitted = []
    for index in range(3):
        if index == 2:
            managers[1].recent_prefixes = RecentPrefixes()
        before = controller._rounds.num_probe_reserve_bytes
        requests = workload(index)
        tickets = await asyncio.gather(*(controller.agree(r) for r in requests))
        assert all(t is not None for t in tickets)
        sizes.append(controller._rounds.num_probe_reserve_bytes - before)
        admitted += [r.request_id for r in requests]
    assert sizes[1] == sizes[0] - 4 * (10 - 2) * 32
    assert controller.num_unresolved == 12  # round 3, every entry: sent again in full
    assert all(sorted(m.request_ids()) == sorted(admitted) for m in managers)
    await controller.release(admitted)
    assert all(m.num_requests == 0 and m.pool.num_pinned_blocks == 0 for m in managers)


class CancellingStage(CountingClient):
    """Cancels ``victim`` (a caller's task) when a release batch reaches this stage."""

    victim: asyncio.Task | None = None

    async def call_batch(self, payload: bytes) -> bytes:
        if payload[4] == BatchOp.RELEASE and self.victim is not None:
            self.victim.cancel()
        return await super().call_batch(payload)


async def test_a_caller_gone_while_its_entry_was_unresolved_is_not_resent() -> None:
    """The unresolved request of a cancelled caller is released and not sent again; its root
    goes in full next time (the stages do not remember it), not by a reference that fails."""
    managers = [StageKVManager(BlockPool(512, BLOCK)) for _ in range(2)]
    clients = [CountingClient(managers[0], 0), CancellingStage(managers[1], 1)]
    controller = AgreementController(clients, block_size=BLOCK, model_id=MODEL_ID)
    assert await one_round(controller, workload(0, num_roots=1, per_root=1)) != [None]
    managers[1].recent_prefixes = RecentPrefixes()
    gone = asyncio.ensure_future(controller.agree(workload(1, num_roots=1, per_root=1)[0]))
    clients[1].victim = gone
    with pytest.raises(asyncio.CancelledError):
        await gone
    clients[1].victim = None
    assert controller.num_unresolved == 1 and controller.num_rounds == 2
    assert [m.request_ids() for m in managers] == [["q0-0-0"]] * 2
    assert all(t is not None for t in await one_round(controller, workload(2, 1, 1)))
    assert controller.num_unresolved == 1
    assert [v for _, v in clients[0].payloads] == [False, True, False]


async def test_a_round_that_cannot_be_encoded_fails_its_callers_and_forgets_the_mirror() -> None:
    """A request id past the wire's 256 bytes: its round's callers hear the error (none waits
    for ever), nothing is held, and the next round sends every hash."""
    managers, clients, controller = setup(num_stages=2)
    assert all(t is not None for t in await one_round(controller, workload(0)))
    bad = PromptRequest("x" * 300, list(range(46)))
    results = await asyncio.wait_for(
        asyncio.gather(
            controller.agree(bad),
            *(controller.agree(r) for r in workload(1)),
            return_exceptions=True,
        ),
        timeout=10,
    )
    assert all(isinstance(r, KVWireError) and "request_id" in str(r) for r in results)
    assert all(
        sorted(m.request_ids()) == sorted(r.request_id for r in workload(0)) for m in managers
    )
    assert all(t is not None for t in await one_round(controller, workload(2)))
    assert [v for _, v in clients[0].payloads] == [False, False]


class YieldingStage(CountingClient):
    """Answers after ``delay`` passes of the event loop (rounds overlap); forgets what it
    remembers when a probe-reserve round numbered in ``forget_at`` reaches it."""

    def __init__(self, manager: StageKVManager, rank: int, delay: int, forget_at: set[int]):
        super().__init__(manager, rank)
        self.delay = delay
        self.forget_at = forget_at

    async def call_batch(self, payload: bytes) -> bytes:
        if payload[4] == BatchOp.PROBE_RESERVE and len(self.payloads) in self.forget_at:
            self.manager.recent_prefixes = RecentPrefixes()
        for _ in range(self.delay):
            await asyncio.sleep(0)
        return await super().call_batch(payload)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rounds_in_flight=st.integers(1, 3),
    max_batch=st.integers(1, 5),
    delays=st.lists(st.integers(0, 3), min_size=2, max_size=3),
    forget_at=st.sets(st.integers(0, 12), max_size=3),
    waves=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=6), min_size=1, max_size=4),
)
def test_overlapping_rounds_with_stages_forgetting_admit_all_and_leak_nothing(
    rounds_in_flight: int,
    max_batch: int,
    delays: list[int],
    forget_at: set[int],
    waves: list[list[int]],
) -> None:
    """Whatever the last stage forgets and however rounds overlap: every caller gets a ticket
    (L* the least stage hit), every stage holds exactly the admitted requests, and nothing is
    left after their release."""

    async def scenario() -> None:
        managers = [StageKVManager(BlockPool(1024, BLOCK)) for _ in delays]
        clients = [
            YieldingStage(m, r, d, forget_at if r == len(delays) - 1 else set())
            for r, (m, d) in enumerate(zip(managers, delays, strict=True))
        ]
        controller = AgreementController(
            clients,
            block_size=BLOCK,
            model_id=MODEL_ID,
            max_batch=max_batch,
            max_rounds_in_flight=rounds_in_flight,
        )
        for index, wave in enumerate(waves):
            requests = [
                PromptRequest(
                    f"w{index}-{i}",
                    [root * 1000 + t for t in range(40)]
                    + [index * 100 + i * 7 + t for t in range(5)],
                )
                for i, root in enumerate(wave)
            ]
            tickets = await asyncio.gather(*(controller.agree(r) for r in requests))
            assert all(t is not None for t in tickets)
            for request, ticket in zip(requests, tickets, strict=True):
                assert ticket.num_agreed_blocks == min(ticket.stage_hits)
                for manager in managers:
                    manager.mark_computed(
                        request.request_id, request.num_tokens, controller.block_hashes(request)
                    )
            ids = sorted(r.request_id for r in requests)
            assert all(sorted(m.request_ids()) == ids for m in managers)
            await controller.release(ids)
            for manager in managers:
                assert manager.num_requests == 0 and manager.pool.num_pinned_blocks == 0
                manager.pool.check_invariants()

    asyncio.run(scenario())


class AlwaysUnresolved(CountingClient):
    """A faulty stage (or a forger answering for it without a bus key): every entry of every
    probe-reserve round UNRESOLVED, references or not."""

    async def call_batch(self, payload: bytes) -> bytes:
        reply = decode_reply(await super().call_batch(payload))
        if payload[4] != BatchOp.PROBE_RESERVE:
            return encode_reply(reply)
        for request_id in self.manager.request_ids():  # it holds nothing it calls unresolved
            self.manager.release(request_id)
        results = tuple(EntryResult(EntryStatus.UNRESOLVED) for _ in reply.results)
        return encode_reply(dataclasses.replace(reply, results=results))


async def test_a_stage_calling_a_full_entry_unresolved_fails_it_once_not_forever() -> None:
    """An UNRESOLVED answer to an entry that carried no reference cannot come from a correct
    stage: the request is resent in full once, then fails (no endless resend loop)."""
    managers = [StageKVManager(BlockPool(512, BLOCK)) for _ in range(3)]
    clients: list[CountingClient] = [CountingClient(m, r) for r, m in enumerate(managers[:2])]
    clients.append(AlwaysUnresolved(managers[2], 2))
    controller = AgreementController(clients, block_size=BLOCK, model_id=MODEL_ID, lease_s=30.0)
    first = workload(0, num_roots=1, per_root=1)[0]
    with pytest.raises(AgreementRefused, match="UNRESOLVED to an entry sent in full"):
        await asyncio.wait_for(controller.agree(first), 10)
    assert controller.num_rounds <= 3  # sent, resent in full once: not again and again
    for manager in managers:  # nothing held anywhere
        assert manager.num_requests == 0 and manager.pool.num_pinned_blocks == 0
