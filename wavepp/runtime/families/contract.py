"""The contract every model family fulfils: :class:`ModelFamily`.

A family is one Hugging Face ``model_type``. Its entry in ``families.FAMILIES`` answers everything
the runtime asks about it:

- ``aliases``: the ``config.json`` field names transformers may write under an ``attribute_map``
  name, mapped to the canonical names the readers use (``hf_config.normalize_hf_config``);
- :meth:`ModelFamily.attention` -> :class:`AttentionShape`: the generic attention shape and KV
  bytes of ``ModelConfig`` (``hf_config.model_config_from_hf``: the scheduler, KV manager, block
  hashing and the spec checks);
- :meth:`ModelFamily.layer_plan` -> ``LayerPlan``: what each decoder layer runs (the torch
  engine, the cost-balanced layer split);
- ``tensor_parallel``: whether its layers shard over a stage's tensor-parallel group
  (``RuntimeConfig`` refuses T > 1 otherwise);
- :meth:`ModelFamily.model_shape` -> ``ModelShape``: per-layer FLOPs, bytes and parameters for
  the planner's catalogue (``wavepp replay --engine emulated --emulate DIR``).

Every method takes the parsed, checked (``hf_config.check_hf_fields``) and normalised config
dict. Pure: no torch, no I/O.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from wavepp.runtime.families.layer_plan import LayerPlan
from wavepp.runtime.planning.shapes import ModelShape


@dataclass(frozen=True)
class AttentionShape:
    """The attention as the cost model and the KV manager see it.

    Attributes:
        num_heads: query heads H.
        num_kv_heads: K/V heads (GQA); H for MLA, whose cache is the latent.
        head_dim: query/key width per head (``qk_nope + qk_rope`` for MLA).
        kv_values_per_token_per_layer: cached values per token and layer, averaged over the
            layers, when the cache is not GQA's K and V; None: ``2 * num_kv_heads * head_dim``.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    kv_values_per_token_per_layer: float | None = None


class ModelFamily(ABC):
    """One ``model_type``: its config reader, layer plan, TP support and cost formulas.

    Attributes:
        model_type: the Hugging Face ``model_type`` (the key in ``FAMILIES``).
        summary: the family's layers in a few words (docs and error messages).
        aliases: ``config.json`` name -> canonical name (transformers' ``attribute_map``).
        tensor_parallel: its layers shard over a stage's tensor-parallel group.
        recurrent_state: some layers carry a recurrent state that only moves forward (a chunk
            cannot be computed again at a position the state has passed: ``wavepp calibrate``
            refuses such a family).
    """

    model_type: ClassVar[str]
    summary: ClassVar[str]
    aliases: ClassVar[Mapping[str, str]] = {}
    tensor_parallel: ClassVar[bool]
    recurrent_state: ClassVar[bool] = False

    @abstractmethod
    def attention(self, cfg: Mapping[str, Any], where: str) -> AttentionShape:
        """The generic attention shape of a normalised config.

        Raises:
            ValueError: a field the family needs is missing (named, with ``where``).
        """

    @abstractmethod
    def layer_plan(self, cfg: Mapping[str, Any]) -> LayerPlan:
        """What each decoder layer runs.

        Raises:
            ValueError: a field outside what the layers implement (named).
            KeyError: a field the family needs is missing (its name).
        """

    @abstractmethod
    def model_shape(self, cfg: Mapping[str, Any], *, name: str) -> ModelShape:
        """Per-layer FLOPs, bytes and parameters at H200 (``planning.from_config``'s formulas).

        Raises:
            KeyError: a field the formulas need is missing (its name).
        """


def required(cfg: Mapping[str, Any], key: str, where: str) -> Any:
    """``cfg[key]``, or ValueError naming the field and the family when it is absent or null."""
    if cfg.get(key) is None:
        raise ValueError(
            f"{where}: field {key!r} is missing; a {cfg.get('model_type')} config needs it"
        )
    return cfg[key]


def per_layer(cfg: Mapping[str, Any], key: str, num_layers: int) -> list[str]:
    """A per-layer type list (``layer_types``, ``mlp_layer_types``, ``indexer_types``).

    Raises:
        ValueError: not one entry per layer (names the field and ``num_hidden_layers``).
    """
    values = list(cfg[key])
    if len(values) != num_layers:
        raise ValueError(
            f"{key} has {len(values)} entries; it needs one per layer "
            f"(num_hidden_layers={num_layers})"
        )
    return [str(v) for v in values]
