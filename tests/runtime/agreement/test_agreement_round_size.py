"""A round's message stays under NATS's max_payload (``AgreementRounds.max_round_bytes``): the
server refuses a larger one, which would fail every request in it and the releases riding along
(five 131k-token prompts agreed together make one 1.3 MB message), so one tenant's long prompts
could fail other tenants' requests."""

from __future__ import annotations

import asyncio

from wavepp.api.kv_batch import decode_batch
from wavepp.api.signing import BusKey
from wavepp.runtime.agreement import AgreementController, LocalStageClient
from wavepp.runtime.agreement.nats_client import NatsStageClient, serve_stage_kv
from wavepp.runtime.agreement.rounds import MAX_ROUND_BYTES
from wavepp.runtime.kv import BlockPool, StageKVManager
from wavepp.runtime.request import PromptRequest
from wavepp.runtime.transport.natsio import EmbeddedNatsServer, connect, flush_in_order

BLOCK = 16


class SizeLoggingClient(LocalStageClient):
    """Records each batch's encoded size and entry count."""

    def __init__(self, manager: StageKVManager, rank: int, log: list[tuple[int, int]]) -> None:
        super().__init__(manager, rank)
        self.log = log

    async def call_batch(self, payload: bytes) -> bytes:
        if self.rank == 0:
            self.log.append((len(payload), len(decode_batch(payload).entries)))
        await asyncio.sleep(0)
        return await super().call_batch(payload)


def _prompt(i: int, num_tokens: int) -> PromptRequest:
    return PromptRequest(f"long-{i}", [(7 * i + t) % 50_000 for t in range(num_tokens)])


async def test_a_round_past_its_byte_budget_is_split_and_a_lone_large_entry_still_goes() -> None:
    managers = [StageKVManager(BlockPool(4096, BLOCK)) for _ in range(2)]
    log: list[tuple[int, int]] = []
    controller = AgreementController(
        [SizeLoggingClient(m, r, log) for r, m in enumerate(managers)],
        block_size=BLOCK,
        model_id="m",
    )
    rounds = controller._rounds
    rounds.max_round_bytes = 2 * (18 + 8 + 32 * 40)  # two 640-token prompts (40 hashes each)
    tickets = await asyncio.gather(*(controller.agree(_prompt(i, 640 + 1)) for i in range(5)))
    assert all(tickets)
    assert [n for _, n in log] == [2, 2, 1]
    assert all(size <= rounds.max_round_bytes + 200 for size, _ in log)  # + header and tag
    # one entry past the budget: alone, not refused
    log.clear()
    assert await controller.agree(_prompt(9, 64 * 40 + 1))
    assert [n for _, n in log] == [1]


async def test_five_131k_token_prompts_agreed_together_over_nats_all_get_in() -> None:
    """Over a real nats-server (max_payload 1 MiB): 5 prompts of 131,072 tokens at 16-token
    blocks (8,192 hashes, 262 KB each) and a release riding along."""
    server = EmbeddedNatsServer()
    server.start()
    clients = []
    try:
        key = BusKey.generate().for_replica("p0")
        prefix = "wavepp.default.p0"
        managers = []
        for rank in range(2):
            nc = await connect(server.url, name=f"stage-{rank}", anonymous_ok=True)
            clients.append(nc)
            manager = StageKVManager(BlockPool(60_000, BLOCK), max_lease_s=30.0)
            await serve_stage_kv(nc, prefix, rank, manager, bus_key=key)
            await flush_in_order(nc)
            managers.append(manager)
        adm = await connect(server.url, name="admission", anonymous_ok=True)
        clients.append(adm)
        assert adm.max_payload == 1024 * 1024 and MAX_ROUND_BYTES < adm.max_payload
        controller = AgreementController(
            NatsStageClient.for_replica(adm, prefix, 2, timeout_s=10.0),
            block_size=BLOCK,
            model_id="m",
            bus_key=key,
        )
        small = [_prompt(100 + i, 41) for i in range(3)]
        assert all(await asyncio.gather(*(controller.agree(r) for r in small)))
        big = [_prompt(i, 131_072) for i in range(5)]
        for request in big:
            controller.block_hashes(request)  # hashed before: all five join one round
        *tickets, _ = await asyncio.gather(
            *(controller.agree(r) for r in big),
            controller.release([r.request_id for r in small]),
        )
        assert all(tickets)
        for manager in managers:
            assert sorted(manager.request_ids()) == sorted(r.request_id for r in big)
    finally:
        for nc in clients:
            await nc.close()
        server.stop()
