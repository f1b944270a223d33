"""The torch engines' host tier, without processes: the copy bookkeeping (which device block's
bytes land in which host slot and back, in log order), the refusals, and a round trip of a
prefix through the host tier on every family (GQA K/V, MLA latents, DSA indexer keys,
Kimi-Linear's per-block states) whose logits equal the cold forward's.

The round trip drives the real ``StageKVManager`` over a ``BlockPool`` with a ``HostTier``: a
filler that needs the whole device pool evicts the prefix (spilled to host, the copies applied
before the filler overwrites the blocks); a request sharing the prefix then finds it in the
host tier only, loads it into device blocks that held the filler's KV, and computes the rest.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch

from wavepp.runtime.families import FAMILIES
from wavepp.runtime.kv import BlockPool, HostTier, StageKVManager, Transfer, hash_prompt_blocks
from wavepp.runtime.stage.engine import ChunkSpec, make_engine
from wavepp.runtime.stage.engine.decoder import DecoderStageEngine
from wavepp.runtime.stage.engine.host_copy import HostCopies, block_rows

transformers = pytest.importorskip("transformers")
from wavepp.bench.checkpoints import save_random_checkpoint  # noqa: E402

pytestmark = pytest.mark.timeout(120)

BLOCK = 4
VOCAB = 256


def _marked(num_blocks: int) -> torch.Tensor:
    """A GQA-shaped cache [2, num_blocks * BLOCK, 1, 2] whose every value names its block."""
    cache = torch.zeros(2, num_blocks * BLOCK, 1, 2)
    for block in range(num_blocks):
        cache[:, block * BLOCK : (block + 1) * BLOCK] = float(block + 1)
    return cache


def _block_value(rows: torch.Tensor, index: int) -> float:
    """The one value a block-first row holds (asserting it is uniform)."""
    row = rows[index]
    assert torch.all(row == row.flatten()[0]), row
    return float(row.flatten()[0])


def test_copy_log_moves_rows_in_log_order() -> None:
    cache = _marked(8)
    rows = block_rows(cache, 1, BLOCK)
    states: dict[int, tuple[torch.Tensor, ...]] = {5: (torch.full((2,), 5.0),)}
    copies = HostCopies([rows], [states], 3, torch.device("cpu"))
    copies.apply(
        [
            Transfer("spill", 2, 0),
            Transfer("spill", 5, 1),
            Transfer("spill", 3, 0),  # slot 0 reused (its hash evicted): block 3's bytes win
        ]
    )
    assert [_block_value(copies.hosts[0], s) for s in (0, 1)] == [4.0, 6.0]
    assert set(copies.host_states[0]) == {1}  # block 5's state went with it; block 3 had none
    cache[:, 5 * BLOCK : 6 * BLOCK] = -1.0  # block 5 reused by another request
    states.pop(5)
    copies.apply(
        [
            Transfer("load", 7, 1),  # slot 1 (block 5's bytes) into block 7
            Transfer("load", 2, 0),  # slot 0 (block 3's bytes) into block 2
            Transfer("spill", 7, 2),  # after the load: block 7 now holds block 5's bytes
        ]
    )
    assert _block_value(rows, 7) == 6.0 and _block_value(rows, 2) == 4.0
    assert _block_value(copies.hosts[0], 2) == 6.0
    assert torch.equal(states[7][0], torch.full((2,), 5.0)) and 2 not in states
    assert _block_value(rows, 5) == -1.0  # untouched by loads
    assert (copies.num_spilled, copies.num_loaded) == (4, 2)
    assert copies.bytes_copied == 6 * 2 * BLOCK * 2 * 4


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):  # noqa: ANN201
    out = tmp_path_factory.mktemp("llama")
    return out, save_random_checkpoint("llama", out, num_layers=2, vocab_size=VOCAB)


def _engine(model_dir, num_blocks: int, num_slots: int) -> DecoderStageEngine:  # noqa: ANN001
    from wavepp.runtime.hf_config import load_model_dir

    model = load_model_dir(model_dir)
    engine = make_engine(
        "torch",
        model=model,
        first_layer=0,
        last_layer=model.num_layers,
        num_layers_total=model.num_layers,
        model_dir=model_dir,
    )
    assert isinstance(engine, DecoderStageEngine)
    engine.allocate_kv(num_blocks, BLOCK)
    engine.allocate_host_kv(num_slots)
    return engine


def test_transfers_are_refused_by_name(llama_dir) -> None:  # noqa: ANN001
    engine = _engine(llama_dir[0], 4, 2)
    with pytest.raises(ValueError, match=r"transfers\[0\]\.block_id=4 is not in \[0, 4\)"):
        engine.apply_transfers([Transfer("spill", 4, 0)])
    with pytest.raises(ValueError, match=r"transfers\[1\]\.slot=2 is not in \[0, 2\)"):
        engine.apply_transfers([Transfer("spill", 0, 0), Transfer("load", 1, 2)])
    engine.allocate_host_kv(0)
    with pytest.raises(ValueError, match="no host tier"):
        engine.apply_transfers([Transfer("load", 0, 0)])
    engine.apply_transfers([])  # nothing to do is fine
    with pytest.raises(ValueError, match="num_host_kv_blocks=-1"):
        engine.allocate_host_kv(-1)


class _Stage:
    """One engine over all layers behind a real KV manager with a host tier."""

    def __init__(self, model_dir, num_blocks: int, num_slots: int) -> None:  # noqa: ANN001
        self.engine = _engine(model_dir, num_blocks, num_slots)
        self.manager = StageKVManager(BlockPool(num_blocks, BLOCK, host=HostTier(num_slots)))

    def run(self, rid: str, tokens: Sequence[int]) -> tuple[int, torch.Tensor]:
        """Agree, load, compute the prompt in one chunk; (L* in tokens, last-token logits)."""
        hashes = hash_prompt_blocks(tokens, BLOCK, "m")
        hit = self.manager.probe_pin(rid, hashes, 10.0)
        table = self.manager.reserve(rid, -(-len(tokens) // BLOCK), 10.0)
        assert table is not None, "the pool holds the request"
        start = min(hit * BLOCK, (len(tokens) - 1) // BLOCK * BLOCK)
        cached = self.manager.start_chunk(rid, start)
        # the stage worker's order: the plan's copies, then prepare and execute
        self.engine.apply_transfers(self.manager.pool.take_transfers())
        spec = ChunkSpec(
            request_id=rid,
            context_offset=start,
            num_tokens=len(tokens) - start,
            block_ids=tuple(table),
            token_ids=tuple(tokens[start:]),
            is_last=True,
            num_cached_tokens=cached,
        )
        logits = self.engine.execute(self.engine.prepare([spec]), None).last_token_logits[rid]
        self.manager.mark_computed(rid, len(tokens))
        self.manager.release(rid)
        return start, logits


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prefix_round_trip_through_the_host_tier_matches_the_cold_forward(
    family: str, tmp_path
) -> None:  # noqa: ANN001
    reference = save_random_checkpoint(family, tmp_path, num_layers=3, vocab_size=VOCAB)

    def cold(tokens: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return reference(torch.tensor([tokens])).logits[0, -1].float()

    stage = _Stage(tmp_path, num_blocks=8, num_slots=16)
    rng = random.Random(family)
    prefix = [rng.randrange(VOCAB) for _ in range(4 * BLOCK)]
    first = prefix + [rng.randrange(VOCAB) for _ in range(3)]
    start, logits = stage.run("a", first)
    assert start == 0 and (logits - cold(first)).abs().max() < 1e-4
    # a filler needing all 8 device blocks: every cached block is evicted, so spilled
    filler = [rng.randrange(VOCAB) for _ in range(8 * BLOCK)]
    stage.run("filler", filler)
    pool = stage.manager.pool
    hashes = hash_prompt_blocks(first, BLOCK, "m")
    assert not set(hashes) & pool.cached_block_hashes()
    assert set(hashes) <= pool.host.cached_block_hashes()  # type: ignore[union-attr]
    # the prefix comes back from the host tier only, into blocks that held the filler's KV
    second = prefix + [rng.randrange(VOCAB) for _ in range(5)]
    start, logits = stage.run("b", second)
    assert start == 4 * BLOCK, "the host tier's run was agreed and loaded"
    copies = stage.engine.host_copies
    assert copies is not None and copies.num_loaded == 4 and copies.num_spilled >= 4
    expected = cold(second)
    assert expected.std() > 0.3, "reference logits too flat for a meaningful check"
    assert (logits - expected).abs().max() < 1e-4
    assert int(torch.argmax(logits)) == int(torch.argmax(expected))


def test_stage_metrics_count_host_spills_and_loads(llama_dir) -> None:  # noqa: ANN001
    from types import SimpleNamespace

    from wavepp.runtime.stage.metrics import StageMetrics, snapshot_of

    stage = _Stage(llama_dir[0], num_blocks=8, num_slots=16)
    worker = SimpleNamespace(
        config=SimpleNamespace(pipeline="p"),
        rank=1,
        core=SimpleNamespace(
            manager=stage.manager,
            num_microbatches=3,
            execute_s=0.5,
            num_chunks=0,
            num_context_chunks=0,
            num_new_tokens=0,
            num_context_tokens=0,
        ),
        is_formed=True,
        group_epoch=0,
        num_reforms=0,
    )
    metrics = StageMetrics(lambda: snapshot_of(worker))
    rng = random.Random(1)
    prefix = [rng.randrange(VOCAB) for _ in range(2 * BLOCK)]
    stage.run("a", prefix + [1])
    stage.run("filler", [rng.randrange(VOCAB) for _ in range(8 * BLOCK)])
    stage.run("b", prefix + [2, 3])
    text = metrics.scrape()[0].decode()
    labels = 'pipeline="p",stage_rank="1"'
    assert f'wavepp_stage_host_kv_blocks_total{{op="loaded",{labels}}} 2.0' in text, text
    spilled = stage.manager.pool.host.num_spills  # type: ignore[union-attr]
    assert spilled >= 2
    assert f'wavepp_stage_host_kv_blocks_total{{op="spilled",{labels}}} {spilled}.0' in text


def test_a_host_tier_on_a_tensor_parallel_stage_is_refused_by_name() -> None:
    from wavepp.runtime.config import RuntimeConfig
    from wavepp.runtime.model_config import ModelConfig

    model = ModelConfig(num_layers=2, num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match=r"num_host_kv_blocks=\[8\].*tensor_parallel_size=2"):
        RuntimeConfig(
            model=model,
            engine="torch",
            num_stages=1,
            tensor_parallel_size=2,
            num_host_kv_blocks=[8],
        )
    RuntimeConfig(model=model, engine="torch", num_stages=1, num_host_kv_blocks=[8])
