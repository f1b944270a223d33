"""How activations move between stages: ``RuntimeConfig.activation_backend``, the local
pipeline's choice for stages that share one GPU, and where the compute thread's activation
buffers live (no GPU needed: nothing here allocates on one)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
import torch
from hf_reference import PIPELINE_COST, small_llama

from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.serving.local import LocalPipeline
from wavepp.runtime.stage.worker import StageWorker

MODEL = small_llama("ab", seed=1, num_layers=2)


def _config(**fields: Any) -> RuntimeConfig:
    return RuntimeConfig(model=MODEL, num_stages=2, **fields)


def test_unset_follows_the_device_and_nccl_needs_cuda() -> None:
    assert _config().resolved_activation_backend == "gloo"
    assert _config(device="cuda").resolved_activation_backend == "nccl"
    assert _config(device="cuda", activation_backend="gloo").resolved_activation_backend == "gloo"
    with pytest.raises(ValueError, match="activation_backend='nccl' needs device cuda"):
        _config(activation_backend="nccl")


def test_a_local_pipeline_on_one_gpu_sends_activations_through_host_memory(
    tmp_path: Path,
) -> None:
    def backend(**fields: Any) -> str:
        pipeline = LocalPipeline(_config(**fields), PIPELINE_COST, log_dir=str(tmp_path))
        return pipeline.config.resolved_activation_backend

    assert backend(device="cuda") == "gloo"  # its stages share cuda:0: NCCL refuses that
    assert backend(device="cuda", activation_backend="nccl") == "nccl"  # asked for: kept
    assert backend() == "gloo"
    one = RuntimeConfig(model=MODEL, num_stages=1, device="cuda")
    assert LocalPipeline(one, PIPELINE_COST, log_dir=str(tmp_path)).config is one


@pytest.mark.parametrize(
    ("fields", "device"),
    [
        ({"device": "cuda"}, torch.device("cuda")),
        ({"device": "cuda", "activation_backend": "gloo"}, torch.device("cpu")),
        ({}, torch.device("cpu")),
    ],
)
def test_activation_buffers_live_on_the_group_device(
    fields: dict[str, Any], device: torch.device
) -> None:
    worker = StageWorker(_config(**fields), 1, cast(Any, None), cast(Any, None))
    assert worker.activation_device == device
