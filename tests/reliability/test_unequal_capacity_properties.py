"""Stages of very unequal KV capacity under a reuse-heavy load, driven by hypothesis (in
process: the agreement controller over LocalStageClients, the same handle_kv_request the stage
processes run). Never a length mismatch between stages, never a crash, no leak."""

from __future__ import annotations

import asyncio

from agreement_support import local_stages
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wavepp.runtime.agreement import AgreementRefused
from wavepp.runtime.request import PromptRequest

BLOCK_SIZE = 4

# a workload: (prefix id, number of own tokens) per request, and how many run at once
requests_st = st.lists(st.tuples(st.integers(0, 3), st.integers(1, 14)), min_size=1, max_size=40)


async def _run(capacities: list[int], workload: list[tuple[int, int]], num_at_once: int) -> dict:
    managers, controller = local_stages(
        capacities, block_size=BLOCK_SIZE, model_id="prop", stage_capacities=capacities
    )
    prefixes = [[p * 50 + i for i in range(3 * BLOCK_SIZE)] for p in range(4)]
    live: list[tuple[PromptRequest, int]] = []
    stats = {"admitted": 0, "refused": 0, "never_fits": 0, "differing_hits": 0, "cached": 0}

    def finish(request: PromptRequest, num_agreed: int) -> None:
        """What the stages do when the request's last chunk ran: cache its full blocks."""
        hashes = controller.block_hashes(request)
        for manager in managers:
            manager.mark_computed(request.request_id, request.num_tokens, hashes)

    for i, (prefix, num_own) in enumerate(workload):
        request = PromptRequest(f"r{i}", prefixes[prefix] + [900 + i] * num_own)
        try:
            ticket = await controller.agree(request)
        except AgreementRefused:
            stats["never_fits"] += 1
            continue
        if ticket is None:
            stats["refused"] += 1
            for manager in managers:  # a refusal holds nothing anywhere
                assert request.request_id not in manager._requests
        else:
            stats["admitted"] += 1
            stats["cached"] += ticket.num_cached_tokens
            stats["differing_hits"] += len(set(ticket.stage_hits)) > 1
            assert ticket.num_agreed_blocks <= min(ticket.stage_hits)
            tables = [m.block_table(request.request_id) for m in managers]
            num_blocks = controller.num_total_blocks(request)
            assert [len(t) for t in tables] == [num_blocks] * len(managers), "length mismatch"
            live.append((request, ticket.num_agreed_blocks))
        while len(live) >= num_at_once or (ticket is None and live):
            done, num_agreed = live.pop(0)
            finish(done, num_agreed)
            await controller.release([done.request_id])
        for manager in managers:
            manager.pool.check_invariants()
    for done, num_agreed in live:
        finish(done, num_agreed)
        await controller.release([done.request_id])
    for manager in managers:
        manager.pool.check_invariants()
        assert manager.num_requests == 0
        assert manager.pool.num_pinned_blocks == 0, "a pin leaked"
        assert manager.pool.num_free_blocks == manager.pool.num_blocks, "a reservation leaked"
    return stats


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    capacities=st.lists(st.integers(2, 40), min_size=2, max_size=4),
    workload=requests_st,
    num_at_once=st.integers(1, 4),
)
def test_unequal_capacities_never_mismatch_crash_or_leak(
    capacities: list[int], workload: list[tuple[int, int]], num_at_once: int
) -> None:
    asyncio.run(_run(capacities, workload, num_at_once))


def test_the_property_workload_exercises_differing_hits_and_refusals() -> None:
    """The property above must see the cases it is about: with capacities 60, 12 and 30 and
    three prefixes, local hits differ, prefixes are reused and reservations get refused."""
    workload = [(i % 3, 2 + i % 5) for i in range(30)]
    stats = asyncio.run(_run([60, 12, 30], workload, 3))
    assert stats["differing_hits"] > 0 and stats["refused"] > 0, stats
    assert stats["cached"] > 0 and stats["admitted"] > 0, stats
