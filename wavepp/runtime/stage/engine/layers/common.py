"""Pieces every layer family shares: RMSNorm, RoPE and attention over gathered paged keys.

Attention here reads a chunk's whole context ``[0, L + x)`` through its ``key_slots`` (the
gather index into a paged cache, see ``engine/base.py``) after the chunk's new tokens were
written, so a cached prefix and the chunk's own tokens are read the same way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from wavepp.runtime.stage.engine.tensor_parallel import TPGroup

# NOTE: ``get(name, shape, dim=None)`` -> tensor of this stage (already on the engine's device
# and dtype); ``shape`` is the checkpoint's full shape; with ``dim`` the result is this TP rank's
# contiguous share along ``dim`` (``tensor_parallel.TPGroup.shard``). Raises ValueError naming
# the checkpoint tensor when it is absent or of the wrong shape.
WeightGetter = Callable[..., torch.Tensor]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 as Hugging Face's ``*RMSNorm`` modules (weight * x_hat)."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rms_norm_sharded(
    x: torch.Tensor, weight: torch.Tensor, eps: float, full_width: int, tp: TPGroup
) -> torch.Tensor:
    """:func:`rms_norm` over a width split across the TP group: ``x`` [n, full_width / T] is
    this rank's share, the mean square is summed over the group (MiniMax-M2's q/k norm spans
    all heads)."""
    if tp.size == 1:
        return rms_norm(x, weight, eps)
    x32 = x.to(torch.float32)
    sq = tp.all_reduce(x32.pow(2).sum(-1, keepdim=True))
    x32 = x32 * torch.rsqrt(sq / full_width + eps)
    return weight * x32.to(x.dtype)


def rope_cos_sin(
    positions: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` of shape [T, rotary_dim] (HF layout: the half-size table repeated twice).

    Args:
        positions: [T] int64 token positions.
        rotary_dim: rotated dimensions (even).
        theta: RoPE base (``rope_parameters.rope_theta``).
        dtype: output dtype (the activations').
    """
    inv_freq = 1.0 / (
        theta
        ** (
            torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=positions.device)
            / rotary_dim
        )
    )
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope_rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` dims of ``x`` [T, heads, d] (rotate-half layout);
    the rest pass through (partial rotary, as MiniMax-M2)."""
    rd = cos.shape[-1]
    c, s = cos[:, None, :], sin[:, None, :]
    rot = x[..., :rd] * c + _rotate_half(x[..., :rd]) * s
    if rd == x.shape[-1]:
        return rot
    return torch.cat((rot, x[..., rd:]), dim=-1)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on pairs ``(x0, x1), (x2, x3), ...`` of ``x`` [T, heads, d], output de-interleaved
    (evens' rotations then odds'), exactly HF's ``apply_rotary_pos_emb_interleave``."""
    half = cos.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def apply_rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on pairs ``(x0, x1), (x2, x3), ...`` of ``x`` [T, heads, d], output in the same pair
    order (GPT-J style, vLLM's ``is_neox_style=False``): ``apply_rope_interleaved``'s values,
    re-interleaved. Dot products of two tensors both roped this way equal those of both roped
    by ``apply_rope_interleaved`` (one permutation applied to both)."""
    half = cos.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)


def causal_mask(context_offset: int, num_tokens: int, device: torch.device) -> torch.Tensor:
    """[x, L + x] bool, True where query j (position L + j) may attend key k (k <= L + j):
    the causal mask aligned to the bottom right, for ``L`` = ``context_offset``, ``x`` =
    ``num_tokens``."""
    return torch.ones(
        (num_tokens, context_offset + num_tokens), dtype=torch.bool, device=device
    ).tril(context_offset)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Softmax attention of one chunk through SDPA.

    Args:
        q: [x, heads, d_qk] queries of positions ``[L, L + x)``.
        k: [L + x, kv_heads, d_qk] keys of positions ``[0, L + x)`` (kv_heads divides heads).
        v: [L + x, kv_heads, d_v] values.
        mask: [x, L + x] bool, True where a query may attend a key; None: causal (query j
            attends keys ``<= L + j``) without a materialised mask: SDPA's ``is_causal``
            kernel path when L = 0, else ``torch.nn.attention.bias.causal_lower_right`` (a
            fused kernel on CUDA; a dense mask on other devices, so callers there pass one).
        scale: softmax scale.

    Returns:
        [x, heads, d_v].
    """
    qt, kt, vt = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    gqa = k.shape[1] != q.shape[1]
    if mask is not None:
        out = F.scaled_dot_product_attention(
            qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=gqa
        )
    elif q.shape[0] == k.shape[0]:
        out = F.scaled_dot_product_attention(
            qt, kt, vt, is_causal=True, scale=scale, enable_gqa=gqa
        )
    else:
        # Imported here: torch.nn.attention.bias loads torch._dynamo (~2 s at process start),
        # which a stage on the emulated engine, or on CPU (dense masks), never needs.
        from torch.nn.attention.bias import causal_lower_right

        bias = causal_lower_right(q.shape[0], k.shape[0])
        if gqa:  # the fused lower-right kernels take equal head counts
            group = q.shape[1] // k.shape[1]
            kt, vt = kt.repeat_interleave(group, dim=1), vt.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=bias, scale=scale)
    return out[0].transpose(0, 1)
