"""WavePipeline spec -> the RuntimeConfig of each pipeline replica (``wavepp up``, pods).

The spec (``wavepp.api.spec.WavePipelineSpec``) is the operator's and ``wavepp up``'s single
source of truth; this module turns it into the RuntimeConfig every replica's process reads
(the rest of each process's configuration is resolved beside it, in ``wavepp.launch``).

``spec.engineOptions`` (free-form in the CRD) is read for runtime knobs the spec has no field for:

| key            | meaning                                                       | default            |
| -------------- | ------------------------------------------------------------- | ------------------ |
| ``kvBlocks``   | KV capacity per stage in blocks: int, or one per stage        | see below          |
| ``timeScale``  | emulated engine: sleep multiplier                             | 1.0                |
| ``emulate``    | emulated engine: cost model name (``wavepp.runtime.planning.catalogue``) | model.name      |
| ``torchThreads`` | torch threads per stage                                     | 1                  |
| ``seed``       | weight seed of the torch engine                               | 0                  |
| ``maxInflight`` | micro-batches in flight                                      | S + returnMicrobatches |
| ``returnMicrobatches`` | micro-batch times the closed-loop target counts for a round's way back (``RuntimeConfig.return_microbatches``) | ``SERVED_RETURN_MICROBATCHES`` (1) |
| ``leaseSeconds`` | pin and reservation lease                                   | 30                 |
| ``maxBlocksPerOwner`` | KV blocks one admission instance may hold on a stage    | the whole pool     |

KV capacity (``launch.capacity.replica_capacity``, as ``wavepp sim`` and ``wavepp replay``),
first that applies: ``cache.memoryPerStageBytes`` over the KV bytes of the stage's layers;
``engineOptions.kvBlocks``; for the emulated engine, derived per stage from the emulated model
and device (H200 memory x 0.9 minus the stage's weights and the activations of the largest
micro-batch, over the KV bytes per token of its layers; 4096 for tiny-llama); otherwise (torch
engine) 4096. Host KV tier (``cache.hostMemoryGiB`` per GPU; 0: none): each stage's tier in
blocks and its load time per block, from the emulated model's catalogue figures or the served
model's KV bytes per token per layer x the stage's layers; an amount that holds no block of a
stage is refused naming the field.

The device follows the pod's resources: ``cuda`` when ``resources.gpusPerStage`` > 0 (torch),
else ``cpu``; the dtype is ``model.dtype`` (default bfloat16 on CUDA, float32 on the CPU; the
spec check refuses another dtype on the CPU). Keys other than those above are refused by the
spec check (``wavepp.api.spec``).

Checkpoints: ``model.path`` (or, unset, the PVC's ``mountPath``) names a Hugging Face checkpoint
directory (``config.json`` + safetensors, any family of ``hf_config``), read by every process
that builds a config from the spec (stage, admission, gateway, ``wavepp up``, ``wavepp
validate``): it becomes ``RuntimeConfig.model_dir``, the model's shape and architecture come
from its config.json (a ``model.config`` field or a preset's layer count that disagrees is
refused naming the field; ``model.name`` stays the served name), and without
``layerPartition`` the layers are split by active parameters per stage
(``engine.balance.checkpoint_partition``, the same split ``wavepp stage --model`` and
``wavepp replay --model DIR`` make: :class:`ServedCheckpoint` reads a served checkpoint for all
of them, :func:`with_checkpoint` lays one over a RuntimeConfig). A path
without config.json is refused (a spec serves a checkpoint with its own shape, never
``RuntimeConfig.weights``, Llama safetensors shaped by the spec).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from wavepp.api.layer_split import split_layers
from wavepp.api.spec import MODEL_PRESET_NUM_LAYERS, SpecError, WavePipelineSpec
from wavepp.api.subjects import replica_pipeline_name
from wavepp.launch.capacity import SPEC_FIELDS, CapacityError, replica_capacity
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.hf_config import load_model_dir, normalize_hf_config, read_hf_config
from wavepp.runtime.model_config import PRESETS, ModelConfig
from wavepp.runtime.planning.catalogue import derived_cost_model, list_models
from wavepp.runtime.planning.memory import FIXED_KV_BLOCKS

# NOTE: a served replica's finished requests come back through their clients, the gateway and
# the JetStream intake before they are agreed and planned again: the closed-loop target counts
# that way back as one micro-batch time (RuntimeConfig.return_microbatches; docs/bench/engine.md
# measures it), unless engineOptions.returnMicrobatches says otherwise.
SERVED_RETURN_MICROBATCHES = 1

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
    update["dtype"] = _dtype(spec)
    seed = spec.engine_options.get("seed")
    if seed is not None:
        update["seed"] = int(seed)
    try:
        return ModelConfig.model_validate({**base.model_dump(), **update})
    except ValueError as exc:
        raise SpecError("model.config", str(exc)) from exc


def _dtype(spec: WavePipelineSpec) -> str:
    """``model.dtype``; unset: bfloat16 when the stages get GPUs, float32 on the CPU."""
    return spec.model.dtype or ("bfloat16" if stage_device(spec) == "cuda" else "float32")


def stage_device(spec: WavePipelineSpec) -> str:
    """``cuda`` for a torch stage given GPUs (``resources.gpusPerStage`` > 0), else ``cpu``: a
    pod computes where its resources are (``wavepp stage`` refuses to start on ``cuda``
    without CUDA)."""
    return "cuda" if spec.engine == "torch" and spec.gpus_per_stage() > 0 else "cpu"


@dataclass(frozen=True)
class ServedCheckpoint:
    """A Hugging Face checkpoint directory a replica serves, read once.

    Attributes:
        model_dir: the directory, absolute (``RuntimeConfig.model_dir``).
        model: its ModelConfig from config.json (``hf_config.load_model_dir``: shape,
            architecture, named ``<dir name>-<sha8>``).
    """

    model_dir: str
    model: ModelConfig

    @classmethod
    def read(cls, model_dir: str) -> ServedCheckpoint:
        """Raises:
        ValueError: a missing or unsupported config.json (names the field)."""
        return cls(str(Path(model_dir).resolve()), load_model_dir(model_dir))

    def partition(self, num_stages: int, stated: list[int] | None = None) -> list[int]:
        """Layer counts per stage: ``stated`` when given, else the layers split by active
        parameters per stage (``engine.balance.checkpoint_partition``, imported only here: it
        imports torch), the same in every process of a replica.

        Raises:
            ValueError: ``num_stages`` the checkpoint's layers cannot split, or a shard
                unreadable (names it).
        """
        if stated is not None:
            return stated
        from wavepp.runtime.stage.engine.balance import checkpoint_partition

        return checkpoint_partition(self.model_dir, num_stages)


def with_checkpoint(config: RuntimeConfig, model_dir: str) -> RuntimeConfig:
    """``config`` serving the checkpoint in ``model_dir`` (:class:`ServedCheckpoint`): its
    model from config.json (keeping ``config``'s dtype and seed), ``model_dir`` set, and the
    partition ``config``'s, else split by active parameters; validated together.

    Raises:
        ValueError: a bad directory, config.json or split, or a config the checkpoint cannot
            run (e.g. a family without tensor parallelism), naming the field.
    """
    checkpoint = ServedCheckpoint.read(model_dir)
    model = checkpoint.model.model_copy(
        update={"dtype": config.model.dtype, "seed": config.model.seed}
    )
    return RuntimeConfig.model_validate(
        config.model_dump()
        | {
            "model": model.model_dump(),
            "model_dir": checkpoint.model_dir,
            "partition": checkpoint.partition(config.num_stages, config.partition),
        }
    )


def checkpoint_dir(spec: WavePipelineSpec) -> str | None:
    """The checkpoint directory the torch engine serves: ``model.path``, else the PVC's mount
    path; None: seeded random Llama weights (always None for the emulated engine)."""
    if spec.engine != "torch":
        return None
    if spec.model.path is not None:
        return spec.model.path
    return spec.model.pvc.mount_path if spec.model.pvc is not None else None


def _checkpoint_field(spec: WavePipelineSpec) -> str:
    return "model.path" if spec.model.path is not None else "model.pvc.mountPath"


def checkpoint_tokenizer(spec: WavePipelineSpec) -> str | None:
    """The checkpoint directory when it holds a ``tokenizer.json`` (the gateway's tokenizer for
    text prompts), else None."""
    path = checkpoint_dir(spec)
    if path is None or not (Path(path) / "tokenizer.json").is_file():
        return None
    return str(Path(path).resolve())


_CHECKED_FIELDS = {
    "num_layers": "numLayers",
    "hidden_size": "hiddenSize",
    "intermediate_size": "intermediateSize",
    "num_heads": "numHeads",
    "num_kv_heads": "numKvHeads",
    "head_dim": "headDim",
    "vocab_size": "vocabSize",
    "rope_theta": "ropeTheta",
    "rms_norm_eps": "rmsNormEps",
    "max_position": "maxPosition",
}


def _checkpoint(spec: WavePipelineSpec, path: str) -> ServedCheckpoint:
    """The checkpoint at ``path`` (config.json) with the shape the spec states checked.

    Raises:
        SpecError: no readable, supported config.json (names ``model.path`` or
            ``model.pvc.mountPath``), or a stated shape that disagrees with it (names the
            ``model.config`` field).
    """
    where = "" if Path(path).is_dir() else " is not a directory here"
    if not where and not (Path(path) / "config.json").exists():  # a FIFO: read_hf_config says
        where = " has no config.json"
    if where:
        raise SpecError(
            _checkpoint_field(spec),
            f"{path!r}{where}: the torch engine serves a Hugging Face checkpoint directory "
            "(config.json + safetensors), read by every process built from the spec (in "
            "Kubernetes the PVC is mounted into the stage, admission and gateway pods)",
        )
    try:
        checkpoint = ServedCheckpoint.read(path)
    except ValueError as exc:
        raise SpecError(_checkpoint_field(spec), str(exc)) from None
    model = checkpoint.model
    stated: dict[str, Any] = {}
    if spec.model.num_layers() is not None:
        stated["num_layers"] = spec.model.num_layers()
    config = spec.model.config
    if config is not None:
        for name, camel in _CHECKED_FIELDS.items():
            value = getattr(config, name, None)
            if value is None:
                value = (config.model_extra or {}).get(camel)
            if value is not None:
                stated[name] = value
    for name, value in stated.items():
        actual = getattr(model, name)
        if value != actual:
            is_preset = (
                name == "num_layers" and MODEL_PRESET_NUM_LAYERS.get(spec.model.name) == value
            )
            source = f" (the layer count of preset {spec.model.name!r})" if is_preset else ""
            raise SpecError(
                f"model.config.{_CHECKED_FIELDS[name]}",
                f"{value}{source} disagrees with {path}/config.json, which gives {actual}; the "
                "checkpoint decides the shape: state its value or leave the field out",
            )
    return checkpoint


def absent_pvc_mount(raw: dict[str, Any]) -> str | None:
    """The PVC's mount path when the checkpoint comes from ``model.pvc`` (torch engine, no
    ``model.path``) and that path is not a directory here; else None."""
    model = raw.get("model")
    if raw.get("engine", "torch") != "torch" or not isinstance(model, dict):
        return None
    pvc = model.get("pvc")
    if model.get("path") is not None or not isinstance(pvc, dict):
        return None
    mount = pvc.get("mountPath", "/models")
    return mount if isinstance(mount, str) and not Path(mount).is_dir() else None


def with_checkpoint_layers(raw: Mapping[str, Any]) -> dict[str, Any]:
    """``raw`` (a spec mapping, camelCase) with ``model.config.numLayers`` read from the
    checkpoint's config.json when it serves a checkpoint (torch engine, ``model.path`` or
    ``model.pvc``) and states no layer count (no ``numLayers``, no preset ``model.name``); else
    ``raw`` unchanged. ``wavepp up`` and ``wavepp validate`` call it before the spec check; the
    operator cannot read the checkpoint, so a spec applied to the cluster states numLayers.

    Raises:
        SpecError: the checkpoint's config.json cannot be read (names the path's field).
    """
    out = dict(raw)
    model = out.get("model")
    if out.get("engine", "torch") != "torch" or not isinstance(model, dict):
        return out
    pvc = model.get("pvc")
    field, path = "model.path", model.get("path")
    if path is None and isinstance(pvc, dict):
        field, path = "model.pvc.mountPath", pvc.get("mountPath", "/models")
    config = model.get("config") if isinstance(model.get("config"), dict) else {}
    if (
        not isinstance(path, str)
        or "numLayers" in config
        or "num_layers" in config
        or model.get("name") in MODEL_PRESET_NUM_LAYERS
    ):
        return out
    try:
        num_layers = normalize_hf_config(read_hf_config(path)).get("num_hidden_layers")
    except ValueError as exc:
        raise SpecError(field, f"{path!r}: {exc}") from None
    if not isinstance(num_layers, int) or isinstance(num_layers, bool):
        raise SpecError(field, f"{path}/config.json: num_hidden_layers={num_layers!r}")
    out["model"] = {**model, "config": {**config, "numLayers": num_layers}}
    return out


def _kv_blocks(
    spec: WavePipelineSpec, model: ModelConfig, ranges: list[tuple[int, int]]
) -> list[int] | None:
    """The capacity the spec gives: ``cache.memoryPerStageBytes`` over the KV bytes of each
    stage's ``ranges``, else ``engineOptions.kvBlocks``; None: none given.

    Raises:
        SpecError: kvBlocks is neither an int nor a list of ints.
    """
    if spec.cache.memory_per_stage_bytes is not None:
        blocks = []
        for first, last in ranges:
            block_bytes = (
                (last - first) * model.kv_bytes_per_token_per_layer() * spec.cache.block_size
            )
            blocks.append(max(1, spec.cache.memory_per_stage_bytes // block_bytes))
        return blocks
    raw = spec.engine_options.get("kvBlocks")
    if raw is None:
        return None
    values = raw if isinstance(raw, list) else [raw]
    try:
        return [int(v) for v in values]
    except (TypeError, ValueError):
        raise SpecError("engineOptions.kvBlocks", f"{raw!r}: give an int or a list") from None


def runtime_configs_from_spec(
    spec: WavePipelineSpec, *, pool: str, namespace: str = "local", read_checkpoint: bool = True
) -> list[RuntimeConfig]:
    """One RuntimeConfig per replica (``spec.replicas``; at least one), pipeline names
    ``{pool}-r{i}``.

    Args:
        spec: a validated WavePipelineSpec.
        pool: the pool's name (the custom resource's name; ``wavepp up --name``).
        namespace: the pool's Kubernetes namespace (``$WAVEPP_NAMESPACE``; "local" for
            ``wavepp up``): part of every NATS subject, stream and bucket name.
        read_checkpoint: False: leave a checkpoint unread (``wavepp validate`` off-cluster,
            a PVC not mounted here): the shape from the spec (``model.config``, the preset),
            no ``model_dir``, every other check as usual. Never for a process that serves.

    Returns:
        ``max(1, spec.replicas)`` configs that differ only in ``pipeline``.

    Raises:
        SpecError: a value the runtime cannot run (an unknown emulated cost model, a bad
            kvBlocks or model shape), naming the field.
    """
    options = spec.engine_options
    model_dir = checkpoint_dir(spec) if read_checkpoint else None
    partition = spec.layer_partition
    if model_dir is None:
        model = model_config_from_spec(spec)
    else:
        checkpoint = _checkpoint(spec, model_dir)
        model = checkpoint.model.model_copy(update={"name": spec.model.name, "dtype": _dtype(spec)})
        try:
            partition = checkpoint.partition(spec.num_stages, partition)
        except ValueError as exc:
            raise SpecError("stages", f"{exc} ({model_dir})") from None
        model_dir = checkpoint.model_dir
    try:
        ranges = split_layers(model.num_layers, spec.num_stages, partition)
    except ValueError as exc:
        raise SpecError("layerPartition", str(exc)) from None
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
        "partition": partition,
        "block_size": spec.cache.block_size,
        "num_kv_blocks": [FIXED_KV_BLOCKS],  # the capacity's below
        "mode": spec.scheduler.mode,
        "chunk_tokens": spec.scheduler.chunk_tokens,
        "chunk_policy": spec.scheduler.chunk_policy,
        "device": stage_device(spec),
        "model_dir": model_dir,
        "namespace": namespace,
        "torch_threads": int(options.get("torchThreads", 1)),
        "torch_compile": bool(options.get("torchCompile", False)),
        "pack_weights": bool(options.get("packWeights", True)),
        "pin_cores": bool(options.get("pinCores", False)),
        "max_inflight": options.get("maxInflight"),
        "return_microbatches": options.get("returnMicrobatches", SERVED_RETURN_MICROBATCHES),
        "lease_s": float(options.get("leaseSeconds", 30.0)),
        "max_blocks_per_owner": options.get("maxBlocksPerOwner"),
    }
    try:
        probe = RuntimeConfig(**base)
    except ValueError as exc:
        raise runtime_config_spec_error(exc) from None
    try:
        capacity = replica_capacity(
            probe,
            emulate=emulate,
            kv_blocks=_kv_blocks(spec, model, ranges),
            host_memory_gib=spec.cache.host_memory_gib or 0.0,
            fields=SPEC_FIELDS,
        )
    except CapacityError as exc:
        raise SpecError(exc.field, exc.message) from None
    base |= capacity.fields
    configs = []
    for replica in range(max(1, spec.num_replicas)):
        try:
            configs.append(RuntimeConfig(pipeline=replica_pipeline_name(pool, replica), **base))
        except ValueError as exc:
            raise runtime_config_spec_error(exc) from None
    return configs


# RuntimeConfig's fields that runtime_configs_from_spec sets -> the spec field each comes from.
SPEC_FIELD_OF = {
    "tensor_parallel_size": "tensorParallelSize",
    "num_stages": "stages",
    "partition": "layerPartition",
    "block_size": "cache.blockSize",
    "num_kv_blocks": "engineOptions.kvBlocks",
    "mode": "scheduler.mode",
    "chunk_tokens": "scheduler.chunkTokens",
    "chunk_policy": "scheduler.chunkPolicy",
    "device": "resources.gpusPerStage",
    "model_dir": "model.path",
    "model": "model.config",
    "engine": "engine",
    "cost_model": "engineOptions.emulate",
    "time_scale": "engineOptions.timeScale",
    "torch_threads": "engineOptions.torchThreads",
    "torch_compile": "engineOptions.torchCompile",
    "pack_weights": "engineOptions.packWeights",
    "pin_cores": "engineOptions.pinCores",
    "max_inflight": "engineOptions.maxInflight",
    "return_microbatches": "engineOptions.returnMicrobatches",
    "lease_s": "engineOptions.leaseSeconds",
    "max_blocks_per_owner": "engineOptions.maxBlocksPerOwner",
    "max_microbatch_tokens": "cache.blockSize",
    "num_host_kv_blocks": "cache.hostMemoryGiB",
    "host_load_s_per_block": "cache.hostMemoryGiB",
}

_LEADING_NAME = re.compile(r"([a-z_]+)(?:\.[a-z_]+)*\b")


def runtime_config_spec_error(exc: ValueError) -> SpecError:
    """One line naming the spec field for RuntimeConfig's refusal ``exc`` of the config built
    from a spec: a pydantic error's location, or for a cross-field check the field its message
    begins with (``tensor_parallel_size=2 ...`` -> ``tensorParallelSize``), mapped by
    ``SPEC_FIELD_OF``; no input dump or link. Unmapped: ``engineOptions`` (the free-form
    knobs)."""
    errors = exc.errors() if isinstance(exc, ValidationError) else []
    if not errors:
        return _spec_error_for(None, " ".join(str(exc).split()))
    first = errors[0]
    message = " ".join(str(first.get("msg", "")).split()).removeprefix("Value error, ")
    loc = [str(p) for p in first.get("loc", ())]
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return _spec_error_for(loc[0] if loc else None, message + more)


def _spec_error_for(name: str | None, message: str) -> SpecError:
    if name is None:
        match = _LEADING_NAME.match(message)
        name = match.group(1) if match else None
    return SpecError(SPEC_FIELD_OF.get(name or "", "engineOptions"), message)
