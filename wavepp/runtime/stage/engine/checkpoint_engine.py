"""Torch stage engine over a Hugging Face checkpoint: Llama, DeepSeek-V3, MiniMax-M2, GLM-5,
Kimi-Linear.

Each decoder layer is ``h = h + attn(RMSNorm(h)); h = h + ffn(RMSNorm(h))`` with the attention
and feed-forward blocks of its family's layer plan (``wavepp.runtime.families``, ``layers/``). Each attention layer
owns its paged cache (K/V for GQA, the latent for MLA) over the stage's slots
``num_blocks * block_size``; the block tables, slot mapping and masks are the shared
``PreparedBatch`` (``base.py``), so chunking and prefix reuse work as for the Llama engine.

The stage reads only its own tensors from the checkpoint (``checkpoint.py``); ``bytes_read``
says how many bytes that was. With tensor parallelism (``tensor_parallel.py``) each TP rank reads
only its share of the sharded tensors and holds its heads' cache.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from wavepp.runtime.families import LayerPlan, family_of
from wavepp.runtime.hf_config import layer_plan_from_hf, model_config_from_hf, read_hf_config
from wavepp.runtime.model_config import ModelConfig
from wavepp.runtime.stage.engine.base import (
    ChunkSpec,
    PagedStageEngineBase,
    PreparedBatch,
    StageOutput,
)
from wavepp.runtime.stage.engine.checkpoint import CheckpointReader, stage_tensor_names
from wavepp.runtime.stage.engine.layers.common import rms_norm, rope_cos_sin
from wavepp.runtime.stage.engine.layers.dsa import DSAIndexer
from wavepp.runtime.stage.engine.layers.gqa import GQAAttention
from wavepp.runtime.stage.engine.layers.kda import KDAAttention
from wavepp.runtime.stage.engine.layers.mla import MLAAttention
from wavepp.runtime.stage.engine.layers.moe import DenseMLP, SparseMoE
from wavepp.runtime.stage.engine.tensor_parallel import SINGLE, TPGroup
from wavepp.runtime.stage.engine.torch_common import causal_masks, last_stage_output, stage_input
from wavepp.runtime.stage.engine.torch_engine import TorchPreparedBatch, torch_dtype

__all__ = ["CheckpointStageEngine"]


class _Layer:
    """One decoder layer: norms, attention block, feed-forward block."""

    def __init__(
        self,
        plan: LayerPlan,
        index: int,
        get,  # noqa: ANN001
        interval: int,
        tp: TPGroup,
    ) -> None:
        p = f"model.layers.{index}."
        d = plan.hidden_size
        self.input_norm = get(p + "input_layernorm.weight", (d,))
        self.post_norm = get(p + "post_attention_layernorm.weight", (d,))
        self.attn: GQAAttention | MLAAttention | KDAAttention
        if plan.is_linear(index):
            assert plan.kda is not None and tp.size == 1, "checked by the engine"
            self.attn = KDAAttention(plan.kda, get, p + "self_attn.", interval)
        elif plan.mla is not None:
            self.attn = MLAAttention(plan.mla, get, p + "self_attn.", tp)
        else:
            assert plan.gqa is not None
            self.attn = GQAAttention(plan.gqa, get, p + "self_attn.", tp)
        self.indexer: DSAIndexer | None = None
        if plan.dsa is not None and plan.indexer_full[index]:
            self.indexer = DSAIndexer(plan.dsa, get, p + "self_attn.indexer.")
        self.uses_dsa = plan.dsa is not None
        if plan.is_moe(index):
            assert plan.moe is not None
            self.ffn: SparseMoE | DenseMLP = SparseMoE(plan.moe, get, p, tp)
        else:
            self.ffn = DenseMLP(d, plan.dense_intermediate, get, p + plan.mlp_prefix, tp)
        self.eps = plan.eps

    def forward(
        self, h: torch.Tensor, batch: TorchPreparedBatch, shared: dict[str, object]
    ) -> torch.Tensor:
        """One layer; ``shared`` carries the DSA selection from a full layer to the shared
        layers after it (within this stage and micro-batch)."""
        x = rms_norm(h, self.input_norm, self.eps)
        if self.uses_dsa:
            assert isinstance(self.attn, MLAAttention)
            q, q_resid = self.attn.queries(x, batch)
            self.attn.write_latents(x, batch)
            if self.indexer is not None:
                assert q_resid is not None
                shared["dsa_masks"] = self.indexer.select(x, q_resid, batch)
            h = h + self.attn.attend_chunks(q, batch, shared["dsa_masks"])
        else:
            h = h + self.attn.forward(x, batch)
        return h + self.ffn.forward(rms_norm(h, self.post_norm, self.eps))

    def allocate(self, num_slots: int, device: torch.device, dtype: torch.dtype) -> None:
        self.attn.allocate(num_slots, device, dtype)
        if self.indexer is not None:
            self.indexer.allocate(num_slots, device, dtype)

    @property
    def cache_bytes(self) -> int:
        return self.attn.cache_bytes + (self.indexer.cache_bytes if self.indexer else 0)


class CheckpointStageEngine(PagedStageEngineBase):
    """Decoder layers ``[first_layer, last_layer)`` of a checkpoint over a paged cache."""

    def __init__(
        self,
        *,
        model: ModelConfig,
        first_layer: int,
        last_layer: int,
        num_layers_total: int,
        model_dir: str | os.PathLike[str],
        device: torch.device | str = "cpu",
        state_interval_blocks: int = 1,
        tp: TPGroup = SINGLE,
    ) -> None:
        """Read ``model_dir/config.json`` and this stage's tensors (this TP rank's share).

        Args:
            model: the generic config (``hf_config.load_model_dir(model_dir)``, maybe with
                another dtype); every field but its name, dtype and seed must match config.json.
            first_layer, last_layer, num_layers_total: this stage's layer range.
            model_dir: the checkpoint directory.
            device: "cpu" (float32 only) or a CUDA device.
            state_interval_blocks: linear-attention (KDA) layers keep their recurrent state
                after every k-th block of a request (``RuntimeConfig.state_interval_blocks``).
            tp: this process's place in the stage's tensor-parallel group (``SINGLE``: none).

        Raises:
            ValueError: config.json disagrees with ``model``, an unsupported family, a dtype
                other than float32 on CPU, a missing / misshapen tensor (named), or a family
                or width tensor parallelism cannot split (names the family or field).
        """
        super().__init__(
            first_layer=first_layer,
            last_layer=last_layer,
            num_layers_total=num_layers_total,
            device=device,
        )
        cfg = read_hf_config(model_dir)
        derived = model_config_from_hf(cfg, name=model.name)
        # NOTE: every shape and numeric field, not only the layer count and widths: a
        # directory edited after the admission derived its config (or between two stages'
        # restarts) would otherwise leave stages computing with different rope_theta / eps /
        # heads. The name, dtype and seed are the runtime's own.
        for field in sorted(set(ModelConfig.model_fields) - {"name", "dtype", "seed"}):
            if getattr(derived, field) != getattr(model, field):
                raise ValueError(
                    f"model.{field}={getattr(model, field)!r} differs from model_dir's "
                    f"config.json ({getattr(derived, field)!r}); derive the model from it"
                )
        if state_interval_blocks < 1:
            raise ValueError(f"state_interval_blocks={state_interval_blocks} must be >= 1")
        if model.num_layers != num_layers_total:
            raise ValueError(
                f"num_layers_total={num_layers_total} differs from model.num_layers="
                f"{model.num_layers}"
            )
        dtype = torch_dtype(model.dtype)
        if self.device.type == "cpu" and dtype != torch.float32:
            raise ValueError(f"model.dtype={model.dtype!r} on device 'cpu'; use float32 on CPU")
        self.model = model
        self.plan = layer_plan_from_hf(cfg)
        self.plan.check_stage_start(first_layer)
        family = family_of(self.plan.model_type)
        if tp.size > 1 and not family.tensor_parallel:
            raise ValueError(
                f"tensor_parallel_size={tp.size} (--tensor-parallel-size / "
                f"spec.tensorParallelSize): family {family.model_type!r} ({family.summary}) "
                "is not sharded; use 1"
            )
        self.tp = tp
        self.hidden_size = model.hidden_size
        self.activation_dtype = dtype
        self.reader = CheckpointReader(model_dir)
        names = stage_tensor_names(
            self.reader.weight_map,
            first_layer,
            last_layer,
            model.num_layers,
            tie_word_embeddings=self.plan.tie_word_embeddings,
        )
        wanted = set(names)
        used: set[str] = set()

        def get(name: str, shape: tuple[int, ...], dim: int | None = None) -> torch.Tensor:
            if name not in wanted:
                raise ValueError(f"model_dir={str(model_dir)!r} lacks tensor {name}")
            part = None if dim is None or tp.size == 1 else tp.shard(shape[dim], name)
            t, full = self.reader.read_part(name, dim, part)
            if full != shape:
                raise ValueError(f"tensor {name} has shape {full}; config.json implies {shape}")
            used.add(name)
            return t.to(device=self.device, dtype=dtype).contiguous()

        a = self.plan
        # NOTE: only the TP leader returns logits: followers read no final norm and no lm_head.
        has_head = self.is_last and tp.is_leader
        self._embed = (
            get("model.embed_tokens.weight", (a.vocab_size, a.hidden_size))
            if self.is_first or (has_head and a.tie_word_embeddings)
            else None
        )
        self._layers = [
            _Layer(a, i, get, state_interval_blocks, tp) for i in range(first_layer, last_layer)
        ]
        self._final_norm = get("model.norm.weight", (a.hidden_size,)) if has_head else None
        self._lm_head = None
        if has_head:
            self._lm_head = (
                self._embed
                if a.tie_word_embeddings
                else get("lm_head.weight", (a.vocab_size, a.hidden_size))
            )
        self.reader.close()
        unused = sorted(set(names) - used)
        if not has_head:
            unused = [n for n in unused if n not in ("model.norm.weight", "lm_head.weight")]
            if self.is_last and a.tie_word_embeddings and not self.is_first:
                unused = [n for n in unused if n != "model.embed_tokens.weight"]
        if unused:
            raise ValueError(
                f"model_dir={str(model_dir)!r} has {len(unused)} tensors in layers "
                f"[{first_layer}, {last_layer}) this engine does not use, e.g. {unused[:3]}"
            )

    @property
    def bytes_read(self) -> int:
        """Tensor bytes this stage read from the checkpoint."""
        return self.reader.bytes_read

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        """Allocate every local layer's zeroed cache of num_blocks * block_size slots.

        Bytes per token and layer: GQA 2 * kv_heads * head_dim * elem; MLA (kv_lora_rank +
        qk_rope_head_dim) * elem, plus index_head_dim * elem in a DSA full layer.

        Raises:
            ValueError: num_blocks or block_size < 1.
        """
        super().allocate_kv(num_blocks, block_size)
        for layer in self._layers:
            layer.allocate(num_blocks * block_size, self.device, self.activation_dtype)

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the allocated caches (0 before allocate_kv)."""
        return sum(layer.cache_bytes for layer in self._layers)

    def prepare(self, chunks: Sequence[ChunkSpec]) -> TorchPreparedBatch:
        """Block tables, slots, positions, RoPE tables ([T, rotary_dim]) and causal masks.

        Raises:
            ValueError: a chunk field is invalid (see ``build_prepared_batch``).
            RuntimeError: allocate_kv has not run.
        """
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
            attn_masks=causal_masks(base.chunks, self.device),
        )

    @torch.inference_mode()
    def execute(self, prepared: PreparedBatch, hidden_in: torch.Tensor | None) -> StageOutput:
        """Run this stage's layers (see ``TorchStageEngine.execute`` for the contract)."""
        self._check_execute_args(prepared, hidden_in)
        if not isinstance(prepared, TorchPreparedBatch):
            raise ValueError("prepared is not a TorchPreparedBatch; use this engine's prepare()")
        h = stage_input(
            prepared,
            hidden_in,
            self._embed,
            is_first=self.is_first,
            device=self.device,
            dtype=self.activation_dtype,
        )
        shared: dict[str, object] = {}
        for layer in self._layers:
            h = layer.forward(h, prepared, shared)
        if not self.is_last:
            return StageOutput(hidden=h)
        return last_stage_output(
            h,
            prepared,
            self.tp,
            self._final_norm,
            self._lm_head,
            eps=self.plan.eps,
            device=self.device,
        )
