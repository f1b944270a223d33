"""Model shapes for the stage engines, and the cost-balanced layer split of a checkpoint.

A :class:`ModelConfig` describes a Llama-style decoder (RMSNorm, RoPE, grouped-query attention,
SwiGLU, no biases, untied ``lm_head``). It carries no weights: the torch engine builds seeded
random weights from it (see ``torch_engine.build_full_state_dict``) or loads local safetensors
with Hugging Face ``LlamaForCausalLM`` names.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import pydantic

from wavepp.runtime.families import FAMILIES

# NOTE: the most decoder layers a model may have (config.json's num_hidden_layers, and
# balanced_partition's input); the largest published models have ~130.
MAX_LAYERS = 1024


class ModelConfig(pydantic.BaseModel):
    """Shape of a Llama-style decoder (frozen).

    NOTE: ``hidden_size == num_heads * head_dim`` is not required (as in HF ``LlamaConfig``
    with an explicit ``head_dim``): q/k/v project ``hidden_size -> heads * head_dim`` and
    ``o_proj`` projects back.
    """

    model_config = pydantic.ConfigDict(frozen=True, extra="forbid")

    name: str = pydantic.Field(default="tiny-llama", min_length=1)
    # NOTE: the layer family, a ``model_type`` of the registry (``wavepp.runtime.families``);
    # anything but "llama" runs only from a checkpoint directory (RuntimeConfig.model_dir),
    # since random weights are generated for Llama only.
    architecture: str = "llama"
    # NOTE: cached values per token and layer, averaged over the layers, when the cache is not
    # GQA's K and V (MLA's latent, DSA's indexer keys, hybrids' attention-free layers); None:
    # 2 * num_kv_heads * head_dim. Set by ``hf_config`` from a checkpoint's config.json.
    kv_values_per_token_per_layer: float | None = pydantic.Field(default=None, ge=0)
    vocab_size: int = pydantic.Field(default=1024, gt=0)
    hidden_size: int = pydantic.Field(default=128, gt=0)
    intermediate_size: int = pydantic.Field(default=352, gt=0)
    num_layers: int = pydantic.Field(default=8, gt=0)
    num_heads: int = pydantic.Field(default=4, gt=0)
    num_kv_heads: int = pydantic.Field(default=2, gt=0)
    head_dim: int = pydantic.Field(default=32, gt=0)
    rope_theta: float = pydantic.Field(default=10000.0, gt=0)
    rms_norm_eps: float = pydantic.Field(default=1e-5, gt=0)
    max_position: int = pydantic.Field(default=131072, gt=0)
    seed: int = pydantic.Field(default=0, ge=0)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"

    @pydantic.field_validator("architecture")
    @classmethod
    def _check_architecture(cls, value: str) -> str:
        if value not in FAMILIES:
            raise ValueError(
                f"architecture={value!r} is not a model family; choose one of {sorted(FAMILIES)}"
            )
        return value

    @pydantic.model_validator(mode="after")
    def _check_shapes(self) -> ModelConfig:
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads} (grouped-query attention); "
                "choose num_kv_heads among the divisors of num_heads"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"head_dim={self.head_dim} must be even (RoPE rotates pairs of dimensions)"
            )
        return self

    def kv_bytes_per_token_per_layer(self) -> int:
        """KV cache bytes one token takes in one layer at ``dtype``: K and V for GQA, else
        ``kv_values_per_token_per_layer`` (rounded up; an average over the layers)."""
        elem_bytes = 4 if self.dtype == "float32" else 2
        if self.kv_values_per_token_per_layer is not None:
            return math.ceil(self.kv_values_per_token_per_layer * elem_bytes)
        return 2 * self.num_kv_heads * self.head_dim * elem_bytes

    def to_hf_llama_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``transformers.LlamaConfig`` describing the same model.

        Returns:
            A dict for ``LlamaConfig(**kwargs)`` (transformers 5.x names: ``rope_parameters``),
            untied embeddings, no attention/MLP biases, SiLU activation.
        """
        return {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
        }


PRESETS: dict[str, ModelConfig] = {
    "tiny-llama": ModelConfig(),
    "small-llama": ModelConfig(
        name="small-llama",
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=704,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        head_dim=32,
    ),
}


def get_preset(name: str) -> ModelConfig:
    """Return the preset model config called ``name``.

    Raises:
        ValueError: ``name`` is not a key of :data:`PRESETS`.
    """
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"model name={name!r} is not a preset; choose one of {sorted(PRESETS)}"
        ) from None


def balanced_partition(
    layer_costs: Sequence[float],
    num_stages: int,
    *,
    allowed_starts: Sequence[bool] | None = None,
    first_extra: float = 0.0,
    last_extra: float = 0.0,
) -> list[int]:
    """Contiguous layer counts per stage minimising the costliest stage.

    Exact (dynamic programming over split points, O(S N^2) comparisons, vectorised per stage:
    under a second at N = MAX_LAYERS, S = 64); ties go to the earliest split.

    Args:
        layer_costs: cost of each decoder layer (e.g. active parameters per token), >= 0;
            at most :data:`MAX_LAYERS` layers.
        num_stages: S, 1 <= S <= len(layer_costs).
        allowed_starts: per layer, whether a stage may begin there (None: everywhere); layer
            0 must be allowed.
        first_extra, last_extra: cost the first / last stage carries besides its layers
            (embedding, final norm and lm_head).

    Returns:
        Layer counts per stage (each >= 1, summing to the layer count).

    Raises:
        ValueError: more than MAX_LAYERS layers, S out of range, or no split satisfies
            ``allowed_starts`` (names them).
    """
    import numpy as np

    n = len(layer_costs)
    if n > MAX_LAYERS:
        raise ValueError(f"num_layers={n}: at most {MAX_LAYERS} layers are split into stages")
    if not 1 <= num_stages <= n:
        raise ValueError(f"num_stages={num_stages} must be in [1, num_layers={n}]")
    allowed = np.array(
        list(allowed_starts) if allowed_starts is not None else [True] * n, dtype=bool
    )
    prefix = [0.0]
    for cost in layer_costs:
        prefix.append(prefix[-1] + float(cost))
    pre = np.array(prefix)
    inf = float("inf")
    # best[j]: least max-stage cost covering layers [0, j) with s stages; arg[s][j]: where
    # the s-th stage begins. Stage s ends at j <= n - (S - s) (the later stages need a layer
    # each) and begins at i in [s - 1, j).
    best = np.full(n + 1, inf)
    best[0] = 0.0
    arg = np.full((num_stages + 1, n + 1), -1, dtype=np.int64)
    for s in range(1, num_stages + 1):
        ends = np.arange(s, n - (num_stages - s) + 1)
        starts = np.arange(s - 1, ends[-1])
        cost = pre[ends][None, :] - pre[starts][:, None]
        if s == 1:
            cost[starts == 0, :] += first_extra
        if s == num_stages:
            cost[:, ends == n] += last_extra
        value = np.maximum(best[starts][:, None], cost)
        usable = np.isfinite(best[starts]) & allowed[starts]
        value[~(usable[:, None] & (starts[:, None] < ends[None, :]))] = inf
        pick = np.argmin(value, axis=0)  # the first (earliest) minimum
        least = value[pick, np.arange(len(ends))]
        best = np.full(n + 1, inf)
        best[ends] = least
        arg[s, ends] = np.where(np.isfinite(least), starts[pick], -1)
    if best[n] == inf:
        starts_ok = [i for i, ok in enumerate(allowed) if ok]
        raise ValueError(
            f"num_stages={num_stages}: no split of {n} layers begins every stage at an "
            f"allowed layer ({starts_ok})"
        )
    counts: list[int] = []
    j = n
    for s in range(num_stages, 0, -1):
        i = int(arg[s, j])
        counts.append(j - i)
        j = i
    return counts[::-1]
