"""Layout conversions of the handoff: the stage reads a request's tokens out of its paged cache
(block size 4) by its block table; the vLLM side maps them to its own blocks (size 8) and
converts range and dtype for the backend's cache writer (which the end-to-end test runs).
Per family: what a stage hands over is, layer by layer, the K/V transformers caches for the same
checkpoint (K after the family's QK-norm and (partial) RoPE); for MLA the latent transformers
caches (its roped key in the checkpoint's pair order, transformers' de-interleaved); or a
refusal by name (DSA indexer keys, KDA states)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from wavepp.integrations.vllm.layout import kv_for_backend, latent_for_backend, slots_of
from wavepp.runtime.families import FAMILIES
from wavepp.runtime.hf_config import load_model_dir
from wavepp.runtime.stage.engine import ChunkSpec, make_engine
from wavepp.runtime.stage.handoff_server import overlap_seconds, read_layer_kv


def test_stage_read_follows_the_block_table() -> None:
    block, heads, dim = 4, 2, 3
    cache = torch.randn(2, 10 * block, heads, dim)
    table = [7, 2, 5]
    got = read_layer_kv(cache, table, block, 10)
    for t in range(10):
        slot = table[t // block] * block + t % block
        assert torch.equal(got[:, t], cache[:, slot])
    with pytest.raises(ValueError, match="exceeds 3 blocks"):
        read_layer_kv(cache, table, block, 13)


def test_vllm_side_slots_and_kv_conversion() -> None:
    # vLLM blocks of 8: token t of a request with blocks [4, 1] sits at slot block * 8 + row
    assert slots_of([4, 1], 8, 2, 10).tolist() == [34, 35, 36, 37, 38, 39, 8, 9, 10, 11]
    with pytest.raises(ValueError, match="need more than 2 blocks"):
        slots_of([4, 1], 8, 10, 7)
    kv = torch.randn(2, 13, 2, 4, dtype=torch.float64)
    key, value = kv_for_backend(kv, 2, 10, num_kv_heads=2, head_dim=4, dtype=torch.float32)
    assert key.shape == value.shape == (10, 2, 4) and key.dtype == torch.float32
    assert key.is_contiguous() and value.is_contiguous()
    assert torch.equal(key, kv[0, 2:12].float()) and torch.equal(value, kv[1, 2:12].float())
    with pytest.raises(ValueError, match=r"needs \[2, tokens, 3, 4\]"):
        kv_for_backend(kv, 0, 1, num_kv_heads=3, head_dim=4, dtype=torch.float32)
    with pytest.raises(ValueError, match="holds 13 tokens"):
        kv_for_backend(kv, 5, 9, num_kv_heads=2, head_dim=4, dtype=torch.float32)


def test_overlap_seconds_counts_union_of_busy_time() -> None:
    spans = [(0.0, 10.0), (20.0, 22.0)]
    busy = [(1.0, 3.0), (2.0, 4.0), (9.0, 21.0)]
    assert overlap_seconds(spans, busy) == pytest.approx(3.0 + 1.0 + 1.0)
    assert overlap_seconds(spans, []) == 0.0


def _prefill_two_stages(model_dir: Path, tokens: list[int], block: int) -> list[torch.Tensor]:
    """Prefill ``tokens`` in two chunks on stages [0, 2) and [2, 4) (shuffled block tables);
    each layer's cache as the stage's handoff reads it: [parts, num_tokens, heads, dim]."""
    model = load_model_dir(model_dir)
    need = -(-len(tokens) // block)
    engines, tables = [], []
    for rank, (first, last) in enumerate([(0, 2), (2, 4)]):
        engine = make_engine(
            "torch",
            model=model,
            first_layer=first,
            last_layer=last,
            num_layers_total=4,
            model_dir=model_dir,
        )
        engine.allocate_kv(need + 3, block)
        ids = list(range(need + 3))
        random.Random(rank).shuffle(ids)
        engines.append(engine)
        tables.append(tuple(ids[:need]))
    split = len(tokens) // 2
    for start, end in [(0, split), (split, len(tokens))]:
        hidden = None
        for rank, engine in enumerate(engines):
            spec = ChunkSpec(
                request_id="r",
                context_offset=start,
                num_tokens=end - start,
                block_ids=tables[rank],
                token_ids=tuple(tokens[start:end]) if rank == 0 else None,
                is_last=end == len(tokens),
            )
            hidden = engine.execute(engine.prepare([spec]), hidden).hidden
    return [
        read_layer_kv(cache, table, block, len(tokens))
        for engine, table in zip(engines, tables, strict=True)
        for cache in engine.handoff_caches()
    ]


GQA_FAMILIES = ["llama", "minimax_m2"]
"""The registered families whose layers keep K/V."""
MLA_FAMILIES = ["deepseek_v3"]
"""The registered families whose layers all keep an MLA latent and nothing else (glm_moe_dsa's
layers add DSA indexer keys, kimi_linear's KDA states: neither is handed over)."""


def test_handed_families_are_the_registered_ones_with_kv_or_latent() -> None:
    assert set(GQA_FAMILIES + MLA_FAMILIES) <= set(FAMILIES)
    assert set(FAMILIES) - set(GQA_FAMILIES + MLA_FAMILIES) == {"glm_moe_dsa", "kimi_linear"}


def test_vllm_side_latent_split() -> None:
    latent = torch.randn(1, 13, 1, 6 + 4, dtype=torch.float64)
    c, k_pe = latent_for_backend(latent, 2, 10, kv_lora_rank=6, rope_dim=4, dtype=torch.float32)
    assert c.shape == (10, 6) and k_pe.shape == (10, 1, 4) and c.dtype == torch.float32
    assert c.is_contiguous() and k_pe.is_contiguous()
    assert torch.equal(torch.cat((c, k_pe[:, 0]), dim=-1), latent[0, 2:12, 0].float())
    with pytest.raises(ValueError, match=r"needs \[1, tokens, 1, 11\]"):
        latent_for_backend(latent, 0, 1, kv_lora_rank=7, rope_dim=4, dtype=torch.float32)
    with pytest.raises(ValueError, match="holds 13 tokens"):
        latent_for_backend(latent, 5, 9, kv_lora_rank=6, rope_dim=4, dtype=torch.float32)


@pytest.mark.parametrize(
    ("family", "refusal"),
    [
        ("glm_moe_dsa", "a DSA indexer's key cache is not handed over"),
        ("kimi_linear", "KDAAttention keeps no allocated K/V or MLA latent cache"),
    ],
)
def test_a_stage_refuses_caches_the_handoff_does_not_carry(
    family: str, refusal: str, tmp_path: Path
) -> None:
    pytest.importorskip("transformers")
    from wavepp.bench.checkpoints import save_random_checkpoint

    save_random_checkpoint(family, tmp_path, num_layers=4, vocab_size=256)
    engine = make_engine(
        "torch",
        model=load_model_dir(tmp_path),
        first_layer=0,
        last_layer=4,
        num_layers_total=4,
        model_dir=tmp_path,
    )
    engine.allocate_kv(4, 4)
    with pytest.raises(ValueError, match=refusal):
        engine.handoff_caches()


@pytest.mark.parametrize("family", [*GQA_FAMILIES, *MLA_FAMILIES])
def test_each_family_hands_over_transformers_cache(family: str, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")  # noqa: F841 (the reference's library)
    from wavepp.bench.checkpoints import save_random_checkpoint

    reference = save_random_checkpoint(family, tmp_path, num_layers=4, vocab_size=256)
    tokens = [random.Random(5).randrange(256) for _ in range(19)]
    handed = _prefill_two_stages(tmp_path, tokens, block=4)
    with torch.inference_mode():
        cache = reference(torch.tensor([tokens]), use_cache=True).past_key_values
    assert len(handed) == 4
    for i, kv in enumerate(handed):
        # transformers caches [batch, kv_heads, tokens, head_dim]; the wire is token-major
        keys = cache.layers[i].keys[0].transpose(0, 1)
        values = cache.layers[i].values[0].transpose(0, 1)
        if family in MLA_FAMILIES:  # transformers caches the latent: (normed c, roped k)
            _assert_latent_is(kv, keys, values)
            continue
        assert kv.shape == (2, len(tokens), *keys.shape[1:])
        torch.testing.assert_close(kv[0], keys, atol=1e-4, rtol=0)
        torch.testing.assert_close(kv[1], values, atol=1e-4, rtol=0)
        # into vLLM blocks of 8 (block table [3, 0, 5]) and back: the same K/V
        slots = slots_of([3, 0, 5], 8, 0, len(tokens))
        key, value = kv_for_backend(
            kv, 0, len(tokens), num_kv_heads=kv.shape[2], head_dim=kv.shape[3], dtype=torch.float32
        )
        paged = torch.zeros(2, 6 * 8, *kv.shape[2:])
        paged[0, slots], paged[1, slots] = key, value
        assert torch.equal(paged[:, slots], kv)


def _assert_latent_is(latent: torch.Tensor, normed: torch.Tensor, roped: torch.Tensor) -> None:
    """``latent`` [1, T, 1, kv_lora_rank + rope] is transformers' MLA cache of the layer (its
    "keys" the normed latent [T, 1, kv_lora_rank], its "values" the roped key [T, 1, rope],
    de-interleaved: the wire keeps the checkpoint's pair order), and a vLLM CPU MLA cache row
    (``do_kv_cache_update`` writes [latent | k_pe] at the slot) is the wire's row."""
    num_tokens, _, rank = normed.shape
    rope = roped.shape[-1]
    assert latent.shape == (1, num_tokens, 1, rank + rope)
    c, k_pe = latent_for_backend(
        latent, 0, num_tokens, kv_lora_rank=rank, rope_dim=rope, dtype=torch.float32
    )
    torch.testing.assert_close(c, normed[:, 0], atol=1e-4, rtol=0)
    de_interleaved = torch.cat((k_pe[..., 0::2], k_pe[..., 1::2]), dim=-1)
    torch.testing.assert_close(de_interleaved, roped, atol=1e-4, rtol=0)
    slots = slots_of([3, 0, 5], 8, 0, num_tokens)
    flat = torch.zeros(6 * 8, rank + rope)
    flat[slots, :rank], flat[slots, rank:] = c, k_pe[:, 0]
    assert torch.equal(flat[slots], latent[0, :, 0])
