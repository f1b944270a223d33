"""Torch stage engine: real Llama-style decoder layers over a paged KV cache.

Per layer (Hugging Face ``LlamaDecoderLayer`` semantics, no biases)::

    r = h;  x = RMSNorm(h)
    q, k, v = x Wq^T, x Wk^T, x Wv^T             [T, heads|kv_heads, head_dim]
    q, k = RoPE(q, pos), RoPE(k, pos)              rotate_half form, inv_freq = theta^(-2i/d)
    cache[slot_mapping] = k, v                     write the new tokens' KV first
    per chunk: o = softmax(q K^T / sqrt(d) + causal mask) V over keys [0, L + x)
    h = r + o Wo^T
    h = h + down(silu(gate(RMSNorm(h))) * up(RMSNorm(h)))

The first stage embeds token ids; the last applies the final RMSNorm and ``lm_head`` to the last
token of each ``is_last`` chunk only. Sources: Touvron et al., "LLaMA" (2023) sec. 2.2; RoPE from
Su et al., "RoFormer" (2021) eq. 34 in the rotate_half layout of HF ``modeling_llama``.

Weights are random and seeded per tensor group, independent of the pipeline partition: layer i
always gets the same values whichever stage holds it (see :func:`build_layer_state_dict`).

Tensor parallelism (``tensor_parallel.py``): each TP rank keeps its share of the heads (rows of
q/k/v, columns of o), of the MLP's intermediate rows (gate/up) and columns (down), and its K/V
heads' cache; o and down are all-reduced. The full tensors are generated or read, then sliced.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from wavepp.runtime.model_config import ModelConfig
from wavepp.runtime.stage.engine.base import (
    ChunkSpec,
    PagedStageEngineBase,
    PreparedBatch,
    StageOutput,
)
from wavepp.runtime.stage.engine.layers.common import apply_rope_rotate_half, rms_norm
from wavepp.runtime.stage.engine.tensor_parallel import SINGLE, TPGroup
from wavepp.runtime.stage.engine.torch_common import causal_masks, last_stage_output, stage_input

__all__ = [
    "TorchPreparedBatch",
    "TorchStageEngine",
    "build_embedding_state_dict",
    "build_full_state_dict",
    "build_head_state_dict",
    "build_layer_state_dict",
    "build_stage_state_dict",
    "torch_dtype",
]

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

_LAYER_PARAM_NAMES = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
_EMBED_NAME = "model.embed_tokens.weight"
_NORM_NAME = "model.norm.weight"
_LM_HEAD_NAME = "lm_head.weight"

# NOTE: norm weights are 1 + N(0, 0.1^2) rather than exactly 1 so that a missing norm weight
# changes the output (the reference test would catch it).
_NORM_STD = 0.1


def torch_dtype(name: str) -> torch.dtype:
    """Map a ModelConfig dtype name to a torch dtype."""
    return _DTYPES[name]


def _derived_seed(seed: int, tag: str) -> int:
    """63-bit generator seed for one tensor group: sha256 of (seed, tag), stable across runs."""
    digest = hashlib.sha256(f"wavepp-weights/{seed}/{tag}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _generator(seed: int, tag: str) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(_derived_seed(seed, tag))


def _normal(shape: tuple[int, ...], std: float, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std


def _norm_weight(size: int, gen: torch.Generator) -> torch.Tensor:
    return 1.0 + _normal((size,), _NORM_STD, gen)


def build_layer_state_dict(config: ModelConfig, layer_index: int) -> dict[str, torch.Tensor]:
    """Seeded random weights of decoder layer ``layer_index`` (float32, CPU).

    The generator is seeded by ``(config.seed, layer_index)`` only, so layer i is identical
    whichever stage holds it. Linear weights are N(0, 1/fan_in) (unit-scale activations, so
    attention is far from uniform and every term of the layer shows in the output); norm
    weights are 1 + N(0, 0.1^2).

    Args:
        config: the model.
        layer_index: global layer index in ``[0, config.num_layers)``.

    Returns:
        ``{"model.layers.{i}.<param>": tensor}`` with Hugging Face LlamaForCausalLM names;
        q_proj [heads*head_dim, hidden], k/v_proj [kv_heads*head_dim, hidden], o_proj
        [hidden, heads*head_dim], gate/up_proj [intermediate, hidden], down_proj
        [hidden, intermediate], norms [hidden].

    Raises:
        ValueError: layer_index out of range.
    """
    if not 0 <= layer_index < config.num_layers:
        raise ValueError(
            f"layer_index={layer_index} must lie in [0, num_layers={config.num_layers})"
        )
    gen = _generator(config.seed, f"layer/{layer_index}")
    hidden = config.hidden_size
    q_dim = config.num_heads * config.head_dim
    kv_dim = config.num_kv_heads * config.head_dim
    inter = config.intermediate_size
    tensors = (
        _norm_weight(hidden, gen),
        _normal((q_dim, hidden), hidden**-0.5, gen),
        _normal((kv_dim, hidden), hidden**-0.5, gen),
        _normal((kv_dim, hidden), hidden**-0.5, gen),
        _normal((hidden, q_dim), q_dim**-0.5, gen),
        _norm_weight(hidden, gen),
        _normal((inter, hidden), hidden**-0.5, gen),
        _normal((inter, hidden), hidden**-0.5, gen),
        _normal((hidden, inter), inter**-0.5, gen),
    )
    prefix = f"model.layers.{layer_index}."
    return {prefix + name: t for name, t in zip(_LAYER_PARAM_NAMES, tensors, strict=True)}


def build_embedding_state_dict(config: ModelConfig) -> dict[str, torch.Tensor]:
    """Seeded token embedding ``model.embed_tokens.weight`` [vocab, hidden], N(0, 1), float32."""
    gen = _generator(config.seed, "embed_tokens")
    return {_EMBED_NAME: _normal((config.vocab_size, config.hidden_size), 1.0, gen)}


def build_head_state_dict(config: ModelConfig) -> dict[str, torch.Tensor]:
    """Seeded final norm [hidden] and ``lm_head.weight`` [vocab, hidden] (N(0, 1/hidden))."""
    gen = _generator(config.seed, "head")
    return {
        _NORM_NAME: _norm_weight(config.hidden_size, gen),
        _LM_HEAD_NAME: _normal(
            (config.vocab_size, config.hidden_size), config.hidden_size**-0.5, gen
        ),
    }


def build_stage_state_dict(
    config: ModelConfig, first_layer: int, last_layer: int
) -> dict[str, torch.Tensor]:
    """The slice of :func:`build_full_state_dict` that the stage ``[first, last)`` needs.

    Includes the embedding when ``first_layer == 0`` and the final norm and ``lm_head`` when
    ``last_layer == config.num_layers``.
    """
    state: dict[str, torch.Tensor] = {}
    if first_layer == 0:
        state.update(build_embedding_state_dict(config))
    for i in range(first_layer, last_layer):
        state.update(build_layer_state_dict(config, i))
    if last_layer == config.num_layers:
        state.update(build_head_state_dict(config))
    return state


def build_full_state_dict(config: ModelConfig) -> dict[str, torch.Tensor]:
    """All weights of the model with Hugging Face ``LlamaForCausalLM`` names (float32, CPU).

    Load it into ``LlamaForCausalLM(LlamaConfig(**config.to_hf_llama_kwargs()))`` to get the
    monolithic reference of the stage engines.
    """
    return build_stage_state_dict(config, 0, config.num_layers)


def _stage_param_names(config: ModelConfig, first_layer: int, last_layer: int) -> list[str]:
    names: list[str] = []
    if first_layer == 0:
        names.append(_EMBED_NAME)
    for i in range(first_layer, last_layer):
        names.extend(f"model.layers.{i}.{n}" for n in _LAYER_PARAM_NAMES)
    if last_layer == config.num_layers:
        names.extend([_NORM_NAME, _LM_HEAD_NAME])
    return names


def _load_safetensors(
    path: str | os.PathLike[str], names: Sequence[str]
) -> dict[str, torch.Tensor]:
    """Load the named tensors from a ``.safetensors`` file or a directory of them."""
    from safetensors import safe_open  # optional dependency: only for local weights

    root = Path(path)
    if root.is_dir():
        files = sorted(root.glob("*.safetensors"))
    elif root.is_file():
        files = [root]
    else:
        raise ValueError(f"weights_path={str(root)!r} is neither a file nor a directory")
    if not files:
        raise ValueError(f"weights_path={str(root)!r} holds no *.safetensors file")
    wanted = set(names)
    out: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                if key in wanted:
                    out[key] = f.get_tensor(key)
    missing = [n for n in names if n not in out]
    if missing:
        raise ValueError(
            f"weights_path={str(root)!r} lacks {len(missing)} tensors this stage needs, "
            f"e.g. {missing[:3]}"
        )
    return out


@dataclass(frozen=True, eq=False)
class TorchPreparedBatch(PreparedBatch):
    """:class:`PreparedBatch` plus the torch engine's per-batch tensors.

    Attributes:
        rope_cos, rope_sin: [T, head_dim] RoPE tables at ``positions`` (activation dtype).
        attn_masks: per chunk, [x_i, L_i + x_i] bool, True where query j may attend key k
            (k <= L_i + j).
    """

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    attn_masks: tuple[torch.Tensor, ...]


class TorchStageEngine(PagedStageEngineBase):
    """Real decoder layers ``[first_layer, last_layer)`` over this stage's paged KV cache.

    Stores the local weights (q/k/v fused into one matrix, gate/up fused) and the KV cache
    ``kv_cache`` of shape [num_local_layers, 2 (K, V), num_blocks, block_size, num_kv_heads,
    head_dim] in the model dtype.
    """

    def __init__(
        self,
        *,
        model: ModelConfig,
        first_layer: int,
        last_layer: int,
        num_layers_total: int,
        device: torch.device | str = "cpu",
        weights_path: str | os.PathLike[str] | None = None,
        state_dict: Mapping[str, torch.Tensor] | None = None,
        tp: TPGroup = SINGLE,
    ) -> None:
        """Build the stage and load or generate its weights.

        Args:
            model: the model config; its ``num_layers`` must equal ``num_layers_total``.
            first_layer, last_layer: this stage's layer range.
            num_layers_total: layers of the whole model.
            device: "cpu" or a CUDA device; non-float32 dtypes need CUDA.
            weights_path: optional local ``.safetensors`` file or directory with HF Llama names.
            state_dict: optional in-memory weights with HF Llama names (e.g. a full one).
            tp: this process's place in the stage's tensor-parallel group.

        Raises:
            ValueError: bad layer range, num_layers mismatch, dtype on CPU, both weight
                sources given, or a weight of the wrong shape.
        """
        super().__init__(
            first_layer=first_layer,
            last_layer=last_layer,
            num_layers_total=num_layers_total,
            device=device,
        )
        if model.num_layers != num_layers_total:
            raise ValueError(
                f"num_layers_total={num_layers_total} differs from model.num_layers="
                f"{model.num_layers}; the torch engine runs the real model"
            )
        dtype = torch_dtype(model.dtype)
        if self.device.type == "cpu" and dtype != torch.float32:
            raise ValueError(
                f"model.dtype={model.dtype!r} on device 'cpu'; use float32 on CPU "
                "(half precision needs CUDA)"
            )
        if weights_path is not None and state_dict is not None:
            raise ValueError("give weights_path or state_dict, not both")
        self.model = model
        self.hidden_size = model.hidden_size
        self.activation_dtype = dtype
        self.kv_cache: torch.Tensor | None = None
        self.tp = tp
        heads = tp.shard(model.num_heads, "num_heads")
        kv_heads = tp.shard(model.num_kv_heads, "num_kv_heads")
        inter = tp.shard(model.intermediate_size, "intermediate_size")
        self.num_local_heads = model.num_heads // tp.size
        self.num_local_kv_heads = model.num_kv_heads // tp.size
        hd = model.head_dim
        rows_q = slice(heads.start * hd, heads.stop * hd)
        rows_kv = slice(kv_heads.start * hd, kv_heads.stop * hd)

        names = _stage_param_names(model, first_layer, last_layer)
        if weights_path is not None:
            source: Mapping[str, torch.Tensor] = _load_safetensors(weights_path, names)
        elif state_dict is not None:
            missing = [n for n in names if n not in state_dict]
            if missing:
                raise ValueError(f"state_dict lacks {len(missing)} tensors, e.g. {missing[:3]}")
            source = state_dict
        else:
            source = build_stage_state_dict(model, first_layer, last_layer)
        expected = build_shapes(model)

        def load(name: str) -> torch.Tensor:
            t = source[name]
            key = name.split(".", 3)[-1] if name.startswith("model.layers.") else name
            if tuple(t.shape) != expected[key]:
                raise ValueError(
                    f"weight {name} has shape {tuple(t.shape)}; model {model.name!r} needs "
                    f"{expected[key]}"
                )
            return t.to(device=self.device, dtype=dtype).contiguous()

        def rows(t: torch.Tensor, part: slice) -> torch.Tensor:
            return t[part].contiguous()

        def cols(t: torch.Tensor, part: slice) -> torch.Tensor:
            return t[:, part].contiguous()

        has_head = self.is_last and tp.is_leader  # followers return no logits
        self._embed = load(_EMBED_NAME) if self.is_first else None
        self._final_norm = load(_NORM_NAME) if has_head else None
        self._lm_head = load(_LM_HEAD_NAME) if has_head else None
        self._layers: list[dict[str, torch.Tensor]] = []
        for i in range(first_layer, last_layer):
            p = f"model.layers.{i}."
            self._layers.append(
                {
                    "input_norm": load(p + "input_layernorm.weight"),
                    "qkv": torch.cat(
                        [
                            rows(load(p + "self_attn.q_proj.weight"), rows_q),
                            rows(load(p + "self_attn.k_proj.weight"), rows_kv),
                            rows(load(p + "self_attn.v_proj.weight"), rows_kv),
                        ]
                    ),
                    "o": cols(load(p + "self_attn.o_proj.weight"), rows_q),
                    "post_norm": load(p + "post_attention_layernorm.weight"),
                    "gate_up": torch.cat(
                        [rows(load(p + f"mlp.{n}_proj.weight"), inter) for n in ("gate", "up")]
                    ),
                    "down": cols(load(p + "mlp.down_proj.weight"), inter),
                }
            )
        d = model.head_dim
        self._inv_freq = 1.0 / (
            model.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        ).to(self.device)

    # ------------------------------------------------------------------ KV cache

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        """Allocate a zeroed KV cache of ``num_blocks`` blocks of ``block_size`` tokens.

        Re-allocation drops the previous content. Bytes: num_local_layers * 2 * num_blocks *
        block_size * num_kv_heads * head_dim * dtype size.

        Raises:
            ValueError: num_blocks or block_size < 1.
        """
        super().allocate_kv(num_blocks, block_size)
        m = self.model
        self.kv_cache = torch.zeros(
            (self.num_local_layers, 2, num_blocks, block_size, self.num_local_kv_heads, m.head_dim),
            dtype=self.activation_dtype,
            device=self.device,
        )

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the allocated KV cache (0 before allocate_kv)."""
        if self.kv_cache is None:
            return 0
        return self.kv_cache.numel() * self.kv_cache.element_size()

    # ------------------------------------------------------------------ prepare / execute

    def prepare(self, chunks: Sequence[ChunkSpec]) -> TorchPreparedBatch:
        """Local preparation: block tables, slot mapping, positions, RoPE tables, masks.

        Args:
            chunks: the micro-batch in row order (see :class:`ChunkSpec`).

        Returns:
            A :class:`TorchPreparedBatch` on this engine's device.

        Raises:
            ValueError: a chunk field is invalid (see ``build_prepared_batch``).
            RuntimeError: allocate_kv has not run.
        """
        base = self._prepare_common(
            chunks, vocab_size=self.model.vocab_size, max_position=self.model.max_position
        )
        freqs = base.positions.to(torch.float32)[:, None] * self._inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return TorchPreparedBatch(
            **base.base_fields(),
            rope_cos=emb.cos().to(self.activation_dtype),
            rope_sin=emb.sin().to(self.activation_dtype),
            attn_masks=causal_masks(base.chunks, self.device),
        )

    @torch.inference_mode()
    def execute(self, prepared: PreparedBatch, hidden_in: torch.Tensor | None) -> StageOutput:
        """Run this stage's layers on a prepared micro-batch.

        Args:
            prepared: from this engine's :meth:`prepare` (same KV allocation).
            hidden_in: [num_tokens, hidden_size] from the previous stage; None on stage 0.

        Returns:
            :class:`StageOutput`: ``hidden`` [num_tokens, hidden_size] (None on the last
            stage) and, on the last stage, float32 [vocab_size] logits per ``is_last`` chunk.

        Raises:
            ValueError: prepared by another engine or for another allocation, or hidden_in of
                the wrong shape / presence.
        """
        self._check_execute_args(prepared, hidden_in)
        if not isinstance(prepared, TorchPreparedBatch):
            raise ValueError("prepared is not a TorchPreparedBatch; use this engine's prepare()")
        assert self.kv_cache is not None, "prepare() succeeded, so allocate_kv() has run"
        h = stage_input(
            prepared,
            hidden_in,
            self._embed,
            is_first=self.is_first,
            device=self.device,
            dtype=self.activation_dtype,
        )
        for local_index, weights in enumerate(self._layers):
            h = self._decoder_layer(local_index, weights, h, prepared)
        if not self.is_last:
            return StageOutput(hidden=h)
        return last_stage_output(
            h,
            prepared,
            self.tp,
            self._final_norm,
            self._lm_head,
            eps=self.model.rms_norm_eps,
            device=self.device,
        )

    def _decoder_layer(
        self,
        local_index: int,
        w: dict[str, torch.Tensor],
        h: torch.Tensor,
        p: TorchPreparedBatch,
    ) -> torch.Tensor:
        m = self.model
        assert self.kv_cache is not None
        num_tokens = h.shape[0]
        heads, kv_heads = self.num_local_heads, self.num_local_kv_heads
        q_dim = heads * m.head_dim
        kv_dim = kv_heads * m.head_dim

        x = rms_norm(h, w["input_norm"], m.rms_norm_eps)
        q, k, v = F.linear(x, w["qkv"]).split([q_dim, kv_dim, kv_dim], dim=-1)
        q = q.view(num_tokens, heads, m.head_dim)
        k = k.view(num_tokens, kv_heads, m.head_dim)
        v = v.view(num_tokens, kv_heads, m.head_dim)
        q = apply_rope_rotate_half(q, p.rope_cos, p.rope_sin)
        k = apply_rope_rotate_half(k, p.rope_cos, p.rope_sin)

        # Write the new tokens' KV first: each chunk then reads its whole context [0, L + x)
        # (cached prefix and its own new tokens) through one gather from the paged cache.
        k_cache = self.kv_cache[local_index, 0].view(-1, kv_heads, m.head_dim)
        v_cache = self.kv_cache[local_index, 1].view(-1, kv_heads, m.head_dim)
        k_cache.index_copy_(0, p.slot_mapping, p.written(k))
        v_cache.index_copy_(0, p.slot_mapping, p.written(v))

        attn = torch.empty_like(q)
        for chunk, start, key_slots, mask in zip(
            p.chunks, p.row_starts, p.key_slots, p.attn_masks, strict=True
        ):
            end = start + chunk.num_tokens
            q_c = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, heads, x, d]
            k_c = k_cache[key_slots].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, L+x, d]
            v_c = v_cache[key_slots].transpose(0, 1).unsqueeze(0)
            o_c = F.scaled_dot_product_attention(q_c, k_c, v_c, attn_mask=mask, enable_gqa=True)
            attn[start:end] = o_c[0].transpose(0, 1)
        h = h + self.tp.all_reduce(F.linear(attn.reshape(num_tokens, q_dim), w["o"]))

        x = rms_norm(h, w["post_norm"], m.rms_norm_eps)
        gate, up = F.linear(x, w["gate_up"]).chunk(2, dim=-1)
        return h + self.tp.all_reduce(F.linear(F.silu(gate) * up, w["down"]))


def build_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Expected weight shapes: per-layer names without the ``model.layers.{i}.`` prefix."""
    hidden = config.hidden_size
    q_dim = config.num_heads * config.head_dim
    kv_dim = config.num_kv_heads * config.head_dim
    inter = config.intermediate_size
    return {
        _EMBED_NAME: (config.vocab_size, hidden),
        _NORM_NAME: (hidden,),
        _LM_HEAD_NAME: (config.vocab_size, hidden),
        "input_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (q_dim, hidden),
        "self_attn.k_proj.weight": (kv_dim, hidden),
        "self_attn.v_proj.weight": (kv_dim, hidden),
        "self_attn.o_proj.weight": (hidden, q_dim),
        "post_attention_layernorm.weight": (hidden,),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
    }
