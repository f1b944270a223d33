"""``max_rounds_in_flight`` (``AgreementController`` and ``AgreementRounds``): below it an
arrival starts a round of its own at once; at it, arrivals wait for a round to finish and share
the next one (on a few shared cores fewer, larger rounds cost less CPU per agreement:
``wavepp bench agreement --rounds-in-flight``)."""

from __future__ import annotations

import asyncio

import pytest

from wavepp.api.kv_batch import BatchOp, decode_batch
from wavepp.runtime.agreement import AgreementController, LocalStageClient
from wavepp.runtime.kv import BlockPool, StageKVManager
from wavepp.runtime.request import PromptRequest

BLOCK = 16


class GatedClient(LocalStageClient):
    """Holds each probe-reserve batch until ``gate`` is set; logs its entry count."""

    def __init__(self, manager: StageKVManager, rank: int, gate: asyncio.Event) -> None:
        super().__init__(manager, rank)
        self.gate = gate
        self.entries: list[int] = []

    async def call_batch(self, payload: bytes) -> bytes:
        batch = decode_batch(payload)
        if batch.op is BatchOp.PROBE_RESERVE:
            self.entries.append(len(batch.entries))
            await self.gate.wait()
        return await super().call_batch(payload)


async def _rounds_of_three_staggered(max_rounds_in_flight: int | None) -> list[int]:
    """Three agreements, each submitted a loop pass after the one before, while the first
    round is held: the entry counts of the rounds sent."""
    gate = asyncio.Event()
    clients = [GatedClient(StageKVManager(BlockPool(256, BLOCK)), rank, gate) for rank in range(2)]
    limit = {} if max_rounds_in_flight is None else {"max_rounds_in_flight": max_rounds_in_flight}
    controller = AgreementController(clients, block_size=BLOCK, model_id="m", **limit)
    calls = []
    for i in range(3):
        prompt = PromptRequest(f"r{i}", [(i * 97 + t) % 1000 for t in range(3 * BLOCK + 1)])
        calls.append(asyncio.create_task(controller.agree(prompt)))
        for _ in range(3):  # the runner's pass, the round's start
            await asyncio.sleep(0)
    gate.set()
    assert all(await asyncio.gather(*calls))
    assert clients[0].entries == clients[1].entries
    return clients[0].entries


async def test_below_the_limit_each_arrival_starts_its_own_round() -> None:
    assert await _rounds_of_three_staggered(4) == [1, 1, 1]


async def test_at_the_limit_arrivals_wait_and_share_the_next_round() -> None:
    assert await _rounds_of_three_staggered(1) == [1, 2]


async def test_by_default_one_round_is_in_flight() -> None:
    """Overlapping rounds split the same arrivals into more, smaller rounds, each costing every
    stage a message (measured in ``wavepp bench agreement --rate``: worse at every rate)."""
    assert await _rounds_of_three_staggered(None) == [1, 2]


def test_a_limit_below_one_is_refused_naming_it() -> None:
    client = LocalStageClient(StageKVManager(BlockPool(8, BLOCK)), 0)
    with pytest.raises(ValueError, match="max_rounds_in_flight"):
        AgreementController([client], block_size=BLOCK, model_id="m", max_rounds_in_flight=0)
