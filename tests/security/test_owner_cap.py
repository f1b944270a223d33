"""The per-owner block cap (``RuntimeConfig.max_blocks_per_owner``, ``engineOptions.
maxBlocksPerOwner``) is in force in a real stage process: ``wavepp stage`` processes started by
``LocalPipeline`` (real nats-server, real signed KV ops) refuse an owner past it, and the
admission refuses at once a prompt no owner may hold. Without it one admission may hold the
whole pool.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from wavepp.api.kv_batch import BatchOp, KVBatch, ReserveEntry, encode_batch
from wavepp.api.kv_reply import EntryResult, EntryStatus, KVBatchReply, decode_reply
from wavepp.api.spec import check_spec
from wavepp.launch.runtime_config import runtime_configs_from_spec
from wavepp.runtime.agreement.stage_handler import handle_kv_batch
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.kv import BlockPool, StageKVManager, hash_prompt_blocks
from wavepp.runtime.model_config import ModelConfig
from wavepp.runtime.planning import CostModel
from wavepp.runtime.request import PromptRequest
from wavepp.runtime.serving.local import LocalPipeline

pytestmark = pytest.mark.timeout(120)

BLOCK = 16
POOL = 32
COST = CostModel(c=1e-4, g=1e-8, b=1e-6, a=0.0, label="derived", source="owner cap test")


def _config(**overrides: object) -> RuntimeConfig:
    return RuntimeConfig(
        model=ModelConfig(num_layers=2),
        engine="emulated",
        cost_model=COST.to_dict(),
        num_stages=1,
        block_size=BLOCK,
        num_kv_blocks=[POOL],
        **overrides,
    )


class _Owner:
    """A signed KV client of stage 0 over NATS under its own owner name (a second admission
    instance, as after a restart, or a misbehaving one)."""

    def __init__(self, pipe: LocalPipeline, name: str) -> None:
        self.pipe = pipe
        self.name = name
        self.key = pipe.bus_key.for_replica(pipe.config.pipeline)
        self.seq = 0

    async def hold(self, request_id: str, num_blocks: int) -> tuple[EntryResult, KVBatchReply]:
        """Probe-reserve ``num_blocks`` fresh blocks (no cached prefix) in a signed round of
        its own; the entry's result and the stage's reply."""
        # seeded by the request id: no two requests share a cached block
        hashes = hash_prompt_blocks([7] * (num_blocks * BLOCK), BLOCK, request_id)
        self.seq += 1
        entry = ReserveEntry(request_id, tuple(hashes), num_blocks)
        batch = KVBatch(BatchOp.PROBE_RESERVE, (entry,), 30.0, owner=self.name, seq=self.seq)
        assert self.pipe.nc is not None
        subject = self.pipe.config.subjects.stage_kv_batch(0)
        message = await self.pipe.nc.request(subject, encode_batch(batch, self.key), timeout=10)
        reply = decode_reply(message.data)
        assert not reply.error, reply.error
        return reply.results[0], reply


async def test_a_stage_process_refuses_an_owner_past_its_cap(tmp_path) -> None:  # noqa: ANN001
    async with LocalPipeline(_config(max_blocks_per_owner=8), COST, log_dir=str(tmp_path)) as pipe:
        first, second = _Owner(pipe, "o1"), _Owner(pipe, "o2")
        refused, reply = await first.hold("a", 10)  # 10 > 8: refused whole, nothing held
        assert not refused.ok and "max_blocks_per_owner=8" in refused.error, refused.error
        assert reply.num_free_blocks == POOL
        assert (await first.hold("b", 6))[0].ok
        refused, reply = await first.hold("c", 3)  # 6 + 3 > 8, though 26 blocks are free
        assert not refused.ok and "owner holds 6 of max_blocks_per_owner=8" in refused.error
        assert reply.num_free_blocks == POOL - 6
        assert (await second.hold("d", 8))[0].ok  # the cap is per owner

        # The admission refuses at once what its cap can never hold, and serves what fits.
        assert pipe.scheduler is not None
        too_long = await pipe.scheduler.submit(PromptRequest("long", list(range(9 * BLOCK))))
        assert not too_long.ok and "max_blocks_per_owner" in too_long.error, too_long.error
        fits = await pipe.scheduler.submit(PromptRequest("fits", list(range(8 * BLOCK))))
        assert fits.ok, fits.error


async def test_by_default_one_admission_may_fill_the_whole_pool(tmp_path) -> None:  # noqa: ANN001
    config = _config()
    assert config.max_blocks_per_owner is None and config.owner_blocks_of(0) == POOL
    async with LocalPipeline(config, COST, log_dir=str(tmp_path)) as pipe:
        assert pipe.scheduler is not None
        whole = await pipe.scheduler.submit(PromptRequest("whole", list(range(POOL * BLOCK))))
        assert whole.ok, whole.error
        assert (await _Owner(pipe, "o1").hold("all", POOL))[0].ok  # every block, one owner


def test_the_spec_option_reaches_the_runtime_config_and_bad_values_are_named() -> None:
    base = {"model": {"name": "tiny-llama"}, "engine": "emulated", "stages": 2}
    raw = base | {"engineOptions": {"kvBlocks": [64, 48], "maxBlocksPerOwner": 40}}
    spec, issues = check_spec(raw, default_image="i", default_nats_url="nats://n:4222")
    assert spec is not None, issues
    [config] = runtime_configs_from_spec(spec, pool="p", namespace="t")
    assert config.max_blocks_per_owner == 40
    assert [config.owner_blocks_of(r) for r in range(2)] == [40, 40]
    config = config.model_copy(update={"max_blocks_per_owner": 50})
    assert [config.owner_blocks_of(r) for r in range(2)] == [50, 48]  # above a pool: the pool
    for bad, words in ((0, "must be in [1, 2147483647]"), ("8", "must be an integer")):
        spec, issues = check_spec(
            base | {"engineOptions": {"maxBlocksPerOwner": bad}},
            default_image="i",
            default_nats_url="nats://n:4222",
        )
        assert spec is None and len(issues) == 1, issues
        text = str(issues[0])
        assert "engineOptions.maxBlocksPerOwner" in text and words in text, text
    with pytest.raises(ValidationError, match="max_blocks_per_owner"):
        _config(max_blocks_per_owner=0)


def test_the_cap_check_does_not_walk_every_held_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a cap, a reservation reads its owner's block count, kept as requests change; it
    walks at most one held request (not every one the stage holds)."""
    manager = StageKVManager(BlockPool(4096, BLOCK), max_blocks_per_owner=4000)
    for i in range(2000):
        manager.probe_pin(f"r{i}", (), 5.0, owner="adm")
        assert manager.reserve(f"r{i}", 1, 5.0, owner="adm") is not None
    walked = []
    original = StageKVManager._held_block_ids
    monkeypatch.setattr(
        StageKVManager,
        "_held_block_ids",
        staticmethod(lambda held: walked.append(1) or original(held)),
    )
    manager.probe_pin("last", (), 5.0, owner="adm")
    assert manager.reserve("last", 1, 5.0, owner="adm") is not None
    assert len(walked) <= 1, f"{len(walked)} held requests walked for one reservation"
    assert manager.num_owner_blocks("adm") == 2001 and manager.num_owner_blocks("other") == 0
    manager.release("last", owner="adm")
    for i in range(1000):
        manager.release(f"r{i}", owner="adm")
    assert manager.num_owner_blocks("adm") == 1000


def test_a_round_refused_by_the_cap_says_so() -> None:
    """A probe-reserve refused by the owner cap while the pool has room names the cap and the
    owner's holding, not the pool."""
    manager = StageKVManager(BlockPool(POOL, BLOCK), max_blocks_per_owner=6)
    entries = tuple(
        ReserveEntry(rid, tuple(hash_prompt_blocks([1] * 4 * BLOCK, BLOCK, rid)), 4)
        for rid in ("a", "b")
    )
    batch = KVBatch(BatchOp.PROBE_RESERVE, entries, 5.0, "adm", 1)
    first, second = decode_reply(handle_kv_batch(manager, 0, encode_batch(batch))).results
    assert first.ok and second.status is EntryStatus.REFUSED
    assert "owner holds 4 of max_blocks_per_owner=6" in second.error, second.error


def test_the_gateway_refuses_a_prompt_longer_than_the_cap_allows() -> None:
    """The gateway's prompt limit is the smaller of the stages' pools and the owner cap, so it
    refuses at once a prompt the admission could never hold."""
    from wavepp.launch.gateway import gateway_model_fields

    assert gateway_model_fields(_config())["max_prompt_tokens"] == POOL * BLOCK
    capped = gateway_model_fields(_config(max_blocks_per_owner=8))
    assert capped["max_prompt_tokens"] == 8 * BLOCK
