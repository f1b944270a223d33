"""WavePipeline spec -> the RuntimeConfig of each pipeline replica (``wavepp up``, pods).

The spec (``wavepp.api.spec.WavePipelineSpec``) is the operator's and ``wavepp up``'s single
source of truth; this module is the one place that turns it into what the runtime's processes
read. The api layer may not import the runtime, hence this lives here.

``spec.engineOptions`` (free-form in the CRD) is read for runtime knobs the spec has no field for:

| key            | meaning                                                       | default            |
| -------------- | ------------------------------------------------------------- | ------------------ |
| ``kvBlocks``   | KV capacity per stage in blocks: int, or one per stage        | see below          |
| ``timeScale``  | emulated engine: sleep multiplier                             | 1.0                |
| ``emulate``    | emulated engine: cost model name (``wavepp.runtime.planning.catalogue``) | model.name      |
| ``torchThreads`` | torch threads per stage                                     | 1                  |
| ``seed``       | weight seed of the torch engine                               | 0                  |
| ``maxInflight`` | micro-batches in flight                                      | S                  |
| ``leaseSeconds`` | pin and reservation lease                                   | 30                 |

KV capacity, first that applies: ``cache.memoryPerStageBytes`` over the KV bytes of the stage's
layers; ``engineOptions.kvBlocks``; for the emulated engine, derived per stage from the emulated
model and device (``wavepp.runtime.planning.memory.default_kv_blocks``: H200 memory x 0.9 minus
the stage's weights and the activations of the largest micro-batch, over the KV bytes per token
of its layers; 4096 for tiny-llama); otherwise (torch engine) 4096.

The device follows the pod's resources: ``cuda`` when ``resources.gpusPerStage`` > 0 (torch),
else ``cpu``; the dtype is ``model.dtype`` (default bfloat16 on CUDA, float32 on the CPU; the
spec check refuses another dtype on the CPU); the weights are ``model.path`` (or the PVC's mount
path). Keys other than those above are refused by the spec check (``wavepp.api.spec``).
"""

from __future__ import annotations

from typing import Any

from wavepp.api.spec import SpecError, WavePipelineSpec
from wavepp.api.subjects import replica_pipeline_name
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.model_config import PRESETS, ModelConfig
from wavepp.runtime.planning.catalogue import ModelSpec, derived_cost_model, list_models
from wavepp.runtime.planning.memory import FIXED_KV_BLOCKS, default_kv_blocks

__all__ = [
    "default_emulated_kv_blocks",
    "stage_device",
    "stage_weights",
    "model_config_from_spec",
    "replica_pipeline_name",
    "runtime_configs_from_spec",
]

_MODEL_FIELDS = (
    "num_layers",
    "hidden_size",
    "intermediate_size",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "vocab_size",
)


def model_config_from_spec(spec: WavePipelineSpec) -> ModelConfig:
    """The engine's ModelConfig: the preset of ``model.name`` (if any) with ``model.config``
    fields laid over it, and ``model.dtype`` (unset: bfloat16 when the stages get GPUs, float32
    on the CPU).

    Raises:
        SpecError: the layer count is unknown, or the shape is invalid (names the field).
    """
    base = PRESETS.get(spec.model.name, ModelConfig(name=spec.model.name))
    update: dict[str, Any] = {"name": spec.model.name, "num_layers": spec.num_layers()}
    if spec.model.config is not None:
        for name in _MODEL_FIELDS:
            value = getattr(spec.model.config, name)
            if value is not None:
                update[name] = value
        for key, value in (spec.model.config.model_extra or {}).items():
            snake = "".join("_" + c.lower() if c.isupper() else c for c in key)
            if snake in ModelConfig.model_fields:
                update[snake] = value
    update["dtype"] = spec.model.dtype or (
        "bfloat16" if stage_device(spec) == "cuda" else "float32"
    )
    seed = spec.engine_options.get("seed")
    if seed is not None:
        update["seed"] = int(seed)
    try:
        return ModelConfig.model_validate({**base.model_dump(), **update})
    except ValueError as exc:
        raise SpecError("model.config", str(exc)) from exc


def stage_device(spec: WavePipelineSpec) -> str:
    """``cuda`` for a torch stage given GPUs (``resources.gpusPerStage`` > 0), else ``cpu``: a
    pod computes where its resources are (``wavepp stage`` refuses to start on ``cuda``
    without CUDA)."""
    return "cuda" if spec.engine == "torch" and spec.gpus_per_stage() > 0 else "cpu"


def stage_weights(spec: WavePipelineSpec) -> str | None:
    """The torch engine's weights: ``model.path``, else the PVC's mount path, else None."""
    if spec.model.path is not None:
        return spec.model.path
    return spec.model.pvc.mount_path if spec.model.pvc is not None else None


def default_emulated_kv_blocks(
    config: RuntimeConfig, emulate: str | ModelSpec
) -> tuple[list[int], str]:
    """The emulated engine's KV capacity when none is given: derived per stage from the
    emulated model and device (``planning.memory.default_kv_blocks``) for ``config``'s stages,
    block size and largest micro-batch.

    Args:
        config: the replica's config (num_stages, block_size, the largest micro-batch).
        emulate: the emulated model's name (``catalogue.list_models()``) or its ModelSpec.

    Returns:
        (blocks per stage, a one-line source to show the user).

    Raises:
        ValueError: the model's weights fit no stage (names model, stages, memory needed).
    """
    # NOTE: the activation workspace is sized for the engine's largest micro-batch: the
    # larger of max_microbatch_tokens and chunk_tokens (the static policy's budget).
    return default_kv_blocks(
        emulate,
        num_stages=config.num_stages,
        block_size=config.block_size,
        max_microbatch_tokens=max(config.max_microbatch_tokens, config.chunk_tokens),
    )


def _kv_blocks(spec: WavePipelineSpec, model: ModelConfig, emulate: str | None) -> list[int] | None:
    """Explicit capacity (memoryPerStageBytes, kvBlocks); None: the emulated engine's default
    (``default_emulated_kv_blocks``); FIXED_KV_BLOCKS for the torch engine."""
    if spec.cache.memory_per_stage_bytes is not None:
        blocks = []
        for first, last in spec.stage_layer_ranges():
            block_bytes = (
                (last - first) * model.kv_bytes_per_token_per_layer() * spec.cache.block_size
            )
            blocks.append(max(1, spec.cache.memory_per_stage_bytes // block_bytes))
        return blocks
    raw = spec.engine_options.get("kvBlocks")
    if raw is None and emulate is not None:
        return None
    if raw is None:
        raw = FIXED_KV_BLOCKS
    values = raw if isinstance(raw, list) else [raw]
    try:
        return [int(v) for v in values]
    except (TypeError, ValueError):
        raise SpecError("engineOptions.kvBlocks", f"{raw!r}: give an int or a list") from None


def runtime_configs_from_spec(
    spec: WavePipelineSpec, *, pool: str, namespace: str = "local"
) -> list[RuntimeConfig]:
    """One RuntimeConfig per replica (``spec.replicas``; at least one), pipeline names
    ``{pool}-r{i}``.

    Args:
        spec: a validated WavePipelineSpec.
        pool: the pool's name (the custom resource's name; ``wavepp up --name``).
        namespace: the pool's Kubernetes namespace (``$WAVEPP_NAMESPACE``; "local" for
            ``wavepp up``): part of every NATS subject, stream and bucket name.

    Returns:
        ``max(1, spec.replicas)`` configs that differ only in ``pipeline``.

    Raises:
        SpecError: a value the runtime cannot run (an unknown emulated cost model, a bad
            kvBlocks or model shape), naming the field.
    """
    model = model_config_from_spec(spec)
    options = spec.engine_options
    cost_model = None
    emulate: str | None = None
    if spec.engine == "emulated":
        emulate = str(options.get("emulate", spec.model.name))
        if emulate not in list_models():
            raise SpecError(
                "engineOptions.emulate",
                f"{emulate!r} has no cost model; choose one of {list_models()}",
            )
        cost_model = derived_cost_model(emulate, num_stages=spec.num_stages).to_dict()
    base: dict[str, Any] = {
        "model": model,
        "engine": spec.engine,
        "cost_model": cost_model,
        "time_scale": float(options.get("timeScale", 1.0)),
        "num_stages": spec.num_stages,
        "tensor_parallel_size": spec.tensor_parallel_size,
        "partition": spec.layer_partition,
        "block_size": spec.cache.block_size,
        "num_kv_blocks": _kv_blocks(spec, model, emulate),
        "mode": spec.scheduler.mode,
        "chunk_tokens": spec.scheduler.chunk_tokens,
        "chunk_policy": spec.scheduler.chunk_policy,
        "device": stage_device(spec),
        "weights": stage_weights(spec) if spec.engine == "torch" else None,
        "namespace": namespace,
        "torch_threads": int(options.get("torchThreads", 1)),
        "max_inflight": options.get("maxInflight"),
        "lease_s": float(options.get("leaseSeconds", 30.0)),
    }
    if base["num_kv_blocks"] is None:
        assert emulate is not None, "only the emulated engine derives its KV capacity"
        try:
            probe = RuntimeConfig(**(base | {"num_kv_blocks": [FIXED_KV_BLOCKS]}))
            base["num_kv_blocks"], _source = default_emulated_kv_blocks(probe, emulate)
        except ValueError as exc:
            raise SpecError("engineOptions.kvBlocks", f"unset, and its default: {exc}") from None
    configs = []
    for replica in range(max(1, spec.num_replicas)):
        try:
            configs.append(RuntimeConfig(pipeline=replica_pipeline_name(pool, replica), **base))
        except ValueError as exc:
            raise SpecError("engineOptions", str(exc)) from exc
    return configs
