"""A checkpoint's per-layer cost and the stage split that balances it.

Cost of a layer = the parameters one token multiplies through it (active parameters: all of
its tensors except routed experts, plus ``top_k / num_experts`` of those), read from the
safetensors headers (no tensor data). Linear FLOPs per token are twice that, so equal active
parameters per stage means equal linear prefill compute per stage; the attention-score term
(which grows with context) is not counted. MoE layers and dense first layers differ by several
times in this cost (a DeepSeek-V3 MoE layer: ~0.6 G active, a dense one ~0.4 G), so a split by
layer count is unbalanced where a split by cost is not. The embedding costs no FLOPs (a
gather) and is not charged. ``lm_head`` runs for one token per request (the last prompt token's
logits), so per prompt token it costs ``vocab_size x hidden_size / L`` for a prompt of L tokens;
the split charges it to the last stage at ``L = HEAD_PROMPT_TOKENS``. Charged per token instead
(as if every token went through it), a head of 32,000 x 512 weighs as much as five decoder
layers of hidden 512 and leaves a 2-stage split of 8 such layers at [7, 1].
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from wavepp.runtime.families import LayerPlan
from wavepp.runtime.hf_config import layer_plan_from_hf, read_hf_config
from wavepp.runtime.model_config import balanced_partition
from wavepp.runtime.stage.engine.checkpoint import CheckpointReader

HEAD_PROMPT_TOKENS = 512
"""The prompt length over which the split spreads ``lm_head``'s one row per request. Past a few
dozen tokens the head weighs a small fraction of a decoder layer in every supported family
(about vocab / (12 x hidden x L) of a dense layer), so the split does not depend on this value
for real prompts; a fixed value keeps the split the same in every process of a replica."""

_EXPERT = re.compile(r"^model\.layers\.(\d{1,9})\..*\.experts\.\d+\.")
_LAYER = re.compile(r"^model\.layers\.(\d{1,9})\.")


def layer_active_params(model_dir: str | os.PathLike[str]) -> tuple[list[float], LayerPlan]:
    """Active parameters per token of each decoder layer, and the layer plan.

    Reads config.json (fields checked and bounded by ``read_hf_config``) and the safetensors
    headers (no tensor data).

    Raises:
        ValueError: unreadable directory, config or shard (see ``CheckpointReader``,
            ``read_hf_config``), or a field the family needs missing (names it).
    """
    cfg = read_hf_config(model_dir)
    try:
        plan = layer_plan_from_hf(cfg)
    except KeyError as exc:
        raise ValueError(
            f"{Path(model_dir) / 'config.json'}: field {exc.args[0]!r} is missing; a "
            f"{cfg.get('model_type')} config needs it"
        ) from None
    reader = CheckpointReader(model_dir)
    dense = [0.0] * plan.num_layers
    experts = [0.0] * plan.num_layers
    for _file, shapes in reader.shard_shapes():
        for name, (shape, _dtype) in shapes.items():
            m = _LAYER.match(name)
            if not m or int(m.group(1)) >= plan.num_layers:
                continue
            numel = 1
            for dim in shape:
                numel *= dim
            target = experts if _EXPERT.match(name) else dense
            target[int(m.group(1))] += numel
    share = plan.moe.top_k / plan.moe.num_experts if plan.moe is not None else 0.0
    return [d + share * e for d, e in zip(dense, experts, strict=True)], plan


def checkpoint_partition(model_dir: str | os.PathLike[str], num_stages: int) -> list[int]:
    """Layer counts per stage balancing active parameters per prompt token (lm_head on the last
    stage, one row per ``HEAD_PROMPT_TOKENS`` prompt tokens),
    beginning every stage where the family allows (a DSA 'full' indexer layer for GLM-5).

    Cost: O(S L^2) comparisons over L <= MAX_LAYERS layers (``read_hf_config`` bounds
    num_hidden_layers), under a second.

    Raises:
        ValueError: S out of range or no allowed split (names them), or as
            :func:`layer_active_params`.
    """
    costs, plan = layer_active_params(model_dir)
    allowed = None
    if plan.dsa is not None:
        allowed = list(plan.indexer_full)
    return balanced_partition(
        costs,
        num_stages,
        allowed_starts=allowed,
        last_extra=float(plan.vocab_size * plan.hidden_size) / HEAD_PROMPT_TOKENS,
    )
