"""Torch stage engine over a ``ModelConfig``: seeded (or given) Llama weights, no checkpoint
directory.

The forward is the decoder stack every family shares (``decoder.DecoderStageEngine``; Llama's
layers: ``layers/gqa.py`` attention and ``layers/moe.DenseMLP``, HF ``LlamaDecoderLayer``
semantics, no biases): the layer plan is the registry's Llama entry applied to
``ModelConfig.to_hf_llama_kwargs()``. Weights come from a ``.safetensors`` file or directory
with HF Llama names, an in-memory state dict, or are generated here.

Weights are random and seeded per tensor group, independent of the pipeline partition: layer i
always gets the same values whichever stage holds it (see :func:`build_layer_state_dict`).
With tensor parallelism each TP rank keeps its share of the heads and of the MLP's
intermediate width (``layers/gqa.py``, ``layers/moe.py``); the full tensors are generated or
read, then sliced.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from wavepp.runtime.families import FAMILIES
from wavepp.runtime.model_config import ModelConfig
from wavepp.runtime.stage.engine.base import PagedStageEngineBase
from wavepp.runtime.stage.engine.decoder import DecoderStageEngine, torch_dtype
from wavepp.runtime.stage.engine.layers.gqa import GQAAttention
from wavepp.runtime.stage.engine.tensor_parallel import SINGLE, TPGroup

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


class TorchStageEngine(DecoderStageEngine):
    """Llama decoder layers ``[first_layer, last_layer)`` of a ``ModelConfig`` over this stage's
    paged KV cache ``kv_cache`` [num_local_layers, 2 (K, V), num_blocks, block_size,
    num_kv_heads / T, head_dim] in the model dtype (each layer's attention reads its slice)."""

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
        compile: bool = False,
        pack_weights: bool = True,
    ) -> None:
        """Build the stage and load or generate its weights.

        Args:
            model: the model config (architecture llama); its ``num_layers`` must equal
                ``num_layers_total``.
            first_layer, last_layer: this stage's layer range.
            num_layers_total: layers of the whole model.
            device: "cpu" or a CUDA device; non-float32 dtypes need CUDA.
            weights_path: optional local ``.safetensors`` file or directory with HF Llama names.
            state_dict: optional in-memory weights with HF Llama names (e.g. a full one).
            compile: ``torch.compile`` the layers' dense parts (``DecoderStageEngine._build``).
            pack_weights: pre-pack the projections' weights (``DecoderStageEngine._build``).
            tp: this process's place in the stage's tensor-parallel group.

        Raises:
            ValueError: bad layer range, num_layers mismatch, dtype on CPU, both weight
                sources given, a missing weight, or a weight of the wrong shape (named).
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
        self.kv_cache: torch.Tensor | None = None
        # NOTE: named as ModelConfig names them (the layers name the config.json fields).
        for field in ("num_heads", "num_kv_heads", "intermediate_size"):
            tp.shard(getattr(model, field), field)
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

        def get(name: str, shape: tuple[int, ...], dim: int | None = None) -> torch.Tensor:
            t = source[name]
            if tuple(t.shape) != shape:
                raise ValueError(
                    f"weight {name} has shape {tuple(t.shape)}; model {model.name!r} needs {shape}"
                )
            if dim is not None and tp.size > 1:
                part = tp.shard(shape[dim], name)
                t = t[part] if dim == 0 else t[:, part]
            return t.to(device=self.device, dtype=dtype).contiguous()

        plan = FAMILIES["llama"].layer_plan({**model.to_hf_llama_kwargs(), "model_type": "llama"})
        self._build(plan, get, dtype=dtype, tp=tp, compile=compile, pack=pack_weights)

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        """Allocate a zeroed KV cache of ``num_blocks`` blocks of ``block_size`` tokens.

        Re-allocation drops the previous content and the host tier. Bytes: num_local_layers * 2 * num_blocks *
        block_size * (num_kv_heads / T) * head_dim * dtype size.

        Raises:
            ValueError: num_blocks or block_size < 1.
        """
        PagedStageEngineBase.allocate_kv(self, num_blocks, block_size)
        self.host_copies = None
        gqa = self.plan.gqa
        assert gqa is not None, "a Llama plan has GQA attention"
        kv_heads = gqa.num_kv_heads // self.tp.size
        self.kv_cache = torch.zeros(
            (self.num_local_layers, 2, num_blocks, block_size, kv_heads, gqa.head_dim),
            dtype=self.activation_dtype,
            device=self.device,
        )
        for local, layer in enumerate(self._layers):
            assert isinstance(layer.attn, GQAAttention)
            layer.attn.use_cache(self.kv_cache[local].view(2, -1, kv_heads, gqa.head_dim))
