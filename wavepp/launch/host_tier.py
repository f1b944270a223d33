"""The host KV tier's settings, resolved from host memory per GPU (``cache.hostMemoryGiB``,
``--host-memory-gib``): each stage's host tier capacity in blocks and its host-to-device load
time per block, from the model's KV bytes per token per GPU on each stage
(``planning.memory.derived_stage_memory``) and the PCIe link (``planning.host_load``).

Every GPU of a stage keeps its own shard of each block in its own share of host memory, so a
stage's capacity in blocks is host memory per GPU / (KV bytes per token per GPU x block size).
"""

from __future__ import annotations

import math
from typing import Any

from wavepp.runtime.planning.host_load import PCIE_GEN5_X16_BYTES_PER_S, load_s_per_block
from wavepp.runtime.planning.memory import derived_stage_memory

__all__ = ["MAX_HOST_MEMORY_GIB_PER_GPU", "check_host_memory_gib", "host_tier_fields"]

MAX_HOST_MEMORY_GIB_PER_GPU = 1024
"""The most host memory per GPU a node can have: 8 TiB of DRAM (32 x 256 GiB DIMMs, the
largest HGX H200 8-GPU servers) over 8 GPUs."""


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
    model: str,
    host_memory_gib: float,
    *,
    num_stages: int,
    block_size: int,
    max_microbatch_tokens: int,
    field: str = "--host-memory-gib",
) -> tuple[dict[str, list[Any]], str]:
    """RuntimeConfig's host tier fields for ``host_memory_gib`` per GPU of ``model``'s stages.

    Returns:
        ({"num_host_kv_blocks": S entries, "host_load_s_per_block": S entries (seconds at the
        device's speed)}, a one-line source); 0 GiB: no host tier ([0], [0.0]).

    Raises:
        ValueError: a bad amount (``check_host_memory_gib``), or a model whose KV bytes per
            token on its device cannot be derived (the message names ``field``).
    """
    gib = check_host_memory_gib(host_memory_gib, field)
    if gib == 0:
        return {"num_host_kv_blocks": [0], "host_load_s_per_block": [0.0]}, "no host tier"
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
    load_s = [load_s_per_block(s.kv_bytes_per_token, block_size) for s in stages]
    source = (
        f"{gib:g} GiB per GPU / KV bytes per token per GPU x {block_size} tokens; loads at "
        f"{PCIE_GEN5_X16_BYTES_PER_S / 1e9:.1f} GB/s (PCIe 5.0 x16 per direction)"
    )
    return {"num_host_kv_blocks": blocks, "host_load_s_per_block": load_s}, source
