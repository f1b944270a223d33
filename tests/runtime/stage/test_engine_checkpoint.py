"""Checkpoint engine (MLA + MoE, GQA + MoE, Llama) vs transformers' monolithic forward.

For each family a tiny random model is saved with ``save_pretrained`` (sharded); WavePP's
stages read only their own tensors, run pipelined (S = 1, 2, 4, unequal layer counts),
chunked and prefix-reusing prefill, and their last-token logits must equal the reference's
within 1e-4 (fp32), for a first request and a second one reusing a cached prefix.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from wavepp.api.layer_split import split_layers
from wavepp.runtime.families import FAMILIES
from wavepp.runtime.hf_config import load_model_dir
from wavepp.runtime.stage.engine import ChunkSpec, make_engine
from wavepp.runtime.stage.engine.checkpoint_engine import CheckpointStageEngine
from wavepp.runtime.stage.engine.layers import common
from wavepp.runtime.stage.engine.layers.kda import KDAAttention

transformers = pytest.importorskip("transformers")
from wavepp.bench.checkpoints import save_random_checkpoint  # noqa: E402

pytestmark = pytest.mark.timeout(120)

ATOL = 1e-4
NUM_LAYERS = 5
VOCAB = 256
# (S, partition): unequal layer counts per stage.
SPLITS = [(1, None), (2, [3, 2]), (4, [1, 2, 1, 1])]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    out = tmp_path_factory.mktemp(request.param)
    model = save_random_checkpoint(request.param, out, num_layers=NUM_LAYERS, vocab_size=VOCAB)
    return out, model


def reference_logits(model: torch.nn.Module, tokens: Sequence[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([list(tokens)])).logits[0, -1].float()


class Pipeline:
    """Checkpoint stages in sequence, each with its own shuffled block pool."""

    def __init__(
        self,
        model_dir: Path,
        partition: list[int] | None,
        num_stages: int,
        *,
        device: str = "cpu",
        dtype: str = "float32",
    ) -> None:
        self.model = load_model_dir(model_dir).model_copy(update={"dtype": dtype})
        self.block_size = 4
        self.engines: list[CheckpointStageEngine] = []
        self.free: list[list[int]] = []
        self.tables: dict[str, list[list[int]]] = {}
        for rank, (first, last) in enumerate(
            split_layers(self.model.num_layers, num_stages, partition)
        ):
            engine = make_engine(
                "torch",
                model=self.model,
                first_layer=first,
                last_layer=last,
                num_layers_total=self.model.num_layers,
                model_dir=model_dir,
                device=device,
            )
            assert isinstance(engine, CheckpointStageEngine)
            num_blocks = 40 + 5 * rank
            engine.allocate_kv(num_blocks, self.block_size)
            ids = list(range(num_blocks))
            random.Random(rank).shuffle(ids)
            self.free.append(ids)
            self.engines.append(engine)

    def add(self, rid: str, num_tokens: int, share: str | None = None, shared_blocks: int = 0):
        need = -(-num_tokens // self.block_size)
        self.tables[rid] = []
        for rank in range(len(self.engines)):
            head = self.tables[share][rank][:shared_blocks] if share else []
            self.tables[rid].append(head + [self.free[rank].pop() for _ in range(need - len(head))])

    def run(self, rid: str, tokens: list[int], start: int, sizes: Sequence[int]) -> torch.Tensor:
        offset = start
        logits: dict[str, torch.Tensor] = {}
        for i, n in enumerate(sizes):
            last = i == len(sizes) - 1
            batches = []
            for rank, engine in enumerate(self.engines):
                spec = ChunkSpec(
                    request_id=rid,
                    context_offset=offset,
                    num_tokens=n,
                    block_ids=tuple(self.tables[rid][rank]),
                    token_ids=tuple(tokens[offset : offset + n]) if rank == 0 else None,
                    is_last=last,
                )
                batches.append(engine.prepare([spec]))
            hidden = None
            for engine, batch in zip(self.engines, batches, strict=True):
                out = engine.execute(batch, hidden)
                hidden = out.hidden
                logits = out.last_token_logits
            offset += n
        return logits[rid].cpu()


def close(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert actual.shape == (VOCAB,)
    assert expected.std() > 0.3, "reference logits too flat for a meaningful check"
    return (actual - expected).abs().max().item()


@pytest.mark.parametrize(("num_stages", "partition"), SPLITS)
def test_pipelined_chunked_prefix_reuse_matches_reference(checkpoint, num_stages, partition):
    model_dir, reference = checkpoint
    pipe = Pipeline(model_dir, partition, num_stages)
    rng = random.Random(num_stages)
    first = [rng.randrange(VOCAB) for _ in range(23)]
    pipe.add("a", len(first))
    assert close(pipe.run("a", first, 0, [7, 9, 7]), reference_logits(reference, first)) < ATOL
    # The second prompt shares 14 tokens: 3 full blocks (12 tokens) are reused from the cache.
    second = first[:14] + [rng.randrange(VOCAB) for _ in range(9)]
    pipe.add("b", len(second), share="a", shared_blocks=3)
    got = pipe.run("b", second, 12, [5, 6])
    assert close(got, reference_logits(reference, second)) < ATOL


def test_causal_chunks_over_a_cached_context_attend_without_a_mask(checkpoint, monkeypatch):
    """GQA and MLA (latent) layers attend a chunk over a cached context through the CPU split
    (``layers.common.attend_over_context``): no causal mask is built, SDPA gets none, and the
    logits still match the reference. GLM-5's DSA layers (index_topk 8) take the split for a
    chunk whose whole context fits the top-k (positions 6 of [0, 7)) and their top-k mask for
    one past it (12 tokens over 7)."""
    model_dir, reference = checkpoint
    sdpa = common.F.scaled_dot_product_attention
    split = common.attend_over_context
    calls: list[int] = []

    def sdpa_without_mask(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        assert kwargs.get("attn_mask") is None, "a mask reached SDPA"
        return sdpa(*args, **kwargs)

    def counted_split(q, k, v, scale):  # noqa: ANN001, ANN202
        calls.append(k.shape[0] - q.shape[0])
        return split(q, k, v, scale)

    def no_mask(*_args) -> None:  # noqa: ANN002
        raise AssertionError("causal_mask was built")

    dsa = load_model_dir(model_dir).architecture == "glm_moe_dsa"
    if not dsa:
        monkeypatch.setattr(common.F, "scaled_dot_product_attention", sdpa_without_mask)
        monkeypatch.setattr(common, "causal_mask", no_mask)
    monkeypatch.setattr(common, "attend_over_context", counted_split)
    pipe = Pipeline(model_dir, [3, 2], 2)
    tokens = [(5 * i + 1) % VOCAB for i in range(19)]
    pipe.add("a", len(tokens))
    assert close(pipe.run("a", tokens, 0, [6, 1, 12]), reference_logits(reference, tokens)) < ATOL
    if dsa:
        assert calls and set(calls) == {6}
    else:  # every softmax-attention layer, for each of the two chunks after the first
        assert sorted(set(calls)) == [6, 7] and len(calls) % 2 == 0


def test_reused_prefix_is_read_from_the_cache(checkpoint):
    """Control: corrupting a shared block's cache (KV, latent or recurrent state) on stage 1
    changes the second request."""
    model_dir, reference = checkpoint
    pipe = Pipeline(model_dir, [3, 2], 2)
    tokens = list(range(3, 19))
    pipe.add("a", 16)
    pipe.run("a", tokens, 0, [16])
    second = tokens[:8] + [7, 7, 7]
    pipe.add("b", len(second), share="a", shared_blocks=2)
    block = pipe.tables["a"][1][1]
    for layer in pipe.engines[1]._layers:
        if isinstance(layer.attn, KDAAttention):  # the recurrent state stored after the block
            state, tail = layer.attn.states[block]
            layer.attn.states[block] = (state * -1.0, tail)
            continue
        assert layer.attn.cache is not None
        slots = slice(block * pipe.block_size, (block + 1) * pipe.block_size)
        if layer.attn.cache.dim() == 2:  # MLA latent [slots, latent_dim]
            layer.attn.cache[slots] += 0.5
        else:  # GQA [2, slots, kv_heads, head_dim]
            layer.attn.cache[:, slots] += 0.5
    got = pipe.run("b", second, 8, [3])
    assert close(got, reference_logits(reference, second)) > 1e-3


def test_stages_read_only_their_tensors(checkpoint):
    model_dir, _ = checkpoint
    pipe = Pipeline(model_dir, [1, 2, 1, 1], 4)
    total = 0
    for shard in model_dir.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            total += sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())
    per_stage = [e.bytes_read for e in pipe.engines]
    # Every tensor is read by exactly one stage (untied embeddings: no tensor is shared).
    assert sum(per_stage) == total
    # The middle stage holds 2 of 5 layers and neither embedding nor head.
    assert per_stage[1] < 0.6 * total
    assert len(pipe.engines[1].reader.files_opened) < len(
        set(pipe.engines[1].reader.weight_map.values())
    )


def test_latent_cache_is_not_expanded(tmp_path):
    """MLA caches kv_lora_rank + qk_rope_head_dim values per token, not 2 * H * head_dim."""
    save_random_checkpoint("deepseek_v3", tmp_path, num_layers=2, vocab_size=VOCAB)
    model = load_model_dir(tmp_path)
    engine = make_engine(
        "torch", model=model, first_layer=0, last_layer=2, num_layers_total=2, model_dir=tmp_path
    )
    engine.allocate_kv(10, 4)
    assert engine.kv_cache_bytes == 2 * 10 * 4 * (16 + 8) * 4


def test_bad_checkpoints_are_refused_by_name(tmp_path):
    save_random_checkpoint("llama", tmp_path, num_layers=2, vocab_size=VOCAB)
    model = load_model_dir(tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    raw = json.loads(index.read_text())
    del raw["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    index.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"lacks .*model\.layers\.1\.mlp\.up_proj\.weight"):
        make_engine(
            "torch",
            model=model,
            first_layer=1,
            last_layer=2,
            num_layers_total=2,
            model_dir=tmp_path,
        )
    other = model.model_copy(update={"hidden_size": 32})
    with pytest.raises(ValueError, match="model.hidden_size=32 differs"):
        make_engine(
            "torch",
            model=other,
            first_layer=0,
            last_layer=1,
            num_layers_total=2,
            model_dir=tmp_path,
        )


def test_a_config_json_edited_after_the_config_was_derived_is_refused(tmp_path):
    """A stage checks every field of config.json it computes with (rope_theta, eps, heads, not
    only the architecture, layers, width and vocabulary) against the derived config, so a
    directory edited between two stages' starts is refused, not computed with silently."""
    save_random_checkpoint("llama", tmp_path, num_layers=2, vocab_size=VOCAB)
    model = load_model_dir(tmp_path)  # what the admission and the other stage derived
    config = tmp_path / "config.json"
    raw = json.loads(config.read_text())
    raw["rms_norm_eps"] = raw["rms_norm_eps"] * 10
    config.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"model\.rms_norm_eps=.* differs from model_dir"):
        make_engine(
            "torch",
            model=model,
            first_layer=0,
            last_layer=1,
            num_layers_total=2,
            model_dir=tmp_path,
        )


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    out = tmp_path_factory.mktemp("glm")
    return out, save_random_checkpoint("glm_moe_dsa", out, num_layers=NUM_LAYERS, vocab_size=VOCAB)


def test_dsa_selection_matters_and_reads_the_cached_indexer_keys(glm_dir, monkeypatch):
    """Controls for GLM-5: with index_topk (8) below the context the indexer's choice changes
    the logits (dense attention differs), and a reused prefix's indexer keys are read from
    the paged indexer cache (corrupting them changes the reusing request)."""
    model_dir, reference = glm_dir
    tokens = [(7 * i + 3) % VOCAB for i in range(20)]
    pipe = Pipeline(model_dir, [3, 2], 2)
    pipe.add("a", 20)
    assert close(pipe.run("a", tokens, 0, [20]), reference_logits(reference, tokens)) < ATOL
    for engine in pipe.engines:
        for layer in engine._layers:
            if layer.indexer is not None:
                monkeypatch.setattr(layer.indexer, "shape", replace(layer.indexer.shape, topk=64))
    pipe.add("dense", 20)
    assert close(pipe.run("dense", tokens, 0, [20]), reference_logits(reference, tokens)) > 1e-3
    monkeypatch.undo()
    second = tokens[:16] + [5, 6, 7]
    pipe.add("b", len(second), share="a", shared_blocks=4)
    for layer in pipe.engines[1]._layers:
        if layer.indexer is not None:
            for block in pipe.tables["a"][1][:4]:
                layer.indexer.cache[block * 4 : (block + 1) * 4] *= -1.0
    assert close(pipe.run("b", second, 16, [3]), reference_logits(reference, second)) > 1e-3


def test_dsa_stage_must_begin_at_a_full_indexer_layer(glm_dir):
    model_dir, _ = glm_dir
    with pytest.raises(ValueError, match="begins at layer 2, a DSA 'shared' layer"):
        Pipeline(model_dir, [2, 3], 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("dtype", "atol"), [("float32", 1e-3), ("bfloat16", 0.25)])
def test_cuda_chunked_prefix_reuse_matches_reference(checkpoint, dtype, atol):  # noqa: ANN001
    """Every family on CUDA: chunks with and without cached context (the fused lower-right
    causal kernel, grouped experts), 2 stages, against transformers' float32 forward."""
    model_dir, model = checkpoint
    rng = random.Random(11)
    first = [rng.randrange(VOCAB) for _ in range(26)]
    second = first[:16] + [rng.randrange(VOCAB) for _ in range(9)]
    pipe = Pipeline(model_dir, [3, 2], 2, device="cuda", dtype=dtype)
    pipe.add("a", len(first))
    assert close(pipe.run("a", first, 0, [10, 16]), reference_logits(model, first)) < atol
    pipe.add("b", len(second), share="a", shared_blocks=4)
    assert close(pipe.run("b", second, 16, [4, 5]), reference_logits(model, second)) < atol
