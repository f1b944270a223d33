"""A Hugging Face model directory's ``config.json`` as a :class:`ModelConfig`.

``--model DIR`` (replay, stage) and ``RuntimeConfig.model_dir`` name a directory holding
``config.json`` and safetensors weights (one ``model.safetensors`` or shards with
``model.safetensors.index.json``). The scheduler, planner and block hashing need only the
generic shape (layers, width, vocabulary) that :func:`model_config_from_hf` takes from it; the
torch engine reads the family-specific fields itself (``engine/architecture.py``).

| ``model_type``  | family                                                       |
| --------------- | ------------------------------------------------------------ |
| ``llama``       | RMSNorm, RoPE, GQA, SwiGLU                                   |
| ``deepseek_v3`` | MLA (latent KV cache) + MoE (grouped top-k, shared experts)  |
| ``minimax_m2``  | GQA with QK-norm and partial RoPE + MoE (sigmoid top-k)      |
| ``glm_moe_dsa`` | MLA + DSA sparse attention (indexer key cache) + MoE         |
| ``kimi_linear`` | KDA linear attention (state per k blocks) + MLA, MoE         |
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from wavepp.runtime.model_config import SUPPORTED_ARCHITECTURES, ModelConfig

__all__ = ["load_model_dir", "model_config_from_hf", "normalize_hf_config", "read_hf_config"]

# NOTE: transformers writes some configs under their ``attribute_map`` names; these are the
# canonical names each family's fields are read by (KimiLinearConfig.attribute_map).
_ALIASES: dict[str, dict[str, str]] = {
    "kimi_linear": {
        "model_max_length": "max_position_embeddings",
        "moe_renormalize": "norm_topk_prob",
        "num_expert_group": "n_group",
        "num_experts": "num_local_experts",
        "num_experts_per_token": "num_experts_per_tok",
        "num_shared_experts": "n_shared_experts",
    },
}


def normalize_hf_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``cfg`` with its family's aliased field names replaced by the canonical ones."""
    out = dict(cfg)
    for alias, name in _ALIASES.get(str(cfg.get("model_type")), {}).items():
        if alias in out and name not in out:
            out[name] = out.pop(alias)
    return out


def _required(cfg: Mapping[str, Any], key: str, where: str) -> Any:
    if cfg.get(key) is None:
        raise ValueError(
            f"{where}: field {key!r} is missing; a {cfg.get('model_type')} config needs it"
        )
    return cfg[key]


def model_config_from_hf(
    cfg: Mapping[str, Any], *, name: str, where: str = "config.json"
) -> ModelConfig:
    """The generic :class:`ModelConfig` of a HF config dict (float32; the engine's shape).

    ``num_heads``/``num_kv_heads``/``head_dim`` describe the attention as the cost model sees
    it: for MLA, H query heads of width ``qk_nope + qk_rope`` and H "KV heads" (the cache itself
    is the latent, see ``layers/mla.py``).

    Args:
        cfg: the parsed ``config.json``.
        name: the model's name (seeds the block-hash chain).
        where: for error messages (the file).

    Raises:
        ValueError: an unsupported ``model_type`` or rope type, or a missing field, naming it.
    """
    cfg = normalize_hf_config(cfg)
    arch = cfg.get("model_type")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{where}: model_type={arch!r} is not supported by the torch engine; "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    rope = cfg.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(
            f"{where}: rope_parameters.rope_type={rope_type!r} is not implemented "
            "(only 'default' RoPE); drop the scaling or use a model without it"
        )
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ValueError(f"{where}: attention_bias/mlp_bias = true is not implemented")
    heads = int(_required(cfg, "num_attention_heads", where))
    kv_values: float | None = None
    if arch in ("deepseek_v3", "glm_moe_dsa", "kimi_linear"):
        head_dim = int(_required(cfg, "qk_nope_head_dim", where)) + int(
            _required(cfg, "qk_rope_head_dim", where)
        )
        kv_heads = heads
        kv_values = _latent_values_per_token(cfg, where)
    else:
        head_dim = int(cfg.get("head_dim") or int(_required(cfg, "hidden_size", where)) // heads)
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
    try:
        return ModelConfig(
            name=name,
            architecture=arch,
            vocab_size=int(_required(cfg, "vocab_size", where)),
            hidden_size=int(_required(cfg, "hidden_size", where)),
            intermediate_size=int(_required(cfg, "intermediate_size", where)),
            num_layers=int(_required(cfg, "num_hidden_layers", where)),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position=int(cfg.get("max_position_embeddings", 131072)),
            kv_values_per_token_per_layer=kv_values,
        )
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def _latent_values_per_token(cfg: Mapping[str, Any], where: str) -> float:
    """Cached values per token and layer, averaged over the layers: the MLA latent
    (kv_lora_rank + qk_rope_head_dim) in attention layers, plus the DSA indexer key
    (index_head_dim) in GLM-5's "full" layers; Kimi's KDA layers cache nothing per token (their
    state is per block boundary, see ``engine/layers/kda.py``)."""
    n = int(_required(cfg, "num_hidden_layers", where))
    latent = int(_required(cfg, "kv_lora_rank", where)) + int(cfg["qk_rope_head_dim"])
    total = float(latent * n)
    if cfg.get("model_type") == "glm_moe_dsa":
        types = cfg.get("indexer_types") or ["full"] * n
        total += int(_required(cfg, "index_head_dim", where)) * sum(t == "full" for t in types)
    if cfg.get("model_type") == "kimi_linear":
        types = cfg.get("layer_types") or []
        total = float(latent * sum(t == "full_attention" for t in types))
    return total / n


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    """Parse ``DIR/config.json``.

    Raises:
        ValueError: the directory or its config.json is missing or not a JSON object.
    """
    root = Path(model_dir)
    path = root / "config.json"
    if not root.is_dir():
        raise ValueError(f"model_dir={str(root)!r} is not a directory")
    if not path.is_file():
        raise ValueError(f"model_dir={str(root)!r} has no config.json")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: must hold a JSON object")
    return cfg


def load_model_dir(model_dir: str | Path) -> ModelConfig:
    """:func:`model_config_from_hf` of ``DIR/config.json``, named ``<dir name>-<sha8>``, the
    hash over config.json's bytes (two directories with the same name and another config do
    not share a block-hash chain)."""
    root = Path(model_dir)
    cfg = read_hf_config(root)
    digest = hashlib.sha256((root / "config.json").read_bytes()).hexdigest()[:8]
    name = f"{root.resolve().name or 'model'}-{digest}"
    return model_config_from_hf(cfg, name=name, where=str(root / "config.json"))
