"""A Hugging Face model directory's ``config.json`` as a :class:`ModelConfig`.

``--model DIR`` (replay, stage) and ``RuntimeConfig.model_dir`` name a directory holding
``config.json`` and safetensors weights (one ``model.safetensors`` or shards with
``model.safetensors.index.json``). The scheduler, planner and block hashing need only the
generic shape (layers, width, vocabulary) that :func:`model_config_from_hf` takes from it; the
family's layer plan reads its own fields (``families.ModelFamily.layer_plan``).

Which ``model_type`` values are served, and each one's aliases and attention shape, is the
model-family registry's (``wavepp.runtime.families``); this module checks the fields and reads
the generic part.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from wavepp.runtime.families import FAMILIES, LayerPlan, family_of
from wavepp.runtime.families.contract import required
from wavepp.runtime.model_config import MAX_LAYERS, ModelConfig

# NOTE: config.json is a few KB; the cap keeps a hostile one from costing memory (a 300 MB
# file took 825 MB to parse). Read at call time, so a test may lower it.
MAX_CONFIG_BYTES = 16 << 20

_DIMS = 1 << 16  # a width: hidden size, head dims, latent ranks
_HEADS = 1024
_EXPERTS = 4096
_FFN = 1 << 20  # an MLP width
_TOKENS = 1 << 24  # vocabulary, positions

# NOTE: generous bounds on every size field the readers use (the largest published models are
# far inside them: DeepSeek-V3 61 layers, hidden 7168, 256 experts, vocabulary 129280; Llama-4
# 10M positions), so a hostile config.json cannot make the partition, cost model or engine
# spin or allocate without bound. field -> (least, most); null counts as absent.
FIELD_LIMITS: dict[str, tuple[int, int]] = {
    "num_hidden_layers": (1, MAX_LAYERS),
    "first_k_dense_replace": (0, MAX_LAYERS),
    "hidden_size": (1, _DIMS),
    "head_dim": (1, _DIMS),
    "qk_nope_head_dim": (0, _DIMS),
    "qk_rope_head_dim": (0, _DIMS),
    "v_head_dim": (1, _DIMS),
    "kv_lora_rank": (1, _DIMS),
    "q_lora_rank": (1, _DIMS),
    "index_head_dim": (1, _DIMS),
    "linear_head_dim": (1, _DIMS),
    "rotary_dim": (0, _DIMS),
    "num_attention_heads": (1, _HEADS),
    "num_key_value_heads": (1, _HEADS),
    "index_n_heads": (1, _HEADS),
    "linear_num_heads": (1, _HEADS),
    "linear_conv_kernel_dim": (1, _HEADS),
    "intermediate_size": (1, _FFN),
    "moe_intermediate_size": (1, _FFN),
    "shared_intermediate_size": (0, _FFN),
    "n_routed_experts": (0, _EXPERTS),
    "num_local_experts": (1, _EXPERTS),
    "num_experts_per_tok": (1, _EXPERTS),
    "n_shared_experts": (0, _EXPERTS),
    "n_group": (0, _EXPERTS),
    "topk_group": (0, _EXPERTS),
    "vocab_size": (1, _TOKENS),
    "max_position_embeddings": (1, _TOKENS),
    "index_topk": (1, _TOKENS),
}
# NOTE: finite numbers in (0, most]; in config.json or in rope_parameters.
_FLOAT_LIMITS: dict[str, float] = {
    "rope_theta": math.inf,
    "rms_norm_eps": math.inf,
    "routed_scaling_factor": math.inf,
    "partial_rotary_factor": 1.0,
}
_BOOLS = (
    "attention_bias",
    "mlp_bias",
    "tie_word_embeddings",
    "norm_topk_prob",
    "rope_interleave",
)
_STRINGS = ("model_type", "hidden_act")
_PER_LAYER = ("layer_types", "mlp_layer_types", "indexer_types")


def normalize_hf_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``cfg`` with its family's aliased field names (``ModelFamily.aliases``) replaced by the
    canonical ones."""
    out = dict(cfg)
    family = FAMILIES.get(str(cfg.get("model_type")))
    for alias, name in (family.aliases if family else {}).items():
        if alias in out and name not in out:
            out[name] = out.pop(alias)
    return out


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_int(value: Any, key: str, limits: tuple[int, int], where: str) -> None:
    least, most = limits
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}: {key}={_shown(value)} must be an integer in [{least}, {most}]")
    if not least <= value <= most:
        raise ValueError(
            f"{where}: {key}={_shown(value)} is outside [{least}, {most}] (the limit on {key})"
        )


def _check_float(value: Any, key: str, most: float, where: str) -> None:
    bound = "a finite number > 0" if math.isinf(most) else f"a number in (0, {most}]"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}: {key}={_shown(value)} must be {bound}")
    if not (math.isfinite(value) and 0 < value <= most):
        raise ValueError(f"{where}: {key}={_shown(value)} must be {bound}")


def check_hf_fields(cfg: Mapping[str, Any], where: str = "config.json") -> None:
    """Check the type and range of every config.json field the readers use (before any of
    them converts one): integers in :data:`FIELD_LIMITS`, finite positive floats, booleans,
    strings, ``rope_parameters`` an object, per-layer type lists of strings. A family's
    aliased names (``ModelFamily.aliases``) are checked under the name the file uses; null is absent.

    Raises:
        ValueError: the first bad field, named with its value and limit (one line).
    """
    model_type = cfg.get("model_type")
    names = {key: key for key in FIELD_LIMITS}
    names |= {key: key for key in (*_FLOAT_LIMITS, *_BOOLS, *_STRINGS, *_PER_LAYER)}
    if isinstance(model_type, str) and model_type in FAMILIES:
        names |= FAMILIES[model_type].aliases
    for key, canonical in names.items():
        value = cfg.get(key)
        if value is None:
            continue
        if canonical in FIELD_LIMITS:
            _check_int(value, key, FIELD_LIMITS[canonical], where)
        elif canonical in _FLOAT_LIMITS:
            _check_float(value, key, _FLOAT_LIMITS[canonical], where)
        elif canonical in _BOOLS and not isinstance(value, bool):
            raise ValueError(f"{where}: {key}={_shown(value)} must be true or false")
        elif canonical in _STRINGS and not isinstance(value, str):
            raise ValueError(f"{where}: {key}={_shown(value)} must be a string")
        elif canonical in _PER_LAYER and (
            not isinstance(value, list)
            or len(value) > MAX_LAYERS
            or not all(isinstance(v, str) for v in value)
        ):
            raise ValueError(
                f"{where}: {key} must be a list of at most {MAX_LAYERS} strings "
                f"(one per layer), not {_shown(value)}"
            )
    rope = cfg.get("rope_parameters")
    if rope is None:
        return
    if not isinstance(rope, dict):
        raise ValueError(f"{where}: rope_parameters={_shown(rope)} must be an object or null")
    for key, most in _FLOAT_LIMITS.items():
        if rope.get(key) is not None:
            _check_float(rope[key], f"rope_parameters.{key}", most, where)
    for key in ("rope_type", "type"):
        if rope.get(key) is not None and not isinstance(rope[key], str):
            raise ValueError(f"{where}: rope_parameters.{key}={_shown(rope[key])} must be a string")


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
        ValueError: an unsupported ``model_type`` or rope type, a missing field, or a field of
            the wrong type or outside its limit (:func:`check_hf_fields`), naming it.
    """
    check_hf_fields(cfg, where)
    cfg = normalize_hf_config(cfg)
    family = family_of(cfg.get("model_type"), where)
    rope = cfg.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(
            f"{where}: rope_parameters.rope_type={rope_type!r} is not implemented "
            "(only 'default' RoPE); drop the scaling or use a model without it"
        )
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ValueError(f"{where}: attention_bias/mlp_bias = true is not implemented")
    attention = family.attention(cfg, where)
    try:
        return ModelConfig(
            name=name,
            architecture=family.model_type,
            vocab_size=int(required(cfg, "vocab_size", where)),
            hidden_size=int(required(cfg, "hidden_size", where)),
            intermediate_size=int(required(cfg, "intermediate_size", where)),
            num_layers=int(required(cfg, "num_hidden_layers", where)),
            num_heads=attention.num_heads,
            num_kv_heads=attention.num_kv_heads,
            head_dim=attention.head_dim,
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position=int(cfg.get("max_position_embeddings", 131072)),
            kv_values_per_token_per_layer=attention.kv_values_per_token_per_layer,
        )
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def layer_plan_from_hf(cfg: Mapping[str, Any]) -> LayerPlan:
    """What each decoder layer of a parsed ``config.json`` runs: its family's
    ``layer_plan`` of the normalised config (checked by :func:`model_config_from_hf` first).

    Raises:
        ValueError: an unsupported model_type, or a field outside what the layers implement.
        KeyError: a field the family needs is missing (its name).
    """
    cfg = normalize_hf_config(cfg)
    return family_of(cfg.get("model_type")).layer_plan(cfg)


def read_json_file(path: Path, *, max_bytes: int) -> tuple[Any, bytes]:
    """Parse a JSON file of at most ``max_bytes`` from one read.

    The file is opened without blocking and must be a regular file (a FIFO or a device would
    hang the reader or never end), no larger than ``max_bytes``, UTF-8.

    Returns:
        (the parsed value, the bytes parsed): hash these, not a second read.

    Raises:
        ValueError: unreadable, not a regular file, over ``max_bytes``, not UTF-8, not JSON or
            nested too deeply (names the file, and the limit).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise ValueError(f"{path}: cannot be read ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as handle:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path}: not a regular file")
        if st.st_size > max_bytes:
            raise ValueError(f"{path}: {st.st_size} bytes; at most {max_bytes} are read")
        raw = handle.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise ValueError(f"{path}: more than {max_bytes} bytes; at most {max_bytes} are read")
    try:
        return json.loads(raw.decode("utf-8")), raw
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text") from None
    except RecursionError:
        raise ValueError(f"{path}: JSON nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, or an integer of over 4300 digits
        raise ValueError(f"{path}: not valid JSON ({exc})") from None


def _read_config(model_dir: str | Path) -> tuple[dict[str, Any], bytes]:
    root = Path(model_dir)
    path = root / "config.json"
    if not root.is_dir():
        raise ValueError(f"model_dir={str(root)!r} is not a directory")
    if not os.path.lexists(path):
        raise ValueError(f"model_dir={str(root)!r} has no config.json")
    cfg, raw = read_json_file(path, max_bytes=MAX_CONFIG_BYTES)
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: must hold a JSON object")
    check_hf_fields(cfg, str(path))
    return cfg, raw


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    """Parse ``DIR/config.json`` (a regular file of at most :data:`MAX_CONFIG_BYTES`) and
    check its fields (:func:`check_hf_fields`).

    Raises:
        ValueError: the directory or its config.json is missing, not a regular file, too
            large, not a JSON object, or a field is of the wrong type or out of its limit.
    """
    return _read_config(model_dir)[0]


def load_model_dir(model_dir: str | Path) -> ModelConfig:
    """:func:`model_config_from_hf` of ``DIR/config.json``, named ``<dir name>-<sha8>``, the
    hash over the config.json bytes parsed (one read: two directories with the same name and
    another config do not share a block-hash chain).

    Raises:
        ValueError: as :func:`read_hf_config` and :func:`model_config_from_hf`.
    """
    root = Path(model_dir)
    cfg, raw = _read_config(root)
    digest = hashlib.sha256(raw).hexdigest()[:8]
    name = f"{root.resolve().name or 'model'}-{digest}"
    return model_config_from_hf(cfg, name=name, where=str(root / "config.json"))
