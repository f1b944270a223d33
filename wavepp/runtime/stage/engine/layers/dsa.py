"""DeepSeek sparse attention (DSA) indexer with a paged key cache: GLM-5 (``glm_moe_dsa``).

The indexer of a "full" layer scores every cached token for each query and keeps the top-k;
the MLA attention of that layer, and of the "shared" layers after it up to the next full one
(GLM-5.2's IndexShare), attends over those tokens only. Per full layer, for ``x`` = the
input-normed activations [T, hidden] and ``q_resid`` = MLA's normed q latent [T, q_lora]::

    q = q_resid Wqb^T -> [T, H_I, D];  k = LayerNorm(x Wk^T) [T, D]
    (q, k)[..., :d_rope] = RoPE (interleaved pairs), the rest passes through
    key_cache[slot_mapping] = k        paged beside the latent cache, D values per token
    per chunk: s[t, j] = sum_h w[t, h] * relu(q[t, h] . K[j] * D^-0.5),  w = x Wproj^T * H_I^-0.5
               keep top-min(index_topk, L + x) keys among the causal ones

Top-k selection is per query over its causal context, so it does not depend on chunking; a
cached prefix contributes its cached indexer keys. A stage must begin at a full layer (a shared
layer needs the previous layer's selection, which does not cross stages); the engine refuses
other partitions. Sources: DeepSeek-V3.2 report (lightning indexer); HF
``modeling_glm_moe_dsa.GlmMoeDsaIndexer`` / ``GlmMoeDsaAttention``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from wavepp.runtime.families.layer_plan import DSAShape
from wavepp.runtime.stage.engine.layers.common import (
    WeightGetter,
    apply_rope_interleaved,
    causal_mask,
)


class DSAIndexer:
    """One full layer's indexer weights and its paged key cache ``[num_slots, head_dim]``."""

    def __init__(self, shape: DSAShape, get: WeightGetter, prefix: str) -> None:
        """Load ``{prefix}wq_b``, ``wk``, ``k_norm`` (weight, bias) and ``weights_proj``.

        Raises:
            ValueError: a tensor is missing or has the wrong shape (from ``get``).
        """
        s = shape
        self.shape = s
        self.wq_b = get(prefix + "wq_b.weight", (s.n_heads * s.head_dim, s.q_lora_rank))
        self.wk = get(prefix + "wk.weight", (s.head_dim, s.hidden_size))
        self.k_norm_w = get(prefix + "k_norm.weight", (s.head_dim,))
        self.k_norm_b = get(prefix + "k_norm.bias", (s.head_dim,))
        self.weights_proj = get(prefix + "weights_proj.weight", (s.n_heads, s.hidden_size))
        self.cache: torch.Tensor | None = None

    def allocate(self, num_slots: int, device: torch.device, dtype: torch.dtype) -> None:
        """Allocate a zeroed key cache of ``num_slots`` token slots (drops the old one)."""
        self.cache = torch.zeros((num_slots, self.shape.head_dim), device=device, dtype=dtype)

    @property
    def cache_bytes(self) -> int:
        """Bytes of the allocated key cache (0 before allocate)."""
        return 0 if self.cache is None else self.cache.numel() * self.cache.element_size()

    def _rope(self, x: torch.Tensor, p) -> torch.Tensor:  # noqa: ANN001
        r = self.shape.rope_dim
        return torch.cat(
            (apply_rope_interleaved(x[..., :r], p.rope_cos, p.rope_sin), x[..., r:]), dim=-1
        )

    def select(
        self,
        x: torch.Tensor,
        q_resid: torch.Tensor,
        p,  # noqa: ANN001
    ) -> tuple[torch.Tensor | None, ...]:
        """Write the new tokens' indexer keys, then per chunk a [x_i, L_i + x_i] bool mask:
        True where the key is causal and among the query's top-k; None (plain causal
        attention, ``attend``'s mask-free paths) where ``index_topk >= L_i + x_i``, as every
        causal key is then selected. Sparse masks are genuine: a chunk past the top-k keeps its
        dense mask."""
        s = self.shape
        assert self.cache is not None, "allocate() runs before forward()"
        num_tokens = x.shape[0]
        q = self._rope(F.linear(q_resid, self.wq_b).view(num_tokens, s.n_heads, s.head_dim), p)
        k = F.layer_norm(F.linear(x, self.wk), (s.head_dim,), self.k_norm_w, self.k_norm_b, 1e-6)
        k = self._rope(k[:, None, :], p)[:, 0]
        self.cache.index_copy_(0, p.slot_mapping, p.written(k))
        weights = F.linear(x, self.weights_proj).float() * s.n_heads**-0.5  # [T, H_I]
        masks: list[torch.Tensor | None] = []
        for chunk, start, key_slots in zip(p.chunks, p.row_starts, p.key_slots, strict=True):
            end = start + chunk.num_tokens
            if s.topk >= chunk.context_offset + chunk.num_tokens:
                masks.append(None)
                continue
            causal = causal_mask(chunk.context_offset, chunk.num_tokens, x.device)
            keys = self.cache[key_slots].float()  # [n, D]
            scores = F.relu(torch.einsum("thd,nd->thn", q[start:end].float(), keys))
            scores = scores * s.head_dim**-0.5
            index = torch.einsum("th,thn->tn", weights[start:end], scores)
            index = index.masked_fill(~causal, float("-inf"))
            chosen = index.topk(s.topk, dim=-1).indices
            selected = torch.zeros_like(causal).scatter_(-1, chosen, True)
            masks.append(causal & selected)
        return tuple(masks)
