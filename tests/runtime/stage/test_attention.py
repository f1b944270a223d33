"""``layers.common.attend``: every path (is_causal, a given mask, the split over a cached
context on CPU, the lower-right causal bias elsewhere) equals a plain softmax over the causal
keys of each query; the CPU split builds no mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from wavepp.runtime.stage.engine.layers import common
from wavepp.runtime.stage.engine.layers.common import attend, attend_over_context, causal_mask


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int) -> torch.Tensor:
    """softmax(q k^T * scale) v with query j seeing keys <= offset + j, heads repeated
    (float64)."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * q.shape[-1] ** -0.5
    allowed = torch.arange(k.shape[0])[None, :] <= offset + torch.arange(q.shape[0])[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def inputs(x: int, offset: int, heads: int, kv_heads: int, d_qk: int, d_v: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(x, heads, d_qk, generator=gen)
    k = torch.randn(offset + x, kv_heads, d_qk, generator=gen)
    v = torch.randn(offset + x, kv_heads, d_v, generator=gen)
    return q, k, v


@pytest.mark.parametrize("offset", [0, 5, 32])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2)])
def test_every_attention_path_matches_the_causal_softmax(offset, heads, kv_heads) -> None:  # noqa: ANN001
    x = 7
    q, k, v = inputs(x, offset, heads, kv_heads, 16, 16, offset + heads + kv_heads)
    want = reference(q, k, v, offset).float()
    scale = 16**-0.5
    for mask in (None, causal_mask(offset, x, q.device)):
        got = attend(q, k, v, mask, scale)
        assert got.shape == (x, heads, 16)
        assert torch.allclose(got, want, atol=1e-5), (mask is None, (got - want).abs().max())


# (heads, kv_heads, d_qk, d_v): GQA, MHA, MLA's wider keys than values, and values wider.
SHAPES = [(6, 2, 16, 16), (3, 3, 16, 16), (4, 4, 24, 16), (2, 2, 8, 12)]


@pytest.mark.parametrize(("heads", "kv_heads", "d_qk", "d_v"), SHAPES)
@pytest.mark.parametrize(("offset", "x"), [(0, 5), (1, 1), (1, 9), (13, 1), (33, 7), (70, 17)])
def test_causal_attention_over_a_context_builds_no_mask(
    monkeypatch, heads, kv_heads, d_qk, d_v, offset, x
) -> None:  # noqa: ANN001
    """mask=None equals the dense-mask path and the float64 reference, for L = 0 and L > 0 and
    odd sizes, without building a causal mask or handing SDPA one."""
    q, k, v = inputs(x, offset, heads, kv_heads, d_qk, d_v, offset * 31 + x + d_qk)
    scale = d_qk**-0.5
    dense = attend(q, k, v, causal_mask(offset, x, q.device), scale)
    sdpa = F.scaled_dot_product_attention

    def sdpa_without_mask(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        assert kwargs.get("attn_mask") is None, "a mask reached SDPA"
        return sdpa(*args, **kwargs)

    def no_mask(*_args) -> None:  # noqa: ANN002
        raise AssertionError("causal_mask was built")

    monkeypatch.setattr(common, "causal_mask", no_mask)
    monkeypatch.setattr(common.F, "scaled_dot_product_attention", sdpa_without_mask)
    got = attend(q, k, v, None, scale)
    assert got.shape == (x, heads, d_v)
    torch.testing.assert_close(got, dense, rtol=0, atol=1e-5)
    torch.testing.assert_close(got.double(), reference(q, k, v, offset), rtol=0, atol=1e-5)


def test_mla_head_sizes_reach_sdpa_padded_to_equal_on_cpu(monkeypatch) -> None:
    """A chunk without context whose keys are wider than its values (MLA) reaches SDPA with
    equal head sizes (the CPU flash kernel's rule) and still equals the reference."""
    q, k, v = inputs(9, 0, 4, 4, 24, 16, 5)
    sdpa = F.scaled_dot_product_attention
    seen: list[tuple[int, int]] = []

    def recording(query, key, value, **kwargs):  # noqa: ANN001, ANN003, ANN202
        seen.append((query.shape[-1], value.shape[-1]))
        return sdpa(query, key, value, **kwargs)

    monkeypatch.setattr(common.F, "scaled_dot_product_attention", recording)
    got = attend(q, k, v, None, 24**-0.5)
    assert seen == [(24, 24)]
    assert got.shape == (9, 4, 16)
    torch.testing.assert_close(got.double(), reference(q, k, v, 0), rtol=0, atol=1e-5)


def test_the_split_in_bfloat16_stays_within_rounding_of_float32() -> None:
    q, k, v = inputs(19, 45, 8, 2, 32, 32, 3)
    want = reference(q, k, v, 45).float()
    got = attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), None, 32**-0.5)
    assert got.dtype == torch.bfloat16
    assert (got.float() - want).abs().max() < 2e-2


@pytest.mark.parametrize("strided", ["q", "k", "v"])
def test_the_split_reads_views_whose_last_dim_is_strided(strided) -> None:  # noqa: ANN001
    """Inputs whose last dim is not unit-strided (``t[..., ::2]`` of a wider tensor) give the
    reference's result: the private CPU flash op would read them as if unit-strided."""
    q, k, v = inputs(3, 5, 4, 2, 16, 16, 7)
    given = {"q": q, "k": k, "v": v}
    wide = torch.zeros(*given[strided].shape[:-1], 32)
    wide[..., ::2] = given[strided]
    given[strided] = wide[..., ::2]
    assert given[strided].stride(-1) == 2
    got = attend(given["q"], given["k"], given["v"], None, 16**-0.5)
    torch.testing.assert_close(got.double(), reference(q, k, v, 5), rtol=0, atol=1e-5)


def test_the_split_refuses_a_chunk_without_context_and_other_devices() -> None:
    q, k, v = inputs(4, 0, 2, 2, 8, 8, 0)
    with pytest.raises(ValueError, match="context of >= 1 key"):
        attend_over_context(q, k, v, 1.0)
    q, k, v = (t.to("meta") for t in inputs(4, 3, 2, 2, 8, 8, 0))
    with pytest.raises(ValueError, match="CPU tensors"):
        attend_over_context(q, k, v, 1.0)


def test_the_private_cpu_flash_op_returns_the_natural_log_sum_exp() -> None:
    """The split relies on a private aten op: pin its schema and what its second output is
    (log-sum-exp of the scaled scores per query, float32, [batch, heads, queries])."""
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    schema = str(op.default._schema)
    assert "bool is_causal=False" in schema and "float? scale=None" in schema
    assert schema.endswith("-> (Tensor output, Tensor logsumexp)")
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, n, 8, generator=gen) for n in (5, 9, 9))
    out, lse = op(q, k, v, 0.0, False, scale=0.3)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * 0.3
    assert lse.dtype == torch.float32 and lse.shape == (1, 4, 5)
    torch.testing.assert_close(lse, scores.logsumexp(-1), rtol=0, atol=1e-5)
    torch.testing.assert_close(out, scores.softmax(-1) @ v, rtol=0, atol=1e-5)


def test_causal_mask_is_aligned_to_the_bottom_right() -> None:
    mask = causal_mask(3, 2, torch.device("cpu"))
    assert mask.tolist() == [[True] * 4 + [False], [True] * 5]
