"""KV capacity per stage, derived from the emulated model and the device.

Pure: no I/O, no torch. The model figures are the derived ones of ``planning.published``
(docs/model-costs.md); the device is a ``GPUSpec`` with ``memory_bytes`` (H200: 141 GB).

Formula, per stage r of the balanced layer split (``wavepp.api.layer_split``), per GPU of the
stage's tensor-parallel group of t GPUs::

    usable     = memory_bytes * memory_utilization
    weights    = (weight bytes of the stage's layers
                  [+ input embedding on stage 0] [+ lm_head on the last stage]) / t
    activation = max_microbatch_tokens * activation_bytes_per_token
    kv_token   = sum over the stage's layers of kv_bytes_per_token / min(t, num_kv_heads)
    num_blocks = floor((usable - weights - activation) / (kv_token * block_size))

    capacity in tokens of the stage = num_blocks * block_size

Assumptions, with their sources:

- **Memory utilisation 0.9** of each GPU's memory is the budget for weights, activations and
  KV, as vLLM's ``gpu_memory_utilization`` default (vllm/engine/arg_utils.py, 0.9). The other
  10% (14.1 GB of an H200) is left for what is not counted here: the CUDA context, NCCL and
  cuBLAS workspaces, CUDA graphs, the logits of a micro-batch's last tokens (at most 256 rows x
  vocab x 4 B ~ 0.2 GB), attention kernels' scratch, allocator fragmentation.
- **H200 memory**: 141 GB (NVIDIA H200 datasheet; ``shapes.H200``).
- **Weights** at the served dtype, all experts resident (``LayerCost.weight_bytes``: FP8
  e4m3 with 128x128 block scales for GLM-5.2-FP8, MiniMax-M2.7, DeepSeek-V3.2; Kimi K3 routed
  experts MXFP4; routers, embeddings and lm_head BF16; ``catalogue``'s docstring). The input
  embedding sits on stage 0 and the lm_head on the last stage; both are d x vocab, so the
  embedding is counted at ``lm_head_weight_bytes``. MTP layers are not loaded (prefill only).
  Weights split evenly over the t GPUs of a stage (tensor or expert parallelism alike).
- **Activations**: one micro-batch of ``max_microbatch_tokens`` new tokens (the engine's largest:
  the caller passes the scheduler's cap, ``RuntimeConfig.max_microbatch_tokens``, 16,384 by
  default, or ``chunk_tokens`` if larger) at the model's
  ``activation_bytes_per_token`` (``shapes.activation_bytes_per_token``: residual, normed input
  and received hidden state, 3*d, plus the widest intermediate; for MoE vLLM ``fused_moe``'s
  per-copy caches k*(3f + d)), BF16, not split over the t GPUs (an over-estimate). It is an
  estimate of what vLLM's profiling forward measures, not a measurement; it is a few GB
  (GLM-5.2: 242 kB/token, 4.0 GB at 16,384 tokens), small next to the weights.
- **KV bytes per token** of each layer from the architecture (docs/model-costs.md "KV bytes per token",
  BF16 latent / K,V plus the FP8 DSA indexer key; an FP8 KV cache would double the capacity).
  Under tensor parallelism GQA's KV heads split over min(t, K) GPUs; MLA's latent has one
  head, so every GPU of the group holds the whole latent (vLLM MLA backends: one KV head,
  replicated per TP rank) and t GPUs do not add MLA capacity.
- **GPUs per stage, t.** The derived cost models price a stage at one H200's roofline, so a
  stage is one H200 wherever its weights fit one. Where they do not (GLM-5.2 at PP4: ~198 GB
  on the largest stage), a stage is the smallest group of t in (1, 2, 4, 8) H200s with tensor
  parallelism that holds the largest stage's weights and activations and leaves room for at
  least one KV block; 8 is one HGX H200 node (the NVLink domain; tensor parallelism across
  nodes is not assumed). One t for all stages, as engines use one TP size per pipeline.
  Results for the paper's settings: GLM-5.2 PP8, MiniMax-M2.7 PP4 and PP8: t = 1; GLM-5.2 PP4:
  t = 2. The reading "one stage = one 8-GPU node" was not taken: it would give MiniMax-M2.7
  14M tokens per stage (a million Python block objects per stage pool) while pricing compute
  at one GPU, and the reading "one stage = one H200" cannot hold GLM-5.2 at PP4. The cost
  models are not changed by t (a stage of t GPUs is priced at one H200: pessimistic for GLM-5.2
  PP4); that is a cost-model question, not this one.
- A stage whose weights do not fit 8 GPUs (e.g. Kimi K3 at PP1: 1.56 TB) raises ValueError
  naming the model, stage count and memory needed; so does an explicit ``num_gpus_per_stage``
  that is too small (e.g. GLM-5.2 on 4 stages of 1 H200: ~198 GB needed, 127 GB usable).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from wavepp.api.layer_split import split_layers
from wavepp.runtime.planning.catalogue import get_model
from wavepp.runtime.planning.shapes import GPUSpec, ModelShape

DEFAULT_MEMORY_UTILIZATION = 0.9  # vLLM's gpu_memory_utilization default


GPUS_PER_STAGE_CHOICES = (1, 2, 4, 8)  # tensor-parallel sizes within one 8-GPU node


# NOTE: the KV capacity of a model without a device memory figure (tiny-llama on the CPU
# roofline) and of the torch engine; the same number as RuntimeConfig.num_kv_blocks' default.
FIXED_KV_BLOCKS = 4096


@dataclass(frozen=True)
class StageMemory:
    """One stage's memory budget, per GPU of its tensor-parallel group (module docstring).

    Attributes:
        rank: stage index r in [0, S).
        layers: the stage's [first, last) decoder layers.
        num_gpus: t, GPUs of the stage (tensor parallelism).
        usable_bytes: memory_bytes * memory_utilization, bytes per GPU.
        weight_bytes: the stage's weights per GPU, bytes.
        activation_bytes: activation workspace of the largest micro-batch per GPU, bytes.
        kv_bytes_per_token: KV bytes per cached token per GPU over the stage's layers.
        block_size: tokens per KV block.
        num_blocks: KV capacity, blocks of block_size tokens.
    """

    rank: int
    layers: tuple[int, int]
    num_gpus: int
    usable_bytes: float
    weight_bytes: float
    activation_bytes: float
    kv_bytes_per_token: float
    block_size: int
    num_blocks: int

    @property
    def kv_bytes(self) -> float:
        """Bytes per GPU left for KV: usable - weights - activations (may be < 0)."""
        return self.usable_bytes - self.weight_bytes - self.activation_bytes

    @property
    def num_kv_tokens(self) -> int:
        """KV capacity in tokens: num_blocks * block_size."""
        return self.num_blocks * self.block_size


def _stage_memory(
    spec: ModelShape,
    gpu: GPUSpec,
    *,
    rank: int,
    layers: tuple[int, int],
    num_gpus: int,
    block_size: int,
    max_microbatch_tokens: int,
    memory_utilization: float,
) -> StageMemory:
    assert gpu.memory_bytes is not None, "callers check the device has a memory figure"
    first, last = layers
    stage_layers = spec.layers[first:last]
    weight_bytes = sum(layer.weight_bytes for layer in stage_layers)
    if first == 0:
        weight_bytes += spec.lm_head_weight_bytes  # input embedding, d x vocab like lm_head
    if last == spec.num_layers:
        weight_bytes += spec.lm_head_weight_bytes
    kv_bytes_per_token = sum(
        layer.kv_bytes_per_token / min(num_gpus, layer.num_kv_heads) for layer in stage_layers
    )
    usable = gpu.memory_bytes * memory_utilization
    activation = max_microbatch_tokens * spec.activation_bytes_per_token
    per_gpu_weights = weight_bytes / num_gpus
    free = usable - per_gpu_weights - activation
    if kv_bytes_per_token > 0:
        num_blocks = max(0, math.floor(free / (kv_bytes_per_token * block_size)))
    else:
        num_blocks = 0
    return StageMemory(
        rank=rank,
        layers=layers,
        num_gpus=num_gpus,
        usable_bytes=usable,
        weight_bytes=per_gpu_weights,
        activation_bytes=activation,
        kv_bytes_per_token=kv_bytes_per_token,
        block_size=block_size,
        num_blocks=num_blocks,
    )


def derived_stage_memory(
    model: str | ModelShape,
    *,
    num_stages: int,
    block_size: int,
    max_microbatch_tokens: int,
    gpu: GPUSpec | None = None,
    num_gpus_per_stage: int | None = None,
    memory_utilization: float = DEFAULT_MEMORY_UTILIZATION,
) -> list[StageMemory]:
    """Each stage's memory budget and KV capacity (formula and assumptions: module docstring).

    Args:
        model: a name from ``catalogue.list_models()``, or a ModelShape.
        num_stages: S; stages hold the balanced layer split (``split_layers``).
        block_size: tokens per KV block.
        max_microbatch_tokens: new tokens of the largest micro-batch (the activation workspace).
        gpu: device; None uses the model's default (H200). Needs ``memory_bytes``.
        num_gpus_per_stage: t; None picks the smallest of GPUS_PER_STAGE_CHOICES where every
            stage has at least one KV block.
        memory_utilization: fraction of each GPU's memory for weights, activations and KV.

    Returns:
        S StageMemory, in stage order; every num_blocks >= 1.

    Raises:
        ValueError: unknown model; num_stages outside [1, num_layers]; block_size,
            max_microbatch_tokens or num_gpus_per_stage < 1; memory_utilization outside (0, 1];
            the device has no memory figure; a stage holds no per-token KV (only linear-
            attention layers); or the weights and activations leave no KV block, naming the
            model, stage count, GPUs per stage and the memory needed.
    """
    spec = model if isinstance(model, ModelShape) else get_model(model)
    gpu = spec.default_gpu if gpu is None else gpu
    for name, value in (
        ("block_size", block_size),
        ("max_microbatch_tokens", max_microbatch_tokens),
    ):
        if value < 1:
            raise ValueError(f"{name}={value}: must be >= 1")
    if num_gpus_per_stage is not None and num_gpus_per_stage < 1:
        raise ValueError(f"num_gpus_per_stage={num_gpus_per_stage}: must be >= 1 (or None)")
    if not 0 < memory_utilization <= 1:
        raise ValueError(f"memory_utilization={memory_utilization}: must be in (0, 1]")
    if gpu.memory_bytes is None:
        raise ValueError(
            f"gpu={gpu.name!r} has no memory_bytes: no KV capacity can be derived for "
            f"{spec.name}; give the capacity in blocks (--kv-blocks)"
        )
    ranges = split_layers(spec.num_layers, num_stages)
    for rank, (first, last) in enumerate(ranges):
        if not any(layer.kv_bytes_per_token > 0 for layer in spec.layers[first:last]):
            raise ValueError(
                f"{spec.name} on {num_stages} stages: stage {rank} (layers [{first},{last})) "
                "holds no per-token KV, so its capacity in blocks is unbounded; give the "
                "capacity in blocks (--kv-blocks)"
            )
    choices = GPUS_PER_STAGE_CHOICES if num_gpus_per_stage is None else (num_gpus_per_stage,)
    stages: list[StageMemory] = []
    for num_gpus in choices:
        stages = [
            _stage_memory(
                spec,
                gpu,
                rank=rank,
                layers=layers,
                num_gpus=num_gpus,
                block_size=block_size,
                max_microbatch_tokens=max_microbatch_tokens,
                memory_utilization=memory_utilization,
            )
            for rank, layers in enumerate(ranges)
        ]
        if all(stage.num_blocks >= 1 for stage in stages):
            return stages
    worst = min(stages, key=lambda stage: stage.kv_bytes)
    need = worst.weight_bytes + worst.activation_bytes
    block_bytes = worst.kv_bytes_per_token * block_size
    raise ValueError(
        f"{spec.name} on {num_stages} stages of {worst.num_gpus} x {gpu.name} does not fit: "
        f"stage {worst.rank} (layers [{worst.layers[0]},{worst.layers[1]})) needs "
        f"{_format_bytes(need)} per GPU for weights and activations plus "
        f"{_format_bytes(block_bytes)} per KV block, and {_format_bytes(gpu.memory_bytes)} x "
        f"{memory_utilization:g} = {_format_bytes(worst.usable_bytes)} is usable; use more stages"
        + (" or more GPUs per stage" if num_gpus_per_stage is not None else "")
        + ", or give the capacity in blocks (--kv-blocks)"
    )


def _format_bytes(num_bytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.4g} {unit}"
    return f"{num_bytes:.4g} B"


def default_kv_blocks(
    model: str | ModelShape, *, num_stages: int, block_size: int, max_microbatch_tokens: int
) -> tuple[list[int], str]:
    """The emulated engine's KV capacity when none is given, and where it comes from.

    Derived (``derived_stage_memory`` at the model's default device, utilisation 0.9) for a
    model whose device has a memory figure; FIXED_KV_BLOCKS on every stage otherwise
    (tiny-llama, CPU roofline).

    Args:
        model: a name from ``catalogue.list_models()``, or a ModelShape.
        num_stages: S.
        block_size: tokens per KV block.
        max_microbatch_tokens: new tokens of the largest micro-batch
            (``RuntimeConfig.largest_microbatch_tokens``).

    Returns:
        (blocks per stage, S entries; a one-line source naming the derivation's inputs).

    Raises:
        ValueError: as ``derived_stage_memory``.
    """
    spec = get_model(model)
    gpu = spec.default_gpu
    if gpu.memory_bytes is None:
        return [FIXED_KV_BLOCKS] * num_stages, (
            f"fixed default {FIXED_KV_BLOCKS} (roofline {gpu.name!r} of {spec.name} has no "
            "memory figure)"
        )
    stages = derived_stage_memory(
        model,
        num_stages=num_stages,
        block_size=block_size,
        max_microbatch_tokens=max_microbatch_tokens,
    )
    first = stages[0]
    source = (
        f"derived: {spec.name}, {num_stages} stages of {first.num_gpus} x {gpu.name} "
        f"({gpu.memory_bytes / 1e9:g} GB x {DEFAULT_MEMORY_UTILIZATION:g} - stage weights - "
        f"activations of {max_microbatch_tokens} tokens) / KV bytes of the stage's layers; "
        "wavepp.runtime.planning.memory"
    )
    return [stage.num_blocks for stage in stages], source
