"""Grouped-query attention over a paged K/V cache: Llama and MiniMax-M2.

Per layer, for ``x`` = the input-normed activations [T, hidden]::

    q, k, v = x Wq^T, x Wk^T, x Wv^T
    MiniMax-M2 only: q = RMSNorm(q) over all heads at once, k = RMSNorm(k)   (qk_norm)
    q, k = RoPE(q, k) on the first rotary_dim dims (rotate-half), the rest pass through
    cache[slot_mapping] = k, v;  per chunk: softmax(q K^T * head_dim^-0.5 + causal) V, K and V
        the chunk's own k, v when it has no cached context, else gathered from the cache
    out = o Wo^T

Tensor parallelism (T ranks): each rank holds heads ``H/T`` and K/V heads ``KV/T`` (rows of
q/k/v, columns of o) and its heads' cache; the o projection's partial sums are all-reduced; the
qk-norm's mean square is summed over the group (it spans all heads).

Sources: HF ``modeling_llama`` and ``modeling_minimax_m2`` (``MiniMaxM2Attention``: q_norm and
k_norm are RMSNorms of width heads * head_dim; partial rotary from ``partial_rotary_factor``).
"""

from __future__ import annotations

import torch

from wavepp.runtime.families.layer_plan import GQAShape
from wavepp.runtime.stage.engine.layers.common import (
    WeightGetter,
    apply_rope_rotate_half,
    attend,
    rms_norm_sharded,
)
from wavepp.runtime.stage.engine.layers.linear import PackedLinear
from wavepp.runtime.stage.engine.profile import region
from wavepp.runtime.stage.engine.tensor_parallel import SINGLE, TPGroup


class GQAAttention:
    """One layer's GQA weights and its paged K/V cache
    ``[2 (K, V), num_blocks * block_size, num_kv_heads / T, head_dim]``."""

    def __init__(
        self,
        shape: GQAShape,
        get: WeightGetter,
        prefix: str,
        tp: TPGroup = SINGLE,
        *,
        pack: bool = True,
        pack_qkv: bool | None = None,
    ) -> None:
        """Load ``{prefix}{q,k,v,o}_proj.weight`` (and ``q_norm``/``k_norm`` with qk_norm),
        this TP rank's heads only; q/k/v fused into one projection. ``pack``: the
        projections may take ``PackedLinear``'s packed CPU path; ``pack_qkv``: the fused
        q/k/v projection's own switch (None: ``pack``; False where ``project`` is compiled).

        Raises:
            ValueError: a tensor is missing or has the wrong shape (from ``get``), or the
                heads do not divide by the TP size.
        """
        s = shape
        self.shape = s
        self.tp = tp
        tp.shard(s.num_heads, "num_attention_heads")
        tp.shard(s.num_kv_heads, "num_key_value_heads")
        self.heads, self.kv_heads = s.num_heads // tp.size, s.num_kv_heads // tp.size
        q_dim, kv_dim = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        self.qkv = PackedLinear(
            torch.cat(
                [
                    get(prefix + "q_proj.weight", (q_dim, s.hidden_size), 0),
                    get(prefix + "k_proj.weight", (kv_dim, s.hidden_size), 0),
                    get(prefix + "v_proj.weight", (kv_dim, s.hidden_size), 0),
                ]
            ),
            pack=pack if pack_qkv is None else pack_qkv,
        )
        self.o = PackedLinear(get(prefix + "o_proj.weight", (s.hidden_size, q_dim), 1), pack=pack)
        self.q_norm = get(prefix + "q_norm.weight", (q_dim,), 0) if s.qk_norm else None
        self.k_norm = get(prefix + "k_norm.weight", (kv_dim,), 0) if s.qk_norm else None
        self.cache: torch.Tensor | None = None

    def allocate(self, num_slots: int, device: torch.device, dtype: torch.dtype) -> None:
        """Allocate a zeroed cache of ``num_slots`` token slots (drops the old one)."""
        self.use_cache(
            torch.zeros(
                (2, num_slots, self.kv_heads, self.shape.head_dim), device=device, dtype=dtype
            )
        )

    def use_cache(self, cache: torch.Tensor) -> None:
        """Adopt ``cache`` [2, num_slots, num_kv_heads / T, head_dim] (e.g. a view into a
        stage-wide tensor) as this layer's cache, dropping the old one.

        Raises:
            ValueError: ``cache`` of another shape.
        """
        if (
            cache.dim() != 4
            or cache.shape[0] != 2
            or cache.shape[2:]
            != (
                self.kv_heads,
                self.shape.head_dim,
            )
        ):
            raise ValueError(
                f"cache of shape {tuple(cache.shape)}; a GQA layer needs "
                f"[2, num_slots, {self.kv_heads}, {self.shape.head_dim}]"
            )
        self.cache = cache

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[T, hidden] normed activations -> roped q [T, H/T, d], roped k and v
        [T, KV/T, d] (q/k normed first with qk_norm); ``cos``/``sin`` as ``rope_cos_sin``."""
        s = self.shape
        num_tokens = x.shape[0]
        q_dim, kv_dim = self.heads * s.head_dim, self.kv_heads * s.head_dim
        q, k, v = self.qkv(x).split([q_dim, kv_dim, kv_dim], dim=-1)
        if self.q_norm is not None and self.k_norm is not None:
            q = rms_norm_sharded(q, self.q_norm, s.eps, s.num_heads * s.head_dim, self.tp)
            k = rms_norm_sharded(k, self.k_norm, s.eps, s.num_kv_heads * s.head_dim, self.tp)
        q = apply_rope_rotate_half(q.view(num_tokens, self.heads, s.head_dim), cos, sin)
        k = apply_rope_rotate_half(k.view(num_tokens, self.kv_heads, s.head_dim), cos, sin)
        return q, k, v.view(num_tokens, self.kv_heads, s.head_dim)

    def forward(self, x: torch.Tensor, p) -> torch.Tensor:  # noqa: ANN001 (TorchPreparedBatch)
        """[T, hidden] normed activations -> [T, hidden] attention output (before residual)."""
        s = self.shape
        assert self.cache is not None, "allocate() runs before forward()"
        num_tokens = x.shape[0]
        q_dim = self.heads * s.head_dim
        with region("qkv"):
            q, k, v = self.project(x, p.rope_cos, p.rope_sin)
        with region("kv_write"):
            self.cache[0].index_copy_(0, p.slot_mapping, p.written(k))
            self.cache[1].index_copy_(0, p.slot_mapping, p.written(v))
        out = torch.empty_like(q)
        scale = s.head_dim**-0.5
        for chunk, start, key_slots in zip(p.chunks, p.row_starts, p.key_slots, strict=True):
            end = start + chunk.num_tokens
            if chunk.context_offset == 0:  # the context is the chunk's own new tokens
                ck, cv = k[start:end], v[start:end]
            else:
                with region("kv_gather"):
                    ck, cv = self.cache[0][key_slots], self.cache[1][key_slots]
            with region("attention"):
                out[start:end] = attend(q[start:end], ck, cv, None, scale)
        with region("attn_out"):
            return self.tp.all_reduce(self.o(out.reshape(num_tokens, q_dim)))

    @property
    def cache_bytes(self) -> int:
        """Bytes of the allocated cache (0 before allocate)."""
        return 0 if self.cache is None else self.cache.numel() * self.cache.element_size()
