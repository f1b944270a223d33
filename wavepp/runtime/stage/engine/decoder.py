"""The torch engines' decoder stack: a :class:`LayerPlan`'s layers over paged caches.

Each decoder layer is ``h = h + attn(RMSNorm(h)); h = h + ffn(RMSNorm(h))`` with the attention
and feed-forward blocks its plan names (``wavepp.runtime.families.layer_plan``; one module per
layer kind in ``layers/``). Each attention layer owns its paged cache (K/V for GQA, the latent
for MLA) over the stage's slots ``num_blocks * block_size``; the block tables, slot mapping and
RoPE tables are the shared ``PreparedBatch`` (``base.py``). The first stage embeds token ids; the last
applies the final RMSNorm and ``lm_head`` to the last token of each ``is_last`` chunk only.

:class:`DecoderStageEngine` is the one forward of every family; its subclasses only say where
the weights come from: ``CheckpointStageEngine`` (a Hugging Face checkpoint directory) and
``TorchStageEngine`` (seeded or given Llama weights of a ``ModelConfig``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from wavepp.runtime.families import LayerPlan
from wavepp.runtime.kv import Transfer
from wavepp.runtime.model_config import ModelConfig
from wavepp.runtime.stage.engine.base import (
    ChunkSpec,
    PagedStageEngineBase,
    PreparedBatch,
    StageOutput,
)
from wavepp.runtime.stage.engine.host_copy import BlockStates, HostCopies, block_rows
from wavepp.runtime.stage.engine.layers.common import (
    WeightGetter,
    rms_norm,
    rope_cos_sin,
)
from wavepp.runtime.stage.engine.layers.dsa import DSAIndexer
from wavepp.runtime.stage.engine.layers.gqa import GQAAttention
from wavepp.runtime.stage.engine.layers.kda import KDAAttention
from wavepp.runtime.stage.engine.layers.mla import MLAAttention
from wavepp.runtime.stage.engine.layers.moe import DenseMLP, SparseMoE
from wavepp.runtime.stage.engine.profile import region
from wavepp.runtime.stage.engine.tensor_parallel import SINGLE, TPGroup

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def torch_dtype(name: str) -> torch.dtype:
    """Map a ModelConfig dtype name to a torch dtype."""
    return _DTYPES[name]


@dataclass(frozen=True, eq=False)
class TorchPreparedBatch(PreparedBatch):
    """:class:`PreparedBatch` plus the torch engines' per-batch tensors.

    Attributes:
        rope_cos, rope_sin: [T, rotary_dim] RoPE tables at ``positions`` (activation dtype).
    """

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor


class _Layer:
    """One decoder layer: norms, attention block, feed-forward block."""

    def __init__(
        self,
        plan: LayerPlan,
        index: int,
        get: WeightGetter,
        interval: int,
        tp: TPGroup,
        compile_dense: bool = False,
        pack: bool = True,
    ) -> None:
        p = f"model.layers.{index}."
        # torch.compile takes a dense layer's feed-forward half and GQA's input projections;
        # inductor takes their weights plain (it plans its own layout), the rest stay packed
        compiled = compile_dense and not plan.is_moe(index)
        d = plan.hidden_size
        self.input_norm = get(p + "input_layernorm.weight", (d,))
        self.post_norm = get(p + "post_attention_layernorm.weight", (d,))
        self.attn: GQAAttention | MLAAttention | KDAAttention
        if plan.is_linear(index):
            assert plan.kda is not None and tp.size == 1, "checked by the engine"
            self.attn = KDAAttention(plan.kda, get, p + "self_attn.", interval)
        elif plan.mla is not None:
            self.attn = MLAAttention(plan.mla, get, p + "self_attn.", tp, pack=pack)
        else:
            assert plan.gqa is not None
            self.attn = GQAAttention(
                plan.gqa, get, p + "self_attn.", tp, pack=pack, pack_qkv=pack and not compiled
            )
        self.indexer: DSAIndexer | None = None
        if plan.dsa is not None and plan.indexer_full[index]:
            self.indexer = DSAIndexer(plan.dsa, get, p + "self_attn.indexer.")
        self.uses_dsa = plan.dsa is not None
        if plan.is_moe(index):
            assert plan.moe is not None
            self.ffn: SparseMoE | DenseMLP = SparseMoE(plan.moe, get, p, tp, pack=pack)
        else:
            self.ffn = DenseMLP(
                d, plan.dense_intermediate, get, p + plan.mlp_prefix, tp, pack=pack and not compiled
            )
        self.eps = plan.eps
        self._ffn_part = "moe" if isinstance(self.ffn, SparseMoE) else "mlp"
        self._dense_block = None
        if compiled:
            assert isinstance(self.ffn, DenseMLP)
            self._dense_block = torch.compile(self._dense_eager, dynamic=True)
            if isinstance(self.attn, GQAAttention):
                self.attn.project = torch.compile(self.attn.project, dynamic=True)

    def _dense_eager(self, h: torch.Tensor) -> torch.Tensor:
        """``h + mlp(RMSNorm(h))``: the dense feed-forward half of the layer."""
        assert isinstance(self.ffn, DenseMLP)
        return h + self.ffn.forward(rms_norm(h, self.post_norm, self.eps))

    def forward(
        self, h: torch.Tensor, batch: TorchPreparedBatch, shared: dict[str, object]
    ) -> torch.Tensor:
        """One layer; ``shared`` carries the DSA selection from a full layer to the shared
        layers after it (within this stage and micro-batch)."""
        with region("norm"):
            x = rms_norm(h, self.input_norm, self.eps)
        if self.uses_dsa:
            assert isinstance(self.attn, MLAAttention)
            q, q_resid = self.attn.queries(x, batch)
            latent = self.attn.write_latents(x, batch)
            if self.indexer is not None:
                assert q_resid is not None
                with region("attention"):
                    shared["dsa_masks"] = self.indexer.select(x, q_resid, batch)
            h = h + self.attn.attend_chunks(q, batch, shared["dsa_masks"], latent)
        elif isinstance(self.attn, KDAAttention):
            with region("linear_attn"):
                h = h + self.attn.forward(x, batch)
        else:
            h = h + self.attn.forward(x, batch)
        if self._dense_block is not None:
            with region("mlp"):  # the compiled block: the norm, the MLP, the residual
                return self._dense_block(h)
        with region("norm"):
            x = rms_norm(h, self.post_norm, self.eps)
        with region(self._ffn_part):
            return h + self.ffn.forward(x)

    def allocate(self, num_slots: int, device: torch.device, dtype: torch.dtype) -> None:
        self.attn.allocate(num_slots, device, dtype)
        if self.indexer is not None:
            self.indexer.allocate(num_slots, device, dtype)

    @property
    def cache_bytes(self) -> int:
        return self.attn.cache_bytes + (self.indexer.cache_bytes if self.indexer else 0)

    def paged_caches(self) -> list[tuple[torch.Tensor, int]]:
        """(cache, its token-slot dimension) of every paged cache the layer keeps: GQA's
        [2, slots, kv_heads, head_dim] (1), MLA's latent [slots, latent_dim] (0), a DSA
        indexer's keys [slots, head_dim] (0); KDA keeps none (its states are per block)."""
        caches: list[tuple[torch.Tensor, int]] = []
        if isinstance(self.attn, GQAAttention):
            assert self.attn.cache is not None, "allocate() runs first"
            caches.append((self.attn.cache, 1))
        elif isinstance(self.attn, MLAAttention):
            assert self.attn.cache is not None, "allocate() runs first"
            caches.append((self.attn.cache, 0))
        if self.indexer is not None:
            assert self.indexer.cache is not None, "allocate() runs first"
            caches.append((self.indexer.cache, 0))
        return caches


class DecoderStageEngine(PagedStageEngineBase):
    """Decoder layers ``[first_layer, last_layer)`` of a :class:`LayerPlan` over paged caches.

    Subclasses run ``PagedStageEngineBase.__init__``, set ``model`` (the generic shape), then
    call :meth:`_build` with the plan and their weight getter.
    """

    model: ModelConfig
    plan: LayerPlan
    tp: TPGroup

    def _build(
        self,
        plan: LayerPlan,
        get: WeightGetter,
        *,
        dtype: torch.dtype,
        tp: TPGroup = SINGLE,
        state_interval_blocks: int = 1,
        compile: bool = False,
        pack: bool = True,
    ) -> None:
        """Load this stage's weights through ``get`` (this TP rank's share) and build its
        layers; only the TP leader of the last stage reads the final norm and ``lm_head``.

        With ``pack``, the attention and dense feed-forward projections hold their weights as
        ``layers.linear.PackedLinear`` packs them (oneDNN's layout on a CPU; plain
        ``F.linear`` elsewhere), but for the parts ``compile`` compiles; MoE's routed experts,
        the router and ``lm_head`` stay plain.

        With ``compile``, ``torch.compile`` (dynamic token count) takes each layer's
        per-token dense parts: the dense feed-forward half (post-attention norm, SwiGLU,
        residual) and GQA's input projections with q/k norms and RoPE; attention over the
        paged cache, MoE and linear attention stay eager. Compiled code is built on a part's
        first call.

        Raises:
            ValueError: a weight missing or misshapen (from ``get``), a width the TP size
                does not divide (names it), or ``compile`` with tensor parallelism.
        """
        if compile and tp.size > 1:
            raise ValueError(
                f"compile=True (RuntimeConfig.torch_compile, engineOptions.torchCompile) with "
                f"tensor_parallel_size={tp.size}: compiled layers do not all-reduce; use one"
            )
        self.plan = plan
        self.tp = tp
        self.hidden_size = plan.hidden_size
        self.activation_dtype = dtype
        has_head = self.is_last and tp.is_leader  # followers return no logits
        self._embed = (
            get("model.embed_tokens.weight", (plan.vocab_size, plan.hidden_size))
            if self.is_first or (has_head and plan.tie_word_embeddings)
            else None
        )
        self._layers = [
            _Layer(plan, i, get, state_interval_blocks, tp, compile, pack)
            for i in range(self.first_layer, self.last_layer)
        ]
        self._final_norm = get("model.norm.weight", (plan.hidden_size,)) if has_head else None
        self._lm_head = None
        if has_head:
            self._lm_head = (
                self._embed
                if plan.tie_word_embeddings
                else get("lm_head.weight", (plan.vocab_size, plan.hidden_size))
            )

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        """Allocate every local layer's zeroed cache of num_blocks * block_size slots.

        Bytes per token and layer: GQA 2 * kv_heads * head_dim * elem; MLA (kv_lora_rank +
        qk_rope_head_dim) * elem, plus index_head_dim * elem in a DSA full layer.

        Raises:
            ValueError: num_blocks or block_size < 1.
        """
        super().allocate_kv(num_blocks, block_size)
        self.host_copies = None
        for layer in self._layers:
            layer.allocate(num_blocks * block_size, self.device, self.activation_dtype)

    host_copies: HostCopies | None = None
    """The host tier's buffers and copies (``allocate_host_kv``); None without one."""

    def allocate_host_kv(self, num_slots: int) -> None:
        """Host buffers of ``num_slots`` blocks for every local layer's paged caches (pinned on
        CUDA) and host slots for Kimi-Linear's per-block states; 0: no host tier. Bytes:
        num_slots x the device bytes of one block over the stage's layers.

        Raises:
            ValueError: ``num_slots`` < 0.
            RuntimeError: ``allocate_kv`` has not run.
        """
        self._set_host_slots(num_slots)
        self.host_copies = None
        if not num_slots:
            return
        caches = [
            block_rows(cache, dim, self.block_size)
            for layer in self._layers
            for cache, dim in layer.paged_caches()
        ]
        states: list[BlockStates] = [
            layer.attn.states for layer in self._layers if isinstance(layer.attn, KDAAttention)
        ]
        self.host_copies = HostCopies(caches, states, num_slots, self.device)

    def apply_transfers(self, transfers: Sequence[Transfer]) -> None:
        """Copy each block between its device block and host slot over every local layer,
        in log order (``host_copy.HostCopies``: at once on CPU; on CUDA queued on a side
        stream that ``execute`` waits for).

        Raises:
            ValueError: a block id or slot out of range (named), or transfers without a host
                tier.
        """
        if not transfers:
            return
        if self.host_copies is None:
            raise ValueError(
                f"transfers: {len(transfers)} host-tier copies, but this stage has no host "
                "tier (num_host_kv_blocks=0)"
            )
        self._check_transfers(transfers)
        self.host_copies.apply(transfers)

    def drop_requests(self, request_ids: Sequence[str]) -> None:
        """Drop the KDA layers' running states of ``request_ids`` (``KDAAttention.drop``);
        the other layers keep no per-request state."""
        for layer in self._layers:
            if isinstance(layer.attn, KDAAttention):
                layer.attn.drop(request_ids)

    def handoff_caches(self) -> list[torch.Tensor]:
        """Each local layer's paged cache as a KV handoff reads it, [parts, num_slots, heads,
        dim], layer order (views: what the layers read and write): grouped-query attention's
        K/V [2, num_slots, num_kv_heads / T, head_dim]; MLA's latent [1, num_slots, 1,
        kv_lora_rank + qk_rope_head_dim] (the normed latent, then the roped key: one "head",
        as vLLM's MLA cache holds it).

        Raises:
            ValueError: a layer keeps no such cache (linear attention's states), keeps a
                cache the handoff does not carry (a DSA indexer's keys), or is not allocated.
        """
        caches: list[torch.Tensor] = []
        for index, layer in enumerate(self._layers, start=self.first_layer):
            attn = layer.attn
            if not isinstance(attn, GQAAttention | MLAAttention) or attn.cache is None:
                raise ValueError(
                    f"layer {index}: {type(attn).__name__} keeps no allocated K/V or MLA "
                    "latent cache; a KV handoff serves grouped-query and MLA attention layers"
                )
            if layer.indexer is not None:
                raise ValueError(
                    f"layer {index}: a DSA indexer's key cache is not handed over; a KV "
                    "handoff serves grouped-query and MLA attention layers without one"
                )
            cache = attn.cache
            caches.append(cache if isinstance(attn, GQAAttention) else cache[None, :, None, :])
        return caches

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the allocated caches (0 before allocate_kv)."""
        return sum(layer.cache_bytes for layer in self._layers)

    def prepare(self, chunks: Sequence[ChunkSpec]) -> TorchPreparedBatch:
        """Block tables, slots, positions and RoPE tables ([T, rotary_dim]).

        Raises:
            ValueError: a chunk field is invalid (see ``build_prepared_batch``).
            RuntimeError: allocate_kv has not run.
        """
        with region("prepare"):
            return self._prepare(chunks)

    def _prepare(self, chunks: Sequence[ChunkSpec]) -> TorchPreparedBatch:
        base = self._prepare_common(
            chunks, vocab_size=self.model.vocab_size, max_position=self.model.max_position
        )
        cos, sin = rope_cos_sin(
            base.positions, self.plan.rotary_dim, self.plan.rope_theta, self.activation_dtype
        )
        return TorchPreparedBatch(
            **base.base_fields(),
            rope_cos=cos,
            rope_sin=sin,
        )

    @torch.inference_mode()
    def execute(self, prepared: PreparedBatch, hidden_in: torch.Tensor | None) -> StageOutput:
        """Run this stage's layers on a prepared micro-batch.

        Args:
            prepared: from this engine's :meth:`prepare` (same KV allocation).
            hidden_in: [num_tokens, hidden_size] from the previous stage; None on stage 0.

        Returns:
            :class:`StageOutput`: ``hidden`` [num_tokens, hidden_size] (None on the last
            stage) and, on the last stage's TP leader, float32 [vocab_size] logits per
            ``is_last`` chunk.

        Raises:
            ValueError: prepared by another engine or for another allocation, or hidden_in of
                the wrong shape / presence.
        """
        self._check_execute_args(prepared, hidden_in)
        if not isinstance(prepared, TorchPreparedBatch):
            raise ValueError("prepared is not a TorchPreparedBatch; use this engine's prepare()")
        if self.host_copies is not None:
            self.host_copies.wait()  # the loads issued before this micro-batch
        if self.is_first:
            assert self._embed is not None and prepared.token_ids is not None
            with region("embed"):
                h = F.embedding(prepared.token_ids, self._embed)
        else:
            assert hidden_in is not None
            h = hidden_in.to(device=self.device, dtype=self.activation_dtype)
        shared: dict[str, object] = {}
        for layer in self._layers:
            h = layer.forward(h, prepared, shared)
        if not self.is_last:
            return StageOutput(hidden=h)
        if not self.tp.is_leader or not prepared.logits_rows:
            return StageOutput(hidden=None)  # a follower: the leader computes the logits
        assert self._final_norm is not None and self._lm_head is not None
        with region("head"):
            rows = torch.tensor([r for _, r in prepared.logits_rows], device=self.device)
            logits = F.linear(rms_norm(h[rows], self._final_norm, self.plan.eps), self._lm_head)
            logits = logits.to(torch.float32)
        return StageOutput(
            hidden=None,
            last_token_logits={rid: logits[i] for i, (rid, _) in enumerate(prepared.logits_rows)},
        )
