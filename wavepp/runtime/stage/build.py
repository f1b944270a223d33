"""Building a stage process's engine from its RuntimeConfig, and the checks before it.

``build_engine`` is shared by the stage worker (TP rank 0) and its tensor-parallel followers
(``tp_launch``); neither needs NATS here.
"""

from __future__ import annotations

import os

import torch

from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.stage.engine import StageEngine, make_engine
from wavepp.runtime.stage.engine.tensor_parallel import SINGLE, TPGroup, tp_device


def check_environment(config: RuntimeConfig) -> None:
    """Refuse to start where the config cannot be honoured: CUDA asked for (the pod was given
    GPUs) but absent, or weights that are not there.

    Raises:
        ValueError: naming the spec field (``resources.gpusPerStage``, ``model.path``).
    """
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(
            f"spec.resources.gpusPerStage > 0: this stage computes on {config.device}, but torch "
            f"{torch.__version__} (CUDA build {torch.version.cuda}) sees no CUDA device; give "
            "the pod a GPU or set resources.gpusPerStage: 0 (CPU)"
        )
    last = tp_device(config.device, config.tensor_parallel_size - 1)
    if last.startswith("cuda") and int(last.split(":")[1]) >= torch.cuda.device_count():
        raise ValueError(
            f"spec.tensorParallelSize={config.tensor_parallel_size}: one GPU per process from "
            f"{config.device}, but torch sees {torch.cuda.device_count()} CUDA device(s); give "
            "the pod that many GPUs"
        )
    if config.weights is not None and not os.path.exists(config.weights):
        raise ValueError(
            f"spec.model.path: {config.weights!r} does not exist in the container (check the "
            "PVC, its subPath and mountPath)"
        )
    if config.model_dir is not None and not os.path.isdir(config.model_dir):
        raise ValueError(
            f"model_dir: {config.model_dir!r} is not a directory in the container (--model)"
        )


def build_engine(config: RuntimeConfig, rank: int, tp: TPGroup = SINGLE) -> StageEngine:
    """The stage's engine for its layer range (torch or emulated), with its KV and host tier
    (``num_host_kv_blocks``) allocated;
    the torch engine reads ``config.model_dir`` (a checkpoint, any family) or loads
    ``config.weights`` (Llama safetensors) when set (the config refuses both). With a TP
    group, this process's shard on its own device (``tp_device``); the caller wraps the
    leader's in ``TensorParallelEngine``."""
    first, last = config.layers_of(rank)
    cost_model = None
    extra: dict[str, object] = {}
    if config.engine == "emulated":
        from wavepp.runtime.planning import CostModel

        cost_model = CostModel.from_dict(config.cost_model or {})
        extra["time_scale"] = config.time_scale
        extra["host_load_s_per_block"] = config.host_load_s_of(rank)
    elif config.model_dir is not None:
        extra["model_dir"] = config.model_dir
        extra["state_interval_blocks"] = config.state_interval_blocks
    elif config.weights is not None:
        extra["weights_path"] = config.weights
    if config.torch_compile:
        extra["compile"] = True
    if config.engine == "torch":
        extra["pack_weights"] = config.pack_weights
    engine = make_engine(
        config.engine,
        model=config.model,
        first_layer=first,
        last_layer=last,
        num_layers_total=config.model.num_layers,
        device=tp_device(config.device, tp.rank),
        cost_model=cost_model,
        tp=tp,
        **extra,
    )
    engine.allocate_kv(config.kv_blocks_of(rank), config.block_size)
    engine.allocate_host_kv(config.host_kv_blocks_of(rank))
    return engine
