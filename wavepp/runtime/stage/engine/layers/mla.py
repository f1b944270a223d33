"""Multi-head latent attention (MLA) over a paged *latent* cache: DeepSeek-V3, GLM-5.

Per layer, for ``x`` = the input-normed activations [T, hidden]::

    q = x Wq^T                          or, with q_lora_rank:  q = RMSNorm(x Wqa^T) Wqb^T
    q -> [T, H, d_nope + d_rope];  q_nope, q_rot = split
    c, k_rot = split(x Wkva^T, [kv_lora_rank, d_rope]);  c = RMSNorm(c)
    q_rot, k_rot = RoPE(q_rot, k_rot)   (interleaved pairs, kept in pair order; or rotate-half)
    cache[slot_mapping] = [c | k_rot]   the latent, (kv_lora_rank + d_rope) values per token
    per chunk: its context's latents (a chunk without cached context: its own new ones), expand:
               [k_nope | v] = c Wkvb^T per head, k = [k_nope | k_rot (shared by all heads)],
               o = softmax(q k^T * scale + mask) v
    out = o Wo^T

The cache holds the compressed latent, not expanded K/V: (kv_lora_rank + d_rope) values per
token and layer against 2 * H * d_head for MHA. A cached row is what vLLM's MLA cache holds
for the same checkpoint: the normed latent, then the roped key in the checkpoint's dimension
order (interleaved RoPE keeps its pairs in place, as vLLM's ``is_neox_style=False`` rotary does;
transformers de-interleaves q and k alike, which leaves every q.k unchanged), so a KV handoff
copies rows as they are. Expansion happens per chunk over its context
(the "MHA mode" of vLLM's MLA prefill; the absorbed "MQA mode" is not implemented).
Tensor parallelism (T ranks): each rank holds ``H/T`` heads (rows of q_b / q_proj and kv_b,
columns of o) and all-reduces o's partial sums; the low-rank q_a / kv_a projections and the
latent cache are replicated (the latent is per token, not per head: each rank expands its own
heads from a full copy), as vLLM / SGLang shard MLA.
Sources: DeepSeek-V2 paper sec. 2.1; HF ``modeling_deepseek_v3.DeepseekV3Attention`` and
``modeling_glm_moe_dsa.GlmMoeDsaAttention``.
"""

from __future__ import annotations

import torch

from wavepp.runtime.families.layer_plan import MLAShape
from wavepp.runtime.stage.engine.layers.common import (
    WeightGetter,
    apply_rope_pairs,
    apply_rope_rotate_half,
    attend,
    rms_norm,
)
from wavepp.runtime.stage.engine.layers.linear import PackedLinear
from wavepp.runtime.stage.engine.profile import region
from wavepp.runtime.stage.engine.tensor_parallel import SINGLE, TPGroup


def _no_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    del cos, sin
    return x


class MLAAttention:
    """One layer's MLA weights and its paged latent cache ``[num_slots, latent_dim]``."""

    def __init__(
        self,
        shape: MLAShape,
        get: WeightGetter,
        prefix: str,
        tp: TPGroup = SINGLE,
        *,
        pack: bool = True,
    ) -> None:
        """Load ``{prefix}q_a_proj / q_a_layernorm / q_b_proj`` (or ``q_proj``),
        ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj`` and ``o_proj`` weights
        (the per-head ones for this TP rank's heads only). ``pack``: the projections may take
        ``PackedLinear``'s packed CPU path.

        Raises:
            ValueError: a tensor is missing or has the wrong shape (from ``get``), or the
                heads do not divide by the TP size.
        """
        s = shape
        self.shape = s
        self.tp = tp
        tp.shard(s.num_heads, "num_attention_heads")
        self.heads = s.num_heads // tp.size
        hq = s.num_heads * s.qk_head_dim
        self.q_a: PackedLinear | None
        if s.q_lora_rank is None:
            self.q_a = self.q_a_norm = None
            self.q_b = PackedLinear(
                get(prefix + "q_proj.weight", (hq, s.hidden_size), 0), pack=pack
            )
        else:
            self.q_a = PackedLinear(
                get(prefix + "q_a_proj.weight", (s.q_lora_rank, s.hidden_size)), pack=pack
            )
            self.q_a_norm = get(prefix + "q_a_layernorm.weight", (s.q_lora_rank,))
            self.q_b = PackedLinear(
                get(prefix + "q_b_proj.weight", (hq, s.q_lora_rank), 0), pack=pack
            )
        self.kv_a = PackedLinear(
            get(prefix + "kv_a_proj_with_mqa.weight", (s.latent_dim, s.hidden_size)), pack=pack
        )
        self.kv_a_norm = get(prefix + "kv_a_layernorm.weight", (s.kv_lora_rank,))
        self.kv_b = PackedLinear(
            get(
                prefix + "kv_b_proj.weight",
                (s.num_heads * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank),
                0,
            ),
            pack=pack,
        )
        self.o = PackedLinear(
            get(prefix + "o_proj.weight", (s.hidden_size, s.num_heads * s.v_head_dim), 1),
            pack=pack,
        )
        self.cache: torch.Tensor | None = None
        self._rope = apply_rope_pairs if s.rope_interleave else apply_rope_rotate_half
        if not s.use_rope:
            self._rope = _no_rope

    def allocate(self, num_slots: int, device: torch.device, dtype: torch.dtype) -> None:
        """Allocate a zeroed latent cache of ``num_slots`` token slots (drops the old one)."""
        self.cache = torch.zeros((num_slots, self.shape.latent_dim), device=device, dtype=dtype)

    def queries(self, x: torch.Tensor, p) -> tuple[torch.Tensor, torch.Tensor | None]:  # noqa: ANN001
        """[T, H/T, qk_head_dim] roped queries, and the normed q latent (None without q_lora)."""
        with region("qkv"):
            return self._queries(x, p)

    def _queries(self, x: torch.Tensor, p) -> tuple[torch.Tensor, torch.Tensor | None]:  # noqa: ANN001
        s = self.shape
        if self.q_a is None:
            q_resid = None
            q = self.q_b(x)
        else:
            q_resid = rms_norm(self.q_a(x), self.q_a_norm, s.eps)
            q = self.q_b(q_resid)
        q = q.view(x.shape[0], self.heads, s.qk_head_dim)
        q_nope, q_rot = q.split([s.qk_nope_head_dim, s.qk_rope_head_dim], dim=-1)
        q_rot = self._rope(q_rot, p.rope_cos, p.rope_sin)
        return torch.cat((q_nope, q_rot), dim=-1), q_resid

    def write_latents(self, x: torch.Tensor, p) -> torch.Tensor:  # noqa: ANN001
        """Compute the new tokens' latents ``[RMSNorm(c) | RoPE(k_rot)]`` [T, latent_dim],
        write them, and return them."""
        s = self.shape
        assert self.cache is not None, "allocate() runs before forward()"
        with region("qkv"):
            c, k_rot = self.kv_a(x).split([s.kv_lora_rank, s.qk_rope_head_dim], dim=-1)
            c = rms_norm(c, self.kv_a_norm, s.eps)
            k_rot = self._rope(k_rot[:, None, :], p.rope_cos, p.rope_sin)[:, 0]
            latent = torch.cat((c, k_rot), dim=-1)
        with region("kv_write"):
            self.cache.index_copy_(0, p.slot_mapping, p.written(latent))
        return latent

    def expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys [n, H/T, qk_head_dim] and values [n, H/T, v_head_dim] of latents
        [n, latent_dim]."""
        s = self.shape
        c, k_rot = latent.split([s.kv_lora_rank, s.qk_rope_head_dim], dim=-1)
        kv = self.kv_b(c).view(-1, self.heads, s.qk_nope_head_dim + s.v_head_dim)
        k_nope, v = kv.split([s.qk_nope_head_dim, s.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_rot[:, None, :].expand(-1, self.heads, -1)), dim=-1)
        return k, v

    def forward(self, x: torch.Tensor, p, masks=None) -> torch.Tensor:  # noqa: ANN001
        """[T, hidden] normed activations -> [T, hidden] attention output (before residual).

        Args:
            x: activations after ``input_layernorm``.
            p: the prepared batch (``TorchPreparedBatch``).
            masks: per chunk a [x_i, L_i + x_i] bool mask (the DSA top-k selection) or None
                (causal); None: causal for every chunk.
        """
        q, _ = self.queries(x, p)
        latent = self.write_latents(x, p)
        return self.attend_chunks(q, p, masks, latent)

    def attend_chunks(self, q: torch.Tensor, p, masks, latent: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        """Attention of every chunk over its expanded context, then ``o_proj``: a chunk with
        no cached context expands its own rows of ``latent`` (the new tokens' [T,
        latent_dim], as ``write_latents`` returns), any other gathers its context's latents
        from the cache. ``masks``: per chunk a mask for ``attend`` or None (causal, through
        ``attend``'s mask-free paths); None: causal for every chunk."""
        s = self.shape
        assert self.cache is not None
        num_tokens = q.shape[0]
        out = q.new_empty((num_tokens, self.heads, s.v_head_dim))
        scale = s.qk_head_dim**-0.5
        if masks is None:
            masks = (None,) * len(p.chunks)
        for chunk, start, key_slots, mask in zip(
            p.chunks, p.row_starts, p.key_slots, masks, strict=True
        ):
            end = start + chunk.num_tokens
            with region("kv_gather"):
                own = chunk.context_offset == 0
                k, v = self.expand(latent[start:end] if own else self.cache[key_slots])
            with region("attention"):
                out[start:end] = attend(q[start:end], k, v, mask, scale)
        with region("attn_out"):
            return self.tp.all_reduce(self.o(out.reshape(num_tokens, -1)))

    @property
    def cache_bytes(self) -> int:
        """Bytes of the allocated latent cache (0 before allocate)."""
        return 0 if self.cache is None else self.cache.numel() * self.cache.element_size()
