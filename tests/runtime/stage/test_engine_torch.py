"""Torch stage engine: shapes, slot mapping, KV writes, weights, errors; model config."""

from __future__ import annotations

import pydantic
import pytest
import torch

from wavepp.runtime.stage.engine import (
    PRESETS,
    ChunkSpec,
    ModelConfig,
    StageEngine,
    get_preset,
    make_engine,
)
from wavepp.runtime.stage.engine.torch_engine import (
    TorchStageEngine,
    build_full_state_dict,
    build_layer_state_dict,
    build_stage_state_dict,
)

pytestmark = pytest.mark.timeout(60)

CONFIG = ModelConfig(
    name="unit-llama",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
)


def engine_for(first: int, last: int, num_blocks: int = 16, block_size: int = 4, **kw):
    engine = TorchStageEngine(
        model=CONFIG, first_layer=first, last_layer=last, num_layers_total=CONFIG.num_layers, **kw
    )
    engine.allocate_kv(num_blocks, block_size)
    return engine


def chunk(
    rid: str = "r",
    offset: int = 0,
    num_tokens: int = 5,
    block_ids: tuple[int, ...] = (0, 1, 2, 3),
    token_ids: tuple[int, ...] | None = None,
    is_last: bool = True,
) -> ChunkSpec:
    if token_ids is None:
        token_ids = tuple((7 * i + 3) % CONFIG.vocab_size for i in range(num_tokens))
    return ChunkSpec(rid, offset, num_tokens, block_ids, token_ids, is_last)


# ---------------------------------------------------------------- model config, partition


def test_model_config_validation_and_presets() -> None:
    with pytest.raises(pydantic.ValidationError, match="num_kv_heads"):
        ModelConfig(num_heads=4, num_kv_heads=3)
    with pytest.raises(pydantic.ValidationError, match="head_dim"):
        ModelConfig(head_dim=7)
    with pytest.raises(pydantic.ValidationError, match="hidden_size"):
        ModelConfig(hidden_size=0)
    with pytest.raises(pydantic.ValidationError):
        CONFIG.num_layers = 3  # type: ignore[misc]  # frozen
    assert set(PRESETS) >= {"tiny-llama", "small-llama"}
    assert get_preset("tiny-llama") == ModelConfig()
    assert get_preset("small-llama").hidden_size == 256
    with pytest.raises(ValueError, match="not-a-model"):
        get_preset("not-a-model")


# ---------------------------------------------------------------- weights


def test_weights_are_independent_of_the_partition() -> None:
    full = build_full_state_dict(CONFIG)
    stage = build_stage_state_dict(CONFIG, 2, 4)
    assert set(stage) == {
        k for k in full if not k.startswith(("model.layers.0.", "model.layers.1."))
    } - {"model.embed_tokens.weight"}
    for name, tensor in stage.items():
        assert torch.equal(tensor, full[name]), name
    layer2 = build_layer_state_dict(CONFIG, 2)
    layer3 = build_layer_state_dict(CONFIG, 3)
    q2, q3 = (
        layer2["model.layers.2.self_attn.q_proj.weight"],
        layer3["model.layers.3.self_attn.q_proj.weight"],
    )
    assert q2.shape == (CONFIG.num_heads * CONFIG.head_dim, CONFIG.hidden_size)
    assert not torch.equal(q2, q3)
    other_seed = build_layer_state_dict(CONFIG.model_copy(update={"seed": 1}), 2)
    assert not torch.equal(other_seed["model.layers.2.self_attn.q_proj.weight"], q2)
    with pytest.raises(ValueError, match="layer_index=4"):
        build_layer_state_dict(CONFIG, 4)


def test_two_stages_equal_one_stage() -> None:
    whole = engine_for(0, 4)
    first, second = engine_for(0, 1, num_blocks=9), engine_for(1, 4, num_blocks=11)
    spec = chunk(num_tokens=10, block_ids=(3, 1, 0))
    expected = whole.execute(whole.prepare([spec]), None).last_token_logits["r"]
    hidden = first.execute(first.prepare([spec]), None).hidden
    spec2 = chunk(num_tokens=10, block_ids=(8, 2, 5), token_ids=None)
    got = second.execute(second.prepare([spec2]), hidden).last_token_logits["r"]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_local_safetensors_weights(tmp_path) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    state = build_full_state_dict(CONFIG.model_copy(update={"seed": 5}))
    safetensors_torch.save_file(state, str(tmp_path / "model.safetensors"))
    loaded = engine_for(0, 4, weights_path=tmp_path)
    seeded = TorchStageEngine(
        model=CONFIG.model_copy(update={"seed": 5}), first_layer=0, last_layer=4, num_layers_total=4
    )
    seeded.allocate_kv(16, 4)
    default = engine_for(0, 4)
    spec = chunk(num_tokens=6)
    out_loaded = loaded.execute(loaded.prepare([spec]), None).last_token_logits["r"]
    out_seeded = seeded.execute(seeded.prepare([spec]), None).last_token_logits["r"]
    out_default = default.execute(default.prepare([spec]), None).last_token_logits["r"]
    torch.testing.assert_close(out_loaded, out_seeded, rtol=0, atol=1e-6)
    assert not torch.allclose(out_loaded, out_default)

    state["lm_head.weight"] = state["lm_head.weight"][:, :-1].contiguous()
    safetensors_torch.save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="lm_head.weight"):
        engine_for(0, 4, weights_path=tmp_path)
    with pytest.raises(ValueError, match="weights_path"):
        engine_for(0, 4, weights_path=tmp_path / "missing")


# ---------------------------------------------------------------- prepare: slot mapping


def test_prepare_builds_slot_mapping_positions_and_tables() -> None:
    engine = engine_for(1, 3, num_blocks=12, block_size=4)
    chunks = [
        ChunkSpec("a", 3, 6, (7, 2, 9, 11), None, False),  # positions 3..8, table needs 3 blocks
        ChunkSpec("b", 0, 2, (5,), None, True),
    ]
    p = engine.prepare(chunks)
    assert p.num_tokens == 8
    assert p.row_starts == (0, 6)
    assert p.positions.tolist() == [3, 4, 5, 6, 7, 8, 0, 1]
    # slot = block_id * block_size + position % block_size
    assert p.slot_mapping.tolist() == [7 * 4 + 3, 8, 9, 10, 11, 36, 20, 21]
    assert p.block_tables.tolist() == [[7, 2, 9], [5, -1, -1]]
    assert p.context_lens.tolist() == [9, 2]
    assert p.key_slots[0].tolist() == [28, 29, 30, 31, 8, 9, 10, 11, 36]
    assert p.logits_rows == (("b", 7),)
    assert p.token_ids is None
    assert p.rope_cos.shape == (8, CONFIG.head_dim)


def test_execute_shapes_and_kv_writes() -> None:
    engine = engine_for(0, 2, num_blocks=10, block_size=4)
    assert isinstance(engine, StageEngine)
    assert (engine.is_first, engine.is_last, engine.hidden_size) == (True, False, 32)
    assert engine.kv_cache is not None
    assert engine.kv_cache.shape == (2, 2, 10, 4, CONFIG.num_kv_heads, CONFIG.head_dim)
    assert engine.kv_cache_bytes == 2 * 2 * 10 * 4 * 2 * 8 * 4
    out = engine.execute(engine.prepare([chunk(num_tokens=6, block_ids=(6, 3))]), None)
    assert out.hidden is not None and out.hidden.shape == (6, 32)
    assert out.hidden.dtype == torch.float32
    assert out.last_token_logits == {}
    written = engine.kv_cache.abs().sum(dim=(0, 1, 4, 5))  # [num_blocks, block_size]
    assert (written[6] > 0).all() and (written[3, :2] > 0).all()
    assert (written[3, 2:] == 0).all()
    untouched = [b for b in range(10) if b not in (3, 6)]
    assert (written[untouched] == 0).all()


def test_last_stage_logits_only_for_last_chunks() -> None:
    engine = engine_for(2, 4)
    p = engine.prepare(
        [
            ChunkSpec("a", 0, 3, (0,), None, False),
            ChunkSpec("b", 0, 5, (1, 2), None, True),
        ]
    )
    out = engine.execute(p, torch.randn(8, 32))
    assert out.hidden is None
    assert set(out.last_token_logits) == {"b"}
    assert out.last_token_logits["b"].shape == (CONFIG.vocab_size,)
    assert out.last_token_logits["b"].dtype == torch.float32


def test_make_engine_torch() -> None:
    engine = make_engine(
        "torch", model=CONFIG, first_layer=1, last_layer=3, num_layers_total=4, device="cpu"
    )
    assert isinstance(engine, TorchStageEngine)
    assert (engine.first_layer, engine.last_layer, engine.is_first, engine.is_last) == (
        1,
        3,
        False,
        False,
    )
    with pytest.raises(ValueError, match="kind='tpu'"):
        make_engine("tpu", model=CONFIG, first_layer=0, last_layer=4, num_layers_total=4)  # type: ignore[arg-type]


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (
            chunk(offset=6, num_tokens=5, block_ids=(0, 1)),
            r"block_ids of request 'r' has 2 blocks.*need 3",
        ),
        (chunk(block_ids=(0, 16)), r"block_ids.*\[16\] outside \[0, 16\)"),
        (chunk(num_tokens=0, token_ids=()), "num_tokens=0"),
        (chunk(offset=-1), "context_offset=-1"),
        (ChunkSpec("r", 0, 3, (0,), None, True), "token_ids of request 'r' is None"),
        (ChunkSpec("r", 0, 3, (0,), (1, 2), True), "token_ids.*has 2 ids"),
        (ChunkSpec("r", 0, 2, (0,), (1, 64), True), r"token_ids.*\[64\].*vocab_size=64"),
    ],
)
def test_prepare_rejects_bad_chunks(spec: ChunkSpec, match: str) -> None:
    engine = engine_for(0, 1)
    with pytest.raises(ValueError, match=match):
        engine.prepare([spec])


def test_prepare_rejects_bad_microbatches() -> None:
    engine = engine_for(0, 1)
    with pytest.raises(ValueError, match="chunks is empty"):
        engine.prepare([])
    with pytest.raises(ValueError, match="request_id='r' appears twice"):
        engine.prepare([chunk(block_ids=(0, 1)), chunk(offset=5, block_ids=(0, 1, 2))])
    with pytest.raises(ValueError, match="slot_mapping"):
        engine.prepare([chunk("a", block_ids=(0, 1)), chunk("b", block_ids=(2, 1))])
    with pytest.raises(ValueError, match="max_position=16"):
        small = TorchStageEngine(
            model=CONFIG.model_copy(update={"max_position": 16}),
            first_layer=0,
            last_layer=1,
            num_layers_total=4,
        )
        small.allocate_kv(16, 4)
        small.prepare([chunk(offset=14, num_tokens=3, block_ids=(0, 1, 2, 3, 4))])
    fresh = TorchStageEngine(model=CONFIG, first_layer=0, last_layer=1, num_layers_total=4)
    with pytest.raises(RuntimeError, match="allocate_kv"):
        fresh.prepare([chunk()])


def test_execute_rejects_bad_inputs() -> None:
    first = engine_for(0, 2)
    middle = engine_for(2, 3)
    p_first = first.prepare([chunk()])
    with pytest.raises(ValueError, match="hidden_in must be None"):
        first.execute(p_first, torch.zeros(5, 32))
    with pytest.raises(ValueError, match="another engine"):
        middle.execute(p_first, torch.zeros(5, 32))
    p_mid = middle.prepare([chunk(token_ids=None)])
    with pytest.raises(ValueError, match="hidden_in is None"):
        middle.execute(p_mid, None)
    with pytest.raises(ValueError, match=r"hidden_in has shape \(4, 32\)"):
        middle.execute(p_mid, torch.zeros(4, 32))
    middle.allocate_kv(8, 8)
    with pytest.raises(ValueError, match="prepare again"):
        middle.execute(p_mid, torch.zeros(5, 32))


def test_constructor_errors() -> None:
    with pytest.raises(ValueError, match="num_layers_total=5"):
        TorchStageEngine(model=CONFIG, first_layer=0, last_layer=2, num_layers_total=5)
    with pytest.raises(ValueError, match="last_layer=5"):
        TorchStageEngine(model=CONFIG, first_layer=2, last_layer=5, num_layers_total=4)
    with pytest.raises(ValueError, match="first_layer=2"):
        TorchStageEngine(model=CONFIG, first_layer=2, last_layer=2, num_layers_total=4)
    with pytest.raises(ValueError, match="bfloat16"):
        TorchStageEngine(
            model=CONFIG.model_copy(update={"dtype": "bfloat16"}),
            first_layer=0,
            last_layer=2,
            num_layers_total=4,
        )
    engine = TorchStageEngine(model=CONFIG, first_layer=0, last_layer=2, num_layers_total=4)
    with pytest.raises(ValueError, match="block_size=0"):
        engine.allocate_kv(4, 0)
    with pytest.raises(ValueError, match="num_blocks=0"):
        engine.allocate_kv(0, 4)


# ---------------------------------------------------------------- calibrate


def test_measure_stage_costs_shapes_and_errors() -> None:
    from wavepp.runtime.stage.calibrate import default_grid, measure_stage_costs

    grid = [(0, 8), (40, 4), (0, 64)]
    samples = measure_stage_costs(CONFIG, num_layers=1, grid=grid, repeats=1, block_size=8)
    assert [(l_, x) for l_, x, _ in samples] == grid
    assert all(s > 0 for _, _, s in samples)
    assert len(default_grid()) >= 4
    assert len({l_ for l_, _ in default_grid()}) >= 2 and len({x for _, x in default_grid()}) >= 2
    with pytest.raises(ValueError, match="grid is empty"):
        measure_stage_costs(CONFIG, num_layers=1, grid=[])
    with pytest.raises(ValueError, match="x=0"):
        measure_stage_costs(CONFIG, num_layers=1, grid=[(0, 0)])
    with pytest.raises(ValueError, match="num_layers=0"):
        measure_stage_costs(CONFIG, num_layers=0, grid=grid)


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bfloat16_close_to_cpu_float32() -> None:
    spec = chunk(num_tokens=12, block_ids=(0, 1, 2))
    cpu = engine_for(0, 4)
    expected = cpu.execute(cpu.prepare([spec]), None).last_token_logits["r"]
    for dtype, atol in (("float32", 1e-3), ("bfloat16", 0.15)):
        gpu = TorchStageEngine(
            model=CONFIG.model_copy(update={"dtype": dtype}),
            first_layer=0,
            last_layer=4,
            num_layers_total=4,
            device="cuda",
        )
        gpu.allocate_kv(16, 4)
        got = gpu.execute(gpu.prepare([spec]), None).last_token_logits["r"]
        assert got.device.type == "cuda" and got.dtype == torch.float32
        torch.testing.assert_close(got.cpu(), expected, rtol=0, atol=atol)


def test_torch_compile_is_refused_where_it_cannot_be_honoured() -> None:
    from wavepp.runtime.config import RuntimeConfig

    cost = {"c": 1e-4, "g": 1e-7, "b": 1e-5, "a": 1e-8}
    with pytest.raises(pydantic.ValidationError, match="torch_compile=True needs engine='torch'"):
        RuntimeConfig(engine="emulated", cost_model=cost, torch_compile=True)
    with pytest.raises(pydantic.ValidationError, match="tensor_parallel_size=2"):
        RuntimeConfig(num_stages=1, tensor_parallel_size=2, torch_compile=True)
    assert RuntimeConfig(num_stages=1, torch_compile=True).torch_compile
