"""A two-stage replica on the emulated engine, and a process group whose peer is gone: what the
stage health and readiness tests start a stage with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from wavepp.api.messages import MicroBatchPlan, PlannedChunk
from wavepp.api.spec import check_spec
from wavepp.launch.runtime_config import runtime_configs_from_spec
from wavepp.runtime.config import RuntimeConfig


def emulated_two_stages(pool: str, nats_url: str = "nats://unused:4222") -> RuntimeConfig:
    """The replica's configuration (tiny-llama, 2 emulated stages, 64 KV blocks, time scale
    0.01) from a checked spec, in namespace ``t``."""
    raw = {
        "model": {"name": "tiny-llama"},
        "engine": "emulated",
        "stages": 2,
        "engineOptions": {"kvBlocks": 64, "timeScale": 0.01},
    }
    spec, issues = check_spec(raw, default_image="i", default_nats_url=nats_url)
    assert spec is not None, issues
    return runtime_configs_from_spec(spec, pool=pool, namespace="t")[0]


class LostPeerGroup:
    """A process group whose peer is gone: its receive raises (as gloo's does)."""

    def recv(self, tensors, src, tag):  # noqa: ANN001, ANN201
        raise RuntimeError(f"Connection closed by peer (rank {src})")


def one_token_plan() -> MicroBatchPlan:
    """Micro-batch 0 of epoch ``e1``: one two-token request, its last chunk."""
    chunk = PlannedChunk(
        request_id="r", chunk_index=0, context_offset=0, token_ids=[1, 2], is_last=True
    )
    return MicroBatchPlan(microbatch_id=0, epoch="e1", chunks=[chunk])


def checkpoint_engines(model_dir: Path, partition: list[int], **options: Any) -> list[Any]:  # noqa: ANN401
    """Torch stage engines of the checkpoint in ``model_dir``, ``partition[i]`` layers on stage
    i, each made with ``options`` (``make_engine``'s keyword arguments)."""
    from wavepp.api.layer_split import split_layers
    from wavepp.runtime.hf_config import load_model_dir
    from wavepp.runtime.stage.engine import make_engine

    model = load_model_dir(model_dir)
    return [
        make_engine(
            "torch",
            model=model,
            first_layer=first,
            last_layer=last,
            num_layers_total=model.num_layers,
            model_dir=model_dir,
            **options,
        )
        for first, last in split_layers(model.num_layers, len(partition), partition)
    ]
