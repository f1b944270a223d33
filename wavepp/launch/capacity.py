"""A replica's KV capacity per stage: the device pool in blocks (``num_kv_blocks``) and the
host tier below it (``num_host_kv_blocks``, ``host_load_s_per_block``), each with a one-line
source to print. :func:`replica_capacity` is where every process that builds a RuntimeConfig
derives them: ``wavepp sim``, ``wavepp bench grid``, ``wavepp replay`` and the spec path
(``launch.runtime_config``: ``wavepp up`` and the stage, admission and gateway processes).

Device pool, first that applies: the blocks given (``--kv-blocks``, ``engineOptions.kvBlocks``,
``cache.memoryPerStageBytes``); for the emulated engine, derived per stage from the emulated
model and device (``planning.memory.default_kv_blocks`` at the config's stages, block size and
largest micro-batch, ``RuntimeConfig.largest_microbatch_tokens``); otherwise (the torch engine)
``FIXED_KV_BLOCKS``.

Host tier, from host memory per GPU (``cache.hostMemoryGiB``, ``--host-memory-gib``; 0: none):
each stage's capacity in blocks and its host-to-device load time per block, from the KV bytes
per token per GPU of the stage's layers and the PCIe link (``planning.host_load``). Every GPU
of a stage keeps its own shard of each block in its own share of host memory, so a stage's
capacity in blocks is host memory per GPU / (KV bytes per token per GPU x block size).

Two sources of the KV bytes per token: an emulated model with a device memory figure (the
catalogue's H200 models) takes the catalogue's per-GPU figure over its balanced split
(``planning.memory.derived_stage_memory``, the same the device pool's derivation uses:
:func:`host_tier_fields`); otherwise the config's model (the torch engine's preset or
checkpoint, or the emulated tiny-llama) takes ``ModelConfig.kv_bytes_per_token_per_layer()`` x
the stage's layers (:func:`model_host_tier_fields`; one process per stage, so one GPU or the
CPU). Loads are priced at PCIe 5.0 x16, the link an H200 loads over; a CPU stage's load is a
copy within RAM, no slower.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from wavepp.api.layer_split import split_layers
from wavepp.api.spec import MAX_HOST_MEMORY_GIB_PER_GPU
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.model_config import ModelConfig
from wavepp.runtime.planning.catalogue import ModelShape, get_model
from wavepp.runtime.planning.host_load import PCIE_GEN5_X16_BYTES_PER_S, load_s_per_block
from wavepp.runtime.planning.memory import (
    FIXED_KV_BLOCKS,
    default_kv_blocks,
    derived_stage_memory,
)


class CapacityError(ValueError):
    """A capacity :func:`replica_capacity` cannot derive: ``field`` is the caller's name of the
    setting (``CapacityFields``), ``message`` says why and what to give instead."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class CapacityFields:
    """What a command calls the two settings: its error lines and sources name them."""

    kv_blocks: str
    host_memory_gib: str


FLAG_FIELDS = CapacityFields("--kv-blocks", "--host-memory-gib")
SPEC_FIELDS = CapacityFields("engineOptions.kvBlocks", "cache.hostMemoryGiB")


@dataclass(frozen=True)
class Capacity:
    """A replica's KV capacity (module docstring).

    Attributes:
        num_kv_blocks: device pool per stage in blocks: as given (1 or S entries), else S.
        kv_blocks_source: where it came from, one line.
        num_host_kv_blocks: host tier per stage in blocks (S entries; [0]: none).
        host_load_s_per_block: seconds to load one block from host to device, per stage.
        host_source: where the host tier came from, one line ("no host tier").
    """

    num_kv_blocks: list[int]
    kv_blocks_source: str
    num_host_kv_blocks: list[int]
    host_load_s_per_block: list[float]
    host_source: str

    @property
    def host_fields(self) -> dict[str, list[Any]]:
        """RuntimeConfig's host tier fields."""
        return {
            "num_host_kv_blocks": self.num_host_kv_blocks,
            "host_load_s_per_block": self.host_load_s_per_block,
        }

    @property
    def fields(self) -> dict[str, list[Any]]:
        """RuntimeConfig's capacity fields: ``num_kv_blocks`` and the host tier's."""
        return {"num_kv_blocks": self.num_kv_blocks, **self.host_fields}

    def apply(self, config: RuntimeConfig) -> RuntimeConfig:
        """``config`` with this capacity.

        Raises:
            ValueError: RuntimeConfig refuses it (e.g. a given count < 1 or of neither 1 nor S
                entries).
        """
        return RuntimeConfig.model_validate(config.model_dump() | self.fields)


def replica_capacity(
    config: RuntimeConfig,
    *,
    emulate: str | ModelShape | None,
    kv_blocks: list[int] | None = None,
    host_memory_gib: float = 0.0,
    fields: CapacityFields = FLAG_FIELDS,
) -> Capacity:
    """The KV capacity of ``config``'s stages (the rules: module docstring).

    Args:
        config: the replica's config; its stages, block size, largest micro-batch, model and
            partition are read, its capacity fields are not.
        emulate: the emulated engine's cost model (a catalogue name or a ModelShape); None for
            the torch engine.
        kv_blocks: device blocks given (1 or S entries), or None to derive them.
        host_memory_gib: the host tier per GPU, GiB (0: none).
        fields: the names of the two settings in the caller's terms.

    Raises:
        CapacityError: no device pool can be derived (the emulated model's weights fit no
            stage; naming ``fields.kv_blocks``), or a bad host amount, a model whose KV bytes
            per token cannot be derived, or an amount that holds no block of some stage
            (naming ``fields.host_memory_gib``).
    """
    if kv_blocks is not None:
        blocks, kv_source = list(kv_blocks), fields.kv_blocks
    elif emulate is None:
        blocks, kv_source = [FIXED_KV_BLOCKS], f"fixed default {FIXED_KV_BLOCKS}"
    else:
        try:
            blocks, kv_source = default_kv_blocks(
                emulate,
                num_stages=config.num_stages,
                block_size=config.block_size,
                max_microbatch_tokens=config.largest_microbatch_tokens,
            )
        except ValueError as exc:
            raise CapacityError(fields.kv_blocks, f"unset, and its default: {exc}") from None
    try:
        host, host_source = _host_tier(config, emulate, host_memory_gib)
    except ValueError as exc:
        raise CapacityError(fields.host_memory_gib, str(exc)) from None
    return Capacity(
        num_kv_blocks=blocks,
        kv_blocks_source=kv_source,
        num_host_kv_blocks=host["num_host_kv_blocks"],
        host_load_s_per_block=host["host_load_s_per_block"],
        host_source=host_source,
    )


def _host_tier(
    config: RuntimeConfig, emulate: str | ModelShape | None, host_memory_gib: float
) -> tuple[dict[str, list[Any]], str]:
    """The host tier fields and source: the emulated model's catalogue figures when it has a
    device memory figure (:func:`host_tier_fields`), else ``config.model`` over its layer
    split (:func:`model_host_tier_fields`).

    Raises:
        ValueError: as :func:`check_host_memory_gib` and those two.
    """
    gib = check_host_memory_gib(host_memory_gib)
    if gib == 0:
        return {"num_host_kv_blocks": [0], "host_load_s_per_block": [0.0]}, "no host tier"
    if emulate is not None:
        shape = get_model(emulate)
        if shape.default_gpu.memory_bytes is not None:
            return host_tier_fields(
                shape,
                gib,
                num_stages=config.num_stages,
                block_size=config.block_size,
                max_microbatch_tokens=config.largest_microbatch_tokens,
            )
    ranges = split_layers(config.model.num_layers, config.num_stages, config.partition)
    return model_host_tier_fields(config.model, ranges, gib, block_size=config.block_size)


def check_host_memory_gib(value: Any) -> float:
    """``value`` as GiB of host memory per GPU, in [0, MAX_HOST_MEMORY_GIB_PER_GPU].

    Raises:
        ValueError: not a finite number in range; the message names the limit.
    """
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{value!r} is not a number of GiB")
    if not 0 <= value <= MAX_HOST_MEMORY_GIB_PER_GPU:
        raise ValueError(
            f"{value} GiB per GPU; must be in [0, {MAX_HOST_MEMORY_GIB_PER_GPU}] (0: no "
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
) -> tuple[dict[str, list[Any]], str]:
    """RuntimeConfig's host tier fields for ``host_memory_gib`` (> 0) per GPU of the stages of
    ``model`` (a catalogue name or ModelShape), at the catalogue's KV bytes per token per GPU
    of each stage's layers (``planning.memory.derived_stage_memory``).

    Returns:
        ({"num_host_kv_blocks": S entries, "host_load_s_per_block": S entries (seconds at the
        device's speed)}, a one-line source).

    Raises:
        ValueError: a model whose KV bytes per token on its device cannot be derived, or an
            amount that holds no block of some stage (:func:`_tier`).
    """
    try:
        stages = derived_stage_memory(
            model,
            num_stages=num_stages,
            block_size=block_size,
            max_microbatch_tokens=max_microbatch_tokens,
        )
    except ValueError as exc:
        raise ValueError(f"a host tier needs the model's KV bytes per token: {exc}") from None
    per_token = [s.kv_bytes_per_token for s in stages]
    return _tier(host_memory_gib, per_token, block_size, "KV bytes per token per GPU")


def model_host_tier_fields(
    model: ModelConfig, ranges: list[tuple[int, int]], host_memory_gib: float, *, block_size: int
) -> tuple[dict[str, list[Any]], str]:
    """RuntimeConfig's host tier fields for ``host_memory_gib`` (> 0) of host memory per stage
    of the served ``model``, whose stage r holds layers ``ranges[r]`` = [first, last): its KV
    bytes per token are ``model.kv_bytes_per_token_per_layer()`` x (last - first).

    Returns:
        As :func:`host_tier_fields` (S entries each).

    Raises:
        ValueError: a tier of less than one block on some stage (:func:`_tier`).
    """
    per_layer = model.kv_bytes_per_token_per_layer()
    per_token = [per_layer * (last - first) for first, last in ranges]
    basis = f"{model.name}: {per_layer} bytes per token per layer x the stage's layers"
    return _tier(host_memory_gib, per_token, block_size, basis)


def _tier(
    gib: float, per_token: list[float], block_size: int, basis: str
) -> tuple[dict[str, list[Any]], str]:
    """Per stage r: blocks = floor(gib x 2^30 / (per_token[r] x block_size)), load =
    ``load_s_per_block(per_token[r], block_size)``; ``basis`` names where the KV bytes per
    token come from (the source line and the refusal quote it).

    Raises:
        ValueError: less than one block on some stage (names the stage with the largest block
            and the least amount that holds it).
    """
    host_bytes = gib * 2**30
    widest = max(range(len(per_token)), key=per_token.__getitem__)
    block_bytes = per_token[widest] * block_size
    if host_bytes < block_bytes:
        raise ValueError(
            f"{gib:g} GiB per GPU holds no KV block of stage {widest} ({block_bytes:.0f} bytes: "
            f"{basis} x {block_size} tokens); give at least {block_bytes / 2**30:.3g} GiB, or 0 "
            "for no host tier"
        )
    blocks = [math.floor(host_bytes / (kv * block_size)) for kv in per_token]
    load_s = [load_s_per_block(kv, block_size) for kv in per_token]
    source = (
        f"{gib:g} GiB per GPU / ({basis} x {block_size} tokens); loads at "
        f"{PCIE_GEN5_X16_BYTES_PER_S / 1e9:.1f} GB/s (PCIe 5.0 x16 per direction)"
    )
    return {"num_host_kv_blocks": blocks, "host_load_s_per_block": load_s}, source
