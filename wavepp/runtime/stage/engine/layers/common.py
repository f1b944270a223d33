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
        mask: [x, L + x] bool, True where a query may attend a key (a sparse selection, as
            DSA's top-k); None: causal (query j attends keys ``<= L + j``) without a
            materialised mask: SDPA's ``is_causal`` kernel path when L = 0 (on CPU with
            ``d_qk != d_v`` zero-padded to equal head sizes, the flash kernel's); else on CPU
            :func:`attend_over_context` (two mask-free passes merged); on other devices
            ``torch.nn.attention.bias.causal_lower_right`` (a fused kernel on CUDA).
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
        d_v = v.shape[-1]
        if q.device.type == "cpu" and q.shape[-1] != d_v:
            # the CPU flash kernel takes equal head sizes (else SDPA takes its math path)
            qt, kt, vt = (t.transpose(0, 1).unsqueeze(0) for t in _equal_head_sizes(q, k, v))
        out = F.scaled_dot_product_attention(
            qt, kt, vt, is_causal=True, scale=scale, enable_gqa=gqa
        )[..., :d_v]
    elif q.device.type == "cpu":
        return attend_over_context(q, k, v, scale)
    else:
        # Imported here: torch.nn.attention.bias loads torch._dynamo (~2 s at process start),
        # which a stage on the emulated engine, or on CPU, never needs.
        from torch.nn.attention.bias import causal_lower_right

        bias = causal_lower_right(q.shape[0], k.shape[0])
        if gqa:  # the fused lower-right kernels take equal head counts
            group = q.shape[1] // k.shape[1]
            kt, vt = kt.repeat_interleave(group, dim=1), vt.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=bias, scale=scale)
    return out[0].transpose(0, 1)


def _equal_head_sizes(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q``, ``k`` [.., d_qk] and ``v`` [.., d_v] with the narrower side zero-padded to
    ``max(d_qk, d_v)`` (the CPU flash kernel's rule): zero dims add nothing to a dot
    product, and zero value dims give zero output dims, cut by the caller."""
    d_qk, d_v = q.shape[-1], v.shape[-1]
    if d_v < d_qk:
        v = F.pad(v, (0, d_qk - d_v))
    elif d_qk < d_v:
        q, k = F.pad(q, (0, d_v - d_qk)), F.pad(k, (0, d_v - d_qk))
    return q, k, v


def _flash_cpu(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass of the CPU flash kernel: ``q`` [x, heads, d], ``k``/``v`` [n, kv_heads, d]
    (kv_heads divides heads; the kernel maps head h to kv head ``h // (heads / kv_heads)``,
    as SDPA's ``enable_gqa``); ``causal``: query j sees keys ``<= j`` (top-left). Returns
    out [x, heads, d] (q's dtype) and the natural log-sum-exp of each query's scaled scores
    [x, heads] (float32).

    ``aten._scaled_dot_product_flash_attention_for_cpu`` is a private op (SDPA's CPU flash
    path); public SDPA does not return the log-sum-exp. ``tests/runtime/stage/
    test_attention.py`` pins its schema and its log-sum-exp. The op reads the last dim as
    unit-strided whatever its stride (public SDPA handles such views), so a tensor whose
    last dim is strided (a view such as ``x[..., ::2]``) is copied contiguous first.
    """
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        *(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), 0.0, causal, scale=scale
    )
    return out[0].transpose(0, 1), lse[0].transpose(0, 1)


def attend_over_context(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of a chunk over a cached context, on CPU, with no mask built.

    Query j (position ``L + j``) sees every context key ``[0, L)`` and the chunk's own keys
    ``<= L + j``. Two mask-free passes of the CPU flash kernel: (a) the queries against keys
    ``[0, L)``, (b) against the chunk's keys ``[L, L + x)`` with the top-left causal kernel,
    each with its log-sum-exp ``lse``, merged exactly in float32::

        out = (o_a * exp(lse_a - m) + o_b * exp(lse_b - m)) / (exp(lse_a - m) + exp(lse_b - m))
            = o_b + (o_a - o_b) * sigmoid(lse_a - lse_b)          m = max(lse_a, lse_b)

    (the merge of two attention states of cascade / split-KV attention; formula source:
    FlashInfer's tutorial "Attention States and Recursive Attention",
    https://docs.flashinfer.ai/tutorials/recursive_attention.html). When ``d_qk != d_v``
    (MLA) the kernel's equal-head-size rule is met by zero-padding the narrower side.

    Args:
        q: [x, heads, d_qk] queries of positions ``[L, L + x)``, x >= 1.
        k: [L + x, kv_heads, d_qk] keys of positions ``[0, L + x)``, L >= 1 (kv_heads
            divides heads).
        v: [L + x, kv_heads, d_v] values.
        scale: softmax scale.

    Returns:
        [x, heads, d_v] in q's dtype.

    Raises:
        ValueError: not on CPU, or ``k`` has no context key (L < 1; causal attention over
            the chunk alone is SDPA's ``is_causal``).
    """
    x, context = q.shape[0], k.shape[0] - q.shape[0]
    if q.device.type != "cpu" or context < 1:
        raise ValueError(
            f"attend_over_context needs CPU tensors and a context of >= 1 key; got device "
            f"{q.device.type}, {k.shape[0]} keys for {x} queries"
        )
    d_v = v.shape[-1]
    q, k, v = _equal_head_sizes(q, k, v)
    o_a, lse_a = _flash_cpu(q, k[:context], v[:context], False, scale)
    o_b, lse_b = _flash_cpu(q, k[context:], v[context:], True, scale)
    weight_a = torch.sigmoid(lse_a - lse_b).unsqueeze(-1)
    o_a, o_b = o_a[..., :d_v].float(), o_b[..., :d_v].float()
    return (o_b + (o_a - o_b) * weight_a).to(q.dtype)
