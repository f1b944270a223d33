"""What the engines honour, checked on the spec: the engine options and model keys the runtime
reads, the emulated models, tensor parallelism (torch only: one process per GPU, or T CPU
processes with gpusPerStage 0; no host KV tier), dtype per device, weights per engine.

Called by the spec's cross-field validation (``models``); every refusal is a :class:`SpecError`
naming the field.
"""

from __future__ import annotations

from typing import Any

from wavepp.api.spec.errors import SpecError

EMULATED_MODELS: tuple[str, ...] = (
    "glm-5.2",
    "minimax-m2.7",
    "kimi-k3",
    "deepseek-v3.2",
    "tiny-llama",
)
"""Cost models the emulated engine has (``engineOptions.emulate``, default ``model.name``).

NOTE: ``wavepp.runtime.planning.catalogue.list_models()``; api may not import runtime, a test
checks the two agree.
"""

ENGINE_OPTIONS: dict[str, tuple[str, ...]] = {
    "kvBlocks": ("torch", "emulated"),
    "maxInflight": ("torch", "emulated"),
    "returnMicrobatches": ("torch", "emulated"),
    "leaseSeconds": ("torch", "emulated"),
    "maxBlocksPerOwner": ("torch", "emulated"),
    "torchThreads": ("torch", "emulated"),
    "torchCompile": ("torch",),
    "packWeights": ("torch",),
    "pinCores": ("torch", "emulated"),
    "seed": ("torch",),
    "timeScale": ("emulated",),
    "emulate": ("emulated",),
}
"""The ``engineOptions`` keys the runtime reads (``launch.runtime_config``) and the engines
that read them; any other key, or a key for another engine, is refused."""

MODEL_CONFIG_EXTRA: tuple[str, ...] = ("ropeTheta", "rmsNormEps", "maxPosition")
"""``model.config`` keys beyond the typed fields that the torch engine reads (ModelConfig's
``rope_theta``, ``rms_norm_eps``, ``max_position``); any other key is refused."""


def check_engine(spec: Any) -> None:
    """What the engines honour: TP size, dtype per device, weights, engineOptions keys.

    Args:
        spec: a ``WavePipelineSpec`` being validated (not imported here: ``models`` imports
            this module).

    Raises:
        SpecError: the first field the runtime would not honour.
    """
    tp = spec.tensor_parallel_size
    if tp != 1 and spec.engine != "torch":
        raise SpecError(
            "tensorParallelSize",
            f"{tp}: tensor parallelism is implemented for the torch engine only (the emulated "
            "engine computes nothing to shard); use 1",
        )
    if tp != 1 and spec.cache.host_memory_gib > 0:
        raise SpecError(
            "cache.hostMemoryGiB",
            f"{spec.cache.host_memory_gib:g} with tensorParallelSize={tp}: a host KV tier runs "
            "on stages of one process; use 0 or tensorParallelSize 1",
        )
    gpus = spec.gpus_per_stage()
    if spec.engine == "torch" and gpus > tp:
        raise SpecError(
            "resources.gpusPerStage",
            f"{gpus}: a torch stage uses one GPU per tensor-parallel process "
            f"(tensorParallelSize={tp}); use 0 (CPU) or {tp}",
        )
    dtype = spec.model.dtype
    if spec.engine == "emulated":
        for field, value in (
            ("model.dtype", dtype),
            ("model.path", spec.model.path),
            ("model.pvc", spec.model.pvc),
        ):
            if value is not None:
                raise SpecError(
                    field,
                    "the emulated engine computes nothing and loads no weights (its cost model "
                    "fixes the precision); leave it unset or use engine: torch",
                )
    elif gpus == 0 and dtype not in (None, "float32"):
        raise SpecError(
            "model.dtype",
            f"{dtype!r} needs a GPU: resources.gpusPerStage is 0 and the torch engine computes "
            "in float32 on the CPU; use float32 or request GPUs",
        )
    if "seed" in spec.engine_options and (spec.model.path or spec.model.pvc):
        raise SpecError(
            "engineOptions.seed",
            "seeds the torch engine's random weights; model.path/pvc serves a checkpoint's "
            "weights instead: leave it unset",
        )
    for key in spec.engine_options:
        engines = ENGINE_OPTIONS.get(key)
        if engines is None:
            hint = " (the device follows resources.gpusPerStage)" if key == "device" else ""
            raise SpecError(
                f"engineOptions.{key}",
                f"unknown option{hint}; known: {', '.join(sorted(ENGINE_OPTIONS))}",
            )
        if spec.engine not in engines:
            raise SpecError(
                f"engineOptions.{key}", f"not read by engine {spec.engine!r}; only by {engines}"
            )
    if spec.engine == "emulated":
        emulate = str(spec.engine_options.get("emulate", spec.model.name))
        if emulate not in EMULATED_MODELS:
            raise SpecError(
                "engineOptions.emulate",
                f"{emulate!r} has no cost model; choose one of {list(EMULATED_MODELS)}",
            )
    extra = (spec.model.config.model_extra or {}) if spec.model.config is not None else {}
    for key in extra:
        if key not in MODEL_CONFIG_EXTRA:
            raise SpecError(
                f"model.config.{key}",
                f"not a model setting the engine reads; known beyond the typed fields: "
                f"{', '.join(MODEL_CONFIG_EXTRA)}",
            )
