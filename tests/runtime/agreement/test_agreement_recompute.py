"""A stage whose own prefix hit exceeds the agreed L* (the one-round-trip agreement reserves
after each stage's own hit): it computes tokens [L* B, h_s B) again for its successors and
writes none of them. Its logits equal a cold run's, and its cached blocks (KV, recurrent
states) are left as they were, for the other requests that share them.

Small random-weight stages on CPU: a Llama (the torch engine) and a Kimi-Linear hybrid (the
checkpoint engine, recurrent states every ``K`` blocks).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch
from hf_reference import last_logits
from stage_support import checkpoint_engines

from wavepp.api.layer_split import split_layers
from wavepp.runtime.agreement import AgreementController, LocalStageClient
from wavepp.runtime.kv import BlockPool, StageKVManager
from wavepp.runtime.model_config import ModelConfig
from wavepp.runtime.request import PromptRequest
from wavepp.runtime.stage.engine import ChunkSpec, make_engine
from wavepp.runtime.stage.engine.base import build_prepared_batch
from wavepp.runtime.stage.engine.layers.kda import KDAAttention

pytestmark = pytest.mark.timeout(120)

BS = 4
NUM_BLOCKS = 32
LLAMA = ModelConfig(
    name="recompute-llama",
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    seed=5,
)


class Pipeline:
    """S engines, S stage KV managers and one agreement controller, all in process."""

    def __init__(self, engines: Sequence, state_interval_blocks: int = 1) -> None:
        self.engines = list(engines)
        for engine in self.engines:
            engine.allocate_kv(NUM_BLOCKS, BS)
        self.managers = [StageKVManager(BlockPool(NUM_BLOCKS, BS)) for _ in self.engines]
        self.controller = AgreementController(
            [LocalStageClient(m, r) for r, m in enumerate(self.managers)],
            block_size=BS,
            model_id="recompute",
            state_interval_blocks=state_interval_blocks,
        )

    async def serve(self, rid: str, tokens: list[int], sizes: Sequence[int]) -> torch.Tensor:
        """Agree, run the chunks (the first at L*), cache the computed blocks, release; the
        last token's logits."""
        ticket = await self.controller.agree(PromptRequest(rid, tokens))
        assert ticket is not None
        self.ticket = ticket
        offset = ticket.num_cached_tokens
        sizes = [*sizes, len(tokens) - offset - sum(sizes)]
        logits: dict[str, torch.Tensor] = {}
        for index, n in enumerate(sizes):
            hidden = None
            for rank, (engine, manager) in enumerate(zip(self.engines, self.managers, strict=True)):
                spec = ChunkSpec(
                    request_id=rid,
                    context_offset=offset,
                    num_tokens=n,
                    block_ids=tuple(manager.block_table(rid)),
                    token_ids=tuple(tokens[offset : offset + n]) if rank == 0 else None,
                    is_last=index == len(sizes) - 1,
                    num_cached_tokens=manager.start_chunk(rid, offset),
                )
                out = engine.execute(engine.prepare([spec]), hidden)
                hidden, logits = out.hidden, out.last_token_logits
                manager.mark_computed(rid, offset + n)
            offset += n
        hashes = self.controller.block_hashes(ticket.request)
        for manager in self.managers:
            manager.pool.check_invariants()
            assert len(manager.pool.cached_block_hashes()) <= NUM_BLOCKS
            for index, block_id in enumerate(manager.block_table(rid)[: len(hashes)]):
                held = manager.pool.block_hash(block_id)
                assert held in (hashes[index], None)  # its own hash, or a duplicate never hashed
        await self.controller.release([rid])
        return logits[rid]

    def evict_tail(self, rank: int, keep: int, hashes: Sequence[bytes]) -> None:
        """Stage ``rank`` loses its cached chain past ``keep`` blocks (LRU, tail first)."""
        pool = self.managers[rank].pool
        filler = pool.allocate(NUM_BLOCKS - keep)
        assert filler is not None
        pool.free(filler)
        assert len(pool.find_longest_cache_hit(hashes)) == keep


def llama_engines(num_stages: int) -> list:
    return [
        make_engine(
            "torch",
            model=LLAMA,
            first_layer=first,
            last_layer=last,
            num_layers_total=LLAMA.num_layers,
        )
        for first, last in split_layers(LLAMA.num_layers, num_stages)
    ]


def slots(block_ids: Sequence[int]) -> torch.Tensor:
    return torch.tensor([b * BS + i for b in block_ids for i in range(BS)])


async def test_a_stage_past_l_star_recomputes_writes_nothing_and_matches_a_cold_run() -> None:
    rng = random.Random(1)
    shared = [rng.randrange(LLAMA.vocab_size) for _ in range(21)]
    warm = Pipeline(llama_engines(2))
    await warm.serve("a", shared, [6])
    hashes = warm.controller.block_hashes(PromptRequest("x", shared))
    warm.evict_tail(1, 2, hashes)  # stage 1 keeps 2 of the 5 cached blocks, stage 0 all 5
    prompt = shared[:20] + [rng.randrange(LLAMA.vocab_size) for _ in range(7)]
    stage0 = warm.engines[0]
    cached0 = warm.managers[0].pool.find_longest_cache_hit(hashes)
    kv_before = stage0.kv_cache.flatten(2, 3)[:, :, slots(cached0)].clone()
    # L* = 2 < stage 0's hit of 5: its first chunk (5 tokens) ends inside its hit
    got = await warm.serve("b", prompt, [5])
    assert warm.ticket.stage_hits == (5, 2) and warm.ticket.num_agreed_blocks == 2
    kv_after = stage0.kv_cache.flatten(2, 3)[:, :, slots(cached0)]
    assert torch.equal(kv_before, kv_after)  # its cached blocks were read, never written
    cold = await Pipeline(llama_engines(2)).serve("b", prompt, [5])
    torch.testing.assert_close(got, cold, rtol=1e-5, atol=1e-5)


def test_the_positions_a_stage_holds_cached_are_not_written() -> None:
    specs = [
        ChunkSpec("a", 8, 6, (3, 4, 5, 6, 7), num_cached_tokens=12),  # rows 0..3 cached
        ChunkSpec("b", 0, 3, (9,), num_cached_tokens=0),
        ChunkSpec("c", 4, 2, (1, 2), num_cached_tokens=8),  # wholly inside its hit
    ]
    prepared = build_prepared_batch(
        specs, block_size=BS, num_blocks=16, device="cpu", needs_token_ids=False, prepared_by=0
    )
    assert prepared.write_rows is not None
    assert prepared.write_rows.tolist() == [4, 5, 6, 7, 8]
    assert prepared.slot_mapping.tolist() == [6 * BS, 6 * BS + 1, 9 * BS, 9 * BS + 1, 9 * BS + 2]
    rows = torch.arange(11)
    assert prepared.written(rows).tolist() == [4, 5, 6, 7, 8]
    plain = build_prepared_batch(
        specs[1:2],
        block_size=BS,
        num_blocks=16,
        device="cpu",
        needs_token_ids=False,
        prepared_by=0,
    )
    assert plain.write_rows is None and plain.written(rows) is rows
    with pytest.raises(ValueError, match="num_cached_tokens"):
        build_prepared_batch(
            [ChunkSpec("a", 0, 1, (0,), num_cached_tokens=3)],
            block_size=BS,
            num_blocks=16,
            device="cpu",
            needs_token_ids=False,
            prepared_by=0,
        )


# --------------------------------------------------------------------------- hybrid

pytest.importorskip("transformers")

K = 2  # a recurrent state after every 2nd block


async def test_a_hybrid_stage_past_l_star_starts_from_the_state_at_l_star(kimi) -> None:  # noqa: ANN001
    """Stage 0 holds 5 blocks (states after blocks 2 and 4), stage 1 holds 2: L* = 2 (a state
    boundary). Stage 0 starts from its state at L*, not at its hit, runs through blocks 2..4
    without dropping or replacing their stored states, and the logits are the reference's."""
    model_dir, model = kimi
    rng = random.Random(2)
    shared = [rng.randrange(256) for _ in range(22)]
    pipeline = Pipeline(
        checkpoint_engines(model_dir, [3, 2], state_interval_blocks=K), state_interval_blocks=K
    )
    await pipeline.serve("a", shared, [5, 11])
    hashes = pipeline.controller.block_hashes(PromptRequest("x", shared))
    pipeline.evict_tail(1, 2, hashes)
    cached0 = pipeline.managers[0].pool.find_longest_cache_hit(hashes)
    kda0 = [
        layer.attn
        for layer in pipeline.engines[0]._layers  # noqa: SLF001
        if isinstance(layer.attn, KDAAttention)
    ]
    assert kda0
    states_before = [{b: layer.states[b] for b in (cached0[1], cached0[3])} for layer in kda0]
    prompt = shared[:21] + [rng.randrange(256) for _ in range(6)]
    got = await pipeline.serve("b", prompt, [5, 2])
    assert pipeline.ticket.stage_hits == (5, 2) and pipeline.ticket.num_agreed_blocks == 2
    for layer, before in zip(kda0, states_before, strict=True):
        for block_id, state in before.items():
            assert layer.states[block_id] is state  # neither dropped nor rewritten
    assert (got - last_logits(model, prompt)).abs().max() < 1e-4
