"""``layers.common.attend``: every path (is_causal, a given mask, the lower-right causal bias)
equals a plain softmax over the causal keys of each query."""

from __future__ import annotations

import pytest
import torch

from wavepp.runtime.stage.engine.layers.common import attend, causal_mask


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int) -> torch.Tensor:
    """softmax(q k^T * scale) v with query j seeing keys <= offset + j, heads repeated."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * q.shape[-1] ** -0.5
    allowed = torch.arange(k.shape[0])[None, :] <= offset + torch.arange(q.shape[0])[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("offset", [0, 5, 32])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2)])
def test_every_attention_path_matches_the_causal_softmax(offset, heads, kv_heads) -> None:  # noqa: ANN001
    gen = torch.Generator().manual_seed(offset + heads + kv_heads)
    x = 7
    q = torch.randn(x, heads, 16, generator=gen)
    k = torch.randn(offset + x, kv_heads, 16, generator=gen)
    v = torch.randn(offset + x, kv_heads, 16, generator=gen)
    want = reference(q, k, v, offset)
    scale = 16**-0.5
    for mask in (None, causal_mask(offset, x, q.device)):
        got = attend(q, k, v, mask, scale)
        assert got.shape == (x, heads, 16)
        assert torch.allclose(got, want, atol=1e-5), (mask is None, (got - want).abs().max())


def test_causal_mask_is_aligned_to_the_bottom_right() -> None:
    mask = causal_mask(3, 2, torch.device("cpu"))
    assert mask.tolist() == [[True] * 4 + [False], [True] * 5]
