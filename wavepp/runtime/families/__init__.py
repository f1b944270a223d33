"""The model-family registry: one table, ``model_type`` -> :class:`ModelFamily`.

Every reader of a checkpoint's ``config.json`` asks this table: ``hf_config`` (field aliases,
the generic ``ModelConfig`` shape), the torch engine (the :class:`LayerPlan` it builds its layers
from), ``RuntimeConfig`` (which families shard over tensor parallelism) and the planner's
catalogue (:func:`model_shape_from_hf`, the cost formulas).

| ``model_type``  | family                                                       |
| --------------- | ------------------------------------------------------------ |
| ``llama``       | RMSNorm, RoPE, GQA, SwiGLU                                   |
| ``deepseek_v3`` | MLA (latent KV cache) + MoE (grouped top-k, shared experts)  |
| ``minimax_m2``  | GQA with QK-norm and partial RoPE + MoE (sigmoid top-k)      |
| ``glm_moe_dsa`` | MLA + DSA sparse attention (indexer key cache) + MoE         |
| ``kimi_linear`` | KDA linear attention (state per k blocks) + MLA, MoE         |

Adding a family: a :class:`ModelFamily` subclass (its config reader, layer plan, TP support and
cost formulas) and one entry in :data:`FAMILIES`. A family made of new layer kinds also needs
their shapes in ``layer_plan`` and their modules in ``stage/engine/layers/``.
Pure: no torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from wavepp.runtime.families.contract import ModelFamily
from wavepp.runtime.families.gqa import Llama, MiniMaxM2
from wavepp.runtime.families.layer_plan import LayerPlan
from wavepp.runtime.families.mla import DeepSeekV3, GlmMoeDsa, KimiLinear
from wavepp.runtime.planning.shapes import ModelShape

__all__ = [
    "FAMILIES",
    "TENSOR_PARALLEL",
    "LayerPlan",
    "ModelFamily",
    "family_of",
    "model_shape_from_hf",
]

FAMILIES: dict[str, ModelFamily] = {
    family.model_type: family
    for family in (Llama(), DeepSeekV3(), MiniMaxM2(), GlmMoeDsa(), KimiLinear())
}
"""Every family the runtime serves, by Hugging Face ``model_type``."""

TENSOR_PARALLEL: frozenset[str] = frozenset(t for t, f in FAMILIES.items() if f.tensor_parallel)
"""The ``model_type`` values whose layers shard over a stage's tensor-parallel group."""


def family_of(model_type: object, where: str = "config.json") -> ModelFamily:
    """The registered family of ``model_type``.

    Raises:
        ValueError: not a registered family (names it, ``where``, and the supported ones).
    """
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise ValueError(
            f"{where}: model_type={model_type!r} is not supported by the torch engine; "
            f"supported: {sorted(FAMILIES)}"
        )
    return family


def model_shape_from_hf(cfg: Mapping[str, Any], *, name: str) -> ModelShape:
    """Per-layer FLOPs, bytes and parameters (emulated at H200) of a normalised config.json
    (``hf_config.read_hf_config`` + ``normalize_hf_config``): its family's cost formulas.

    Raises:
        ValueError: an unsupported model_type (:func:`family_of`).
        KeyError: a field the formulas need is missing (its name).
    """
    return family_of(cfg.get("model_type")).model_shape(cfg, name=name)
