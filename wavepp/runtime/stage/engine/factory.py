"""Build a stage engine by kind. The one module that knows every concrete engine."""

from __future__ import annotations

from typing import Any, Literal

import torch

from wavepp.runtime.model_config import ModelConfig
from wavepp.runtime.stage.engine.base import StageEngine
from wavepp.runtime.stage.engine.checkpoint_engine import CheckpointStageEngine
from wavepp.runtime.stage.engine.emulated import EmulatedStageEngine
from wavepp.runtime.stage.engine.tensor_parallel import SINGLE, TPGroup
from wavepp.runtime.stage.engine.torch_engine import TorchStageEngine


def make_engine(
    kind: Literal["torch", "emulated"],
    *,
    model: ModelConfig,
    first_layer: int,
    last_layer: int,
    num_layers_total: int,
    device: torch.device | str = "cpu",
    cost_model: Any = None,
    tp: TPGroup = SINGLE,
    **kw: Any,
) -> StageEngine:
    """Build a stage engine for layers ``[first_layer, last_layer)``.

    Args:
        kind: ``"torch"`` (real layers) or ``"emulated"`` (sleeps the cost model's time).
        model: the model config.
        first_layer, last_layer: this stage's layer range.
        num_layers_total: layers of the whole model (decides is_last).
        device: torch device for tensors.
        cost_model: emulated only: an object with ``microbatch_cost_s(seq of (L, x)) -> s``;
            ignored by the torch engine.
        tp: this process's place in the stage's tensor-parallel group (torch only; the
            caller wraps the leader's engine in ``TensorParallelEngine``).
        **kw: torch: ``model_dir`` (a Hugging Face checkpoint directory: the checkpoint
            engine, any supported family; with ``state_interval_blocks``) or ``weights_path``
            (Llama tensors), ``compile`` and ``pack_weights``; emulated: ``time_scale``, ``emulated_hidden_size``,
            ``clock``, ``sleep``.

    Returns:
        The engine (its KV cache is allocated by ``allocate_kv``).

    Raises:
        ValueError: unknown kind, or the engine's own argument checks.
    """
    layers: dict[str, Any] = dict(
        model=model,
        first_layer=first_layer,
        last_layer=last_layer,
        num_layers_total=num_layers_total,
        device=device,
    )
    if kind == "torch" and kw.get("model_dir") is not None:
        return CheckpointStageEngine(**layers, model_dir=kw.pop("model_dir"), tp=tp, **kw)
    if kind == "torch":
        kw.pop("model_dir", None)
        kw.pop("state_interval_blocks", None)  # Llama layers keep no recurrent state
        if model.architecture != "llama":
            raise ValueError(
                f"model.architecture={model.architecture!r} needs model_dir (a checkpoint); "
                "random weights exist for llama only"
            )
        return TorchStageEngine(**layers, tp=tp, **kw)
    if kind == "emulated":
        if tp.size > 1:
            raise ValueError(
                f"tensor_parallel_size={tp.size}: the emulated engine computes nothing to "
                "shard (its cost model fixes the stage's time); use 1"
            )
        return EmulatedStageEngine(**layers, cost_model=cost_model, **kw)
    raise ValueError(f"kind={kind!r} is not an engine; choose 'torch' or 'emulated'")
