"""Hybrid (Kimi-Linear) prefix reuse: recurrent states at block boundaries, L* on them,
states evicted with their blocks; and the agreement's L* rounded to the state interval."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from agreement_support import local_stages
from hf_reference import last_logits
from stage_support import checkpoint_engines

from wavepp.runtime.agreement import AgreementController
from wavepp.runtime.request import PromptRequest
from wavepp.runtime.stage.engine import ChunkSpec
from wavepp.runtime.stage.engine.layers.kda import KDAAttention

pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(120)

VOCAB = 256
BS = 4  # tokens per block
K = 2  # state after every 2nd block


class Stages:
    def __init__(self, model_dir: Path, partition: list[int]) -> None:
        self.engines = checkpoint_engines(model_dir, partition, state_interval_blocks=K)
        for engine in self.engines:
            engine.allocate_kv(32, BS)

    def run(self, rid: str, tokens: list[int], table: list[int], start: int, sizes: list[int]):
        offset, logits = start, {}
        for i, n in enumerate(sizes):
            hidden = None
            for rank, engine in enumerate(self.engines):
                spec = ChunkSpec(
                    request_id=rid,
                    context_offset=offset,
                    num_tokens=n,
                    block_ids=tuple(table),
                    token_ids=tuple(tokens[offset : offset + n]) if rank == 0 else None,
                    is_last=i == len(sizes) - 1,
                )
                out = engine.execute(engine.prepare([spec]), hidden)
                hidden, logits = out.hidden, out.last_token_logits
            offset += n
        return logits[rid]

    def kda_layers(self) -> list[KDAAttention]:
        return [
            layer.attn
            for engine in self.engines
            for layer in engine._layers
            if isinstance(layer.attn, KDAAttention)
        ]


def test_state_boundary_reuse_matches_reference_and_off_boundary_is_refused(kimi) -> None:
    model_dir, model = kimi
    stages = Stages(model_dir, [3, 2])
    rng = random.Random(0)
    first = [rng.randrange(VOCAB) for _ in range(22)]
    table_a = list(range(6))
    got = stages.run("a", first, table_a, 0, [5, 11, 6])
    assert (got - last_logits(model, first)).abs().max() < 1e-4
    # 5 full blocks ran: states after blocks 2 and 4 (ids 1 and 3) in every KDA layer, and
    # no running state once the request's last chunk ran.
    for layer in stages.kda_layers():
        assert sorted(layer.states) == [1, 3] and not layer.running
    # A second prompt sharing 13 tokens reuses 2 blocks (8 tokens): the last state boundary.
    second = first[:13] + [rng.randrange(VOCAB) for _ in range(6)]
    table_b = table_a[:2] + [10, 11, 12]
    got = stages.run("b", second, table_b, 8, [3, 8])
    assert (got - last_logits(model, second)).abs().max() < 1e-4
    # Three shared blocks are not a state boundary with k = 2: refused, by position.
    with pytest.raises(ValueError, match="context_offset=12 has no recurrent state"):
        stages.run("c", second, table_a[:3] + [20, 21], 12, [7])


def test_states_are_evicted_with_their_blocks(kimi) -> None:
    model_dir, _ = kimi
    stages = Stages(model_dir, [5])
    tokens = list(range(10, 26))
    stages.run("a", tokens, [0, 1, 2, 3], 0, [16])
    assert all(1 in layer.states for layer in stages.kda_layers())
    # Block 1 is evicted and rewritten by another request: its state goes with it.
    stages.run("x", list(range(40, 46)), [7, 1], 0, [6])
    assert all(1 not in layer.states for layer in stages.kda_layers())
    with pytest.raises(ValueError, match="context_offset=8 has no recurrent state"):
        stages.run("b", tokens[:8] + [1, 2], [0, 1, 9], 8, [2])


def test_state_memory_is_one_state_per_k_blocks(kimi) -> None:
    model_dir, _ = kimi
    stages = Stages(model_dir, [5])
    stages.run("a", list(range(33)), list(range(9)), 0, [33])  # 8 full blocks
    layer = stages.kda_layers()[0]
    h, d = layer.shape.num_heads, layer.shape.head_dim
    per_state = h * d * d * 4 + (layer.shape.conv_kernel - 1) * 3 * h * d * 4
    assert len(layer.states) == 8 // K
    assert layer.cache_bytes == (8 // K) * per_state


async def test_agreement_rounds_l_star_down_to_the_state_interval() -> None:
    managers, controller = local_stages(
        [64, 64], block_size=BS, model_id="m", state_interval_blocks=3
    )
    prompt = list(range(30))  # 7 full blocks
    first = await controller.agree(PromptRequest("a", prompt))
    assert first is not None
    hashes = controller.block_hashes(first.request)
    for manager in managers:
        manager.mark_computed("a", len(prompt), hashes)
    await controller.release(["a"])
    second = await controller.agree(PromptRequest("b", prompt[:29] + [99]))
    assert second is not None
    assert second.stage_hits == (7, 7)
    assert second.num_agreed_blocks == 6  # 7 cached, rounded down to a multiple of 3
    with pytest.raises(ValueError, match="state_interval_blocks=0"):
        AgreementController(controller.stages, block_size=BS, model_id="m", state_interval_blocks=0)


def test_running_states_are_bounded(kimi, monkeypatch) -> None:
    """Requests that never run their last chunk leave at most max_running states behind."""
    model_dir, _ = kimi
    stages = Stages(model_dir, [5])
    monkeypatch.setattr(KDAAttention, "max_running", 2)
    for i in range(3):  # three half-done requests
        spec = ChunkSpec(f"r{i}", 0, 4, (10 + i,), token_ids=(1, 2, 3, 4), is_last=False)
        stages.engines[0].execute(stages.engines[0].prepare([spec]), None)
    for layer in stages.kda_layers():
        assert list(layer.running) == ["r1", "r2"]
    with pytest.raises(ValueError, match="context_offset=4 has no recurrent state"):
        stages.run("r0", [1, 2, 3, 4, 5, 6], [10, 13], 4, [2])


def test_dropped_requests_leave_no_running_state_and_cannot_continue(kimi) -> None:
    """``drop_requests`` (a stage released the requests before their last chunk) drops their
    running states in every KDA layer; the states stored per block stay, the other requests
    continue, and a dropped one's continuation is refused by position."""
    model_dir, model = kimi
    stages = Stages(model_dir, [5])
    engine = stages.engines[0]
    rng = random.Random(3)
    prompts = {f"r{i}": [rng.randrange(VOCAB) for _ in range(12)] for i in range(3)}
    for i, (rid, tokens) in enumerate(prompts.items()):  # 10 of 12: a state after 2 blocks
        table = (3 * i, 3 * i + 1, 3 * i + 2)
        spec = ChunkSpec(rid, 0, 10, table, token_ids=tuple(tokens[:10]), is_last=False)
        engine.execute(engine.prepare([spec]), None)
    layers = stages.kda_layers()
    stored = [sorted(layer.states) for layer in layers]
    held = sum(layer.cache_bytes for layer in layers)
    engine.drop_requests(["r0", "r2", "never-seen"])
    for layer, before in zip(layers, stored, strict=True):
        assert list(layer.running) == ["r1"]
        assert sorted(layer.states) == before == [1, 4, 7]  # the blocks' states stay
    assert sum(layer.cache_bytes for layer in layers) < held
    got = stages.run("r1", prompts["r1"], [3, 4, 5], 10, [2])
    assert (got - last_logits(model, prompts["r1"])).abs().max() < 1e-4
    with pytest.raises(ValueError, match="context_offset=10 has no recurrent state"):
        stages.run("r0", prompts["r0"], [0, 1, 2], 10, [2])
