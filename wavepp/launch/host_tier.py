"""The host KV tier's settings, resolved from host memory per GPU (``cache.hostMemoryGiB``,
``--host-memory-gib``): each stage's host tier capacity in blocks and its host-to-device load
time per block, from the KV bytes per token per GPU of each stage's layers and the PCIe link
(``planning.host_load``).

Every GPU of a stage keeps its own shard of each block in its own share of host memory, so a
stage's capacity in blocks is host memory per GPU / (KV bytes per token per GPU x block size).

Two sources of the KV bytes per token (:func:`resolve_host_tier` picks): an emulated model with
a device memory figure (the catalogue's H200 models) takes the catalogue's per-GPU figure over
its balanced split (``planning.memory.derived_stage_memory``, the same the emulated device
capacity and ``wavepp sim`` use: :func:`host_tier_fields`); a served model (the torch engine's
preset or checkpoint, or an emulated model without a memory figure) takes
``ModelConfig.kv_bytes_per_token_per_layer()`` x the stage's layers (:func:`model_host_tier_fields`;
one process per stage, so one GPU or the CPU). Loads are priced at PCIe 5.0 x16, the link an
H200 loads over; a CPU stage's load is a copy within RAM, no slower.
"""

from __future__ import annotations

import math
from typing import Any

from wavepp.api.spec import MAX_HOST_MEMORY_GIB_PER_GPU
from wavepp.runtime.model_config import ModelConfig
from wavepp.runtime.planning.catalogue import ModelShape, get_model
from wavepp.runtime.planning.host_load import PCIE_GEN5_X16_BYTES_PER_S, load_s_per_block
from wavepp.runtime.planning.memory import derived_stage_memory

NO_HOST_TIER: dict[str, list[Any]] = {"num_host_kv_blocks": [0], "host_load_s_per_block": [0.0]}
"""RuntimeConfig's host tier fields without a tier."""


def check_host_memory_gib(value: Any, field: str) -> float:
    """``value`` as GiB of host memory per GPU, in [0, MAX_HOST_MEMORY_GIB_PER_GPU].

    Raises:
        ValueError: not a finite number in range; the message names ``field`` and the limit.
    """
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{field}: {value!r} is not a number of GiB")
    if not 0 <= value <= MAX_HOST_MEMORY_GIB_PER_GPU:
        raise ValueError(
            f"{field}: {value} GiB per GPU; must be in [0, {MAX_HOST_MEMORY_GIB_PER_GPU}] (0: no "
            "host tier; the upper limit: 8 TiB of host memory over an 8-GPU node)"
        )
    return float(value)


def host_tier_fields(
    model: str | ModelShape,
    host_memory_gib: float,
    *,
    num_stages: int,
    block_size: int,
    max_microbatch_tokens: int,
    field: str = "--host-memory-gib",
) -> tuple[dict[str, list[Any]], str]:
    """RuntimeConfig's host tier fields for ``host_memory_gib`` per GPU of the stages of
    ``model`` (a catalogue name or ModelShape), at the catalogue's KV bytes per token per GPU.

    Returns:
        ({"num_host_kv_blocks": S entries, "host_load_s_per_block": S entries (seconds at the
        device's speed)}, a one-line source); 0 GiB: no host tier ([0], [0.0]).

    Raises:
        ValueError: a bad amount (``check_host_memory_gib``), a model whose KV bytes per
            token on its device cannot be derived, or an amount that holds no block of some
            stage (the message names ``field``).
    """
    gib = check_host_memory_gib(host_memory_gib, field)
    if gib == 0:
        return dict(NO_HOST_TIER), "no host tier"
    try:
        stages = derived_stage_memory(
            model,
            num_stages=num_stages,
            block_size=block_size,
            max_microbatch_tokens=max_microbatch_tokens,
        )
    except ValueError as exc:
        raise ValueError(
            f"{field}: a host tier needs the model's KV bytes per token: {exc}"
        ) from None
    host_bytes = gib * 2**30
    blocks = [math.floor(host_bytes / (s.kv_bytes_per_token * block_size)) for s in stages]
    if min(blocks) < 1:
        least = max(s.kv_bytes_per_token for s in stages) * block_size / 2**30
        raise ValueError(
            f"{field}: {gib:g} GiB per GPU holds no KV block of some stage; give at least "
            f"{least:.3g} GiB, or 0 for no host tier"
        )
    load_s = [load_s_per_block(s.kv_bytes_per_token, block_size) for s in stages]
    source = (
        f"{gib:g} GiB per GPU / KV bytes per token per GPU x {block_size} tokens; loads at "
        f"{PCIE_GEN5_X16_BYTES_PER_S / 1e9:.1f} GB/s (PCIe 5.0 x16 per direction)"
    )
    return {"num_host_kv_blocks": blocks, "host_load_s_per_block": load_s}, source


def model_host_tier_fields(
    model: ModelConfig,
    ranges: list[tuple[int, int]],
    host_memory_gib: float,
    *,
    block_size: int,
    field: str = "--host-memory-gib",
) -> tuple[dict[str, list[Any]], str]:
    """RuntimeConfig's host tier fields for ``host_memory_gib`` of host memory per stage of the
    served ``model``, whose stage r holds layers ``ranges[r]`` = [first, last).

    Per stage: kv = ``model.kv_bytes_per_token_per_layer()`` x (last - first) bytes per token;
    blocks = floor(host bytes / (kv x block_size)); load = ``load_s_per_block(kv, block_size)``.

    Returns:
        As :func:`host_tier_fields` (S entries each; 0 GiB: no host tier).

    Raises:
        ValueError: a bad amount (``check_host_memory_gib``), or a tier of less than one block
            on some stage (the message names ``field``, the stage and the least amount).
    """
    gib = check_host_memory_gib(host_memory_gib, field)
    if gib == 0:
        return dict(NO_HOST_TIER), "no host tier"
    host_bytes = gib * 2**30
    per_layer = model.kv_bytes_per_token_per_layer()
    per_token = [per_layer * (last - first) for first, last in ranges]
    widest = max(range(len(ranges)), key=lambda rank: per_token[rank])
    block_bytes = per_token[widest] * block_size
    if host_bytes < block_bytes:
        first, last = ranges[widest]
        raise ValueError(
            f"{field}: {gib:g} GiB holds no KV block of stage {widest} ({block_bytes} bytes: "
            f"{last - first} layers x {per_layer} bytes per token per layer x {block_size} "
            f"tokens); give at least {block_bytes / 2**30:.3g} GiB, or 0 for no host tier"
        )
    blocks = [math.floor(host_bytes / (kv * block_size)) for kv in per_token]
    load_s = [load_s_per_block(kv, block_size) for kv in per_token]
    source = (
        f"{gib:g} GiB / ({model.name}: {per_layer} bytes per token per layer x the stage's layers "
        f"x {block_size} tokens); loads at {PCIE_GEN5_X16_BYTES_PER_S / 1e9:.1f} GB/s (PCIe 5.0 "
        "x16 per direction)"
    )
    return {"num_host_kv_blocks": blocks, "host_load_s_per_block": load_s}, source


def resolve_host_tier(
    model: ModelConfig,
    ranges: list[tuple[int, int]],
    host_memory_gib: float,
    *,
    emulate: str | ModelShape | None,
    block_size: int,
    max_microbatch_tokens: int,
    field: str,
) -> tuple[dict[str, list[Any]], str]:
    """A replica's host tier fields: the emulated model's catalogue figures when ``emulate``
    (the emulated engine's cost model) has a device memory figure (:func:`host_tier_fields`,
    its balanced split of ``len(ranges)`` stages), else the served ``model`` over ``ranges``
    (:func:`model_host_tier_fields`).

    Raises:
        ValueError: as those two (the message names ``field``).
    """
    if emulate is not None:
        shape = emulate if isinstance(emulate, ModelShape) else get_model(emulate)
        if shape.default_gpu.memory_bytes is not None:
            return host_tier_fields(
                shape,
                host_memory_gib,
                num_stages=len(ranges),
                block_size=block_size,
                max_microbatch_tokens=max_microbatch_tokens,
                field=field,
            )
    return model_host_tier_fields(
        model, ranges, host_memory_gib, block_size=block_size, field=field
    )
