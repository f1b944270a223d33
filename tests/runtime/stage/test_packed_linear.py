"""PackedLinear: the packed CPU path equals F.linear within float32 rounding, falls back where
it cannot pack, and the engine honours its ``pack_weights`` switch."""

from __future__ import annotations

import pydantic
import pytest
import torch
import torch.nn.functional as F

from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.stage.engine import ChunkSpec, ModelConfig
from wavepp.runtime.stage.engine.layers.gqa import GQAAttention
from wavepp.runtime.stage.engine.layers.linear import PackedLinear, _pack
from wavepp.runtime.stage.engine.layers.moe import DenseMLP
from wavepp.runtime.stage.engine.torch_engine import TorchStageEngine

pytestmark = pytest.mark.timeout(60)

ONEDNN = torch.backends.mkldnn.is_available()
CONFIG = ModelConfig(
    name="unit-llama",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
)


@pytest.mark.skipif(not ONEDNN, reason="this torch has no oneDNN: nothing is packed")
@pytest.mark.parametrize("rows", [0, 1, 7, 512, 1000])
def test_packed_equals_f_linear_for_any_row_count(rows: int) -> None:
    """One weight packed for PACK_HINT_ROWS serves any row count, 2-D and 3-D inputs and a
    non-contiguous input, equal to F.linear up to float32 summation order."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=g) * 64**-0.5
    layer = PackedLinear(w.clone())
    assert layer.packed
    x = torch.randn(rows, 128, generator=g)[:, :64]  # non-contiguous rows
    torch.testing.assert_close(layer(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
    x3 = torch.randn(2, rows, 64, generator=g)
    got = layer(x3)
    assert got.shape == (2, rows, 96)
    torch.testing.assert_close(got, F.linear(x3, w), rtol=1e-5, atol=1e-5)


def test_unpacked_path_is_f_linear_exactly() -> None:
    w = torch.randn(24, 16)
    layer = PackedLinear(w, pack=False)
    assert not layer.packed
    x = torch.randn(5, 16)
    assert torch.equal(layer(x), F.linear(x, w))


def test_falls_back_where_onednn_cannot_pack() -> None:
    """float64 (not a packable dtype) and a bfloat16 weight oneDNN refuses on this CPU keep the
    plain weight; the answer is F.linear's either way."""
    w64 = torch.randn(8, 4, dtype=torch.float64)
    layer = PackedLinear(w64)
    assert not layer.packed
    x = torch.randn(3, 4, dtype=torch.float64)
    assert torch.equal(layer(x), F.linear(x, w64))
    wb = torch.randn(16, 32).to(torch.bfloat16)
    bf = PackedLinear(wb)
    assert bf.packed == (_pack(wb) is not None)
    xb = torch.randn(4, 32).to(torch.bfloat16)
    torch.testing.assert_close(bf(xb).float(), F.linear(xb, wb).float(), rtol=2e-2, atol=2e-2)


def test_bad_shapes_are_named() -> None:
    with pytest.raises(ValueError, match=r"2-D \[out, in\]; got shape \(4,\)"):
        PackedLinear(torch.randn(4))
    layer = PackedLinear(torch.randn(8, 4))
    with pytest.raises(ValueError, match=r"takes \[\.\.\., 4\]"):
        layer(torch.randn(2, 5))


def _engine(pack: bool, **kw) -> TorchStageEngine:
    engine = TorchStageEngine(
        model=CONFIG,
        first_layer=0,
        last_layer=CONFIG.num_layers,
        num_layers_total=CONFIG.num_layers,
        pack_weights=pack,
        **kw,
    )
    engine.allocate_kv(16, 4)
    return engine


def _projections(engine: TorchStageEngine) -> list[PackedLinear]:
    out = []
    for layer in engine._layers:
        assert isinstance(layer.attn, GQAAttention) and isinstance(layer.ffn, DenseMLP)
        out += [layer.attn.qkv, layer.attn.o, layer.ffn.gate_up, layer.ffn.down]
    return out


def test_engine_honours_pack_weights_and_both_ways_agree() -> None:
    packed, plain = _engine(True), _engine(False)
    assert all(p.packed == ONEDNN for p in _projections(packed))
    assert not any(p.packed for p in _projections(plain))
    spec = ChunkSpec("r", 0, 10, (0, 1, 2), tuple((5 * i + 1) % 64 for i in range(10)), True)
    a = packed.execute(packed.prepare([spec]), None).last_token_logits["r"]
    b = plain.execute(plain.prepare([spec]), None).last_token_logits["r"]
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_compiled_parts_keep_plain_weights_and_the_rest_stay_packed() -> None:
    """torch.compile (inductor) cannot take a oneDNN-packed weight: the parts compile takes
    (GQA's q/k/v projection, the dense feed-forward) stay plain; the output projection, which
    runs eager, is packed as ``pack_weights`` says."""
    engine = _engine(True, compile=True)
    for layer in engine._layers:
        assert not any(p.packed for p in (layer.attn.qkv, layer.ffn.gate_up, layer.ffn.down))
        assert layer.attn.o.packed == ONEDNN


def test_pack_weights_false_is_refused_where_there_are_no_weights() -> None:
    cost = {"c": 1e-4, "g": 1e-7, "b": 1e-5, "a": 1e-8}
    with pytest.raises(pydantic.ValidationError, match="pack_weights=False needs engine='torch'"):
        RuntimeConfig(engine="emulated", cost_model=cost, pack_weights=False)
    assert not RuntimeConfig(num_stages=1, pack_weights=False).pack_weights


def test_build_engine_passes_the_switch() -> None:
    from wavepp.runtime.stage.build import build_engine

    config = RuntimeConfig(
        num_stages=1, model=CONFIG, num_kv_blocks=[16], block_size=4, pack_weights=False
    )
    engine = build_engine(config, 0)
    assert isinstance(engine, TorchStageEngine)
    assert not any(p.packed for p in _projections(engine))
