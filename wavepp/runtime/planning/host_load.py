"""Load or recompute: how much of a prefix held partly in host tiers the pipeline agrees to.

Each stage s answers a probe with h_s = d_s + m_s blocks: d_s on its device, then m_s in its
host tier (``StageKVManager``). Any L* <= min_s h_s is a valid agreement; stage s then loads
max(0, L* - d_s) blocks from host to device during its local preparation and every stage
computes the prompt from L*. Raising L* by one block saves computing that block on every stage
and costs each stage whose device hit is below it one block's load. ``HostLoadPolicy`` picks
the L* of least cost: compute of the blocks [L*, n) on the costliest stage plus the slowest
stage's load of its [d_s, L*), at the stage's host-to-device bandwidth.

Host-to-device bandwidth: PCIe 5.0 x16, 32 GT/s per lane x 16 lanes x 128b/130b encoding =
63.0 GB/s per direction (PCI-SIG, PCI Express Base Specification 5.0), the link between an
H200 (SXM, on HGX H200 boards) and its host. ``PCIE_GEN5_X16_BYTES_PER_S``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from wavepp.runtime.planning.cost_model import CostModel

PCIE_GEN5_X16_BYTES_PER_S = 32e9 * 16 * 128 / 130 / 8
"""PCIe 5.0 x16 per direction, bytes/s: 32 GT/s x 16 lanes x 128/130 / 8 bits = 63.0e9."""


def load_s_per_block(
    kv_bytes_per_token: float,
    block_size: int,
    bytes_per_s: float = PCIE_GEN5_X16_BYTES_PER_S,
) -> float:
    """Seconds to copy one block's KV from host to device over one GPU's link: each GPU of a
    stage loads its own shard over its own link in parallel, so the per-GPU bytes count.

    Args:
        kv_bytes_per_token: KV bytes per token per GPU over the stage's layers (> 0).
        block_size: tokens per block (>= 1).
        bytes_per_s: the link's bandwidth, bytes/s (> 0).

    Raises:
        ValueError: an argument out of its range (named).
    """
    if not kv_bytes_per_token > 0:
        raise ValueError(f"kv_bytes_per_token={kv_bytes_per_token}: must be > 0")
    if block_size < 1:
        raise ValueError(f"block_size={block_size}: must be >= 1")
    if not bytes_per_s > 0:
        raise ValueError(f"bytes_per_s={bytes_per_s}: must be > 0")
    return kv_bytes_per_token * block_size / bytes_per_s


class HostLoadPolicy:
    """Chooses L* from each stage's device and host hit (module docstring).

    Args:
        cost_models: each stage's cost model (the planner's scale), S entries.
        load_s: each stage's seconds per block loaded (``load_s_per_block``, same scale), S
            entries, each >= 0.
        block_size: tokens per block (>= 1).

    Raises:
        ValueError: mismatched lengths, a negative load time or a bad block size.
    """

    def __init__(
        self, cost_models: Sequence[CostModel], load_s: Sequence[float], block_size: int
    ) -> None:
        if len(cost_models) != len(load_s) or not cost_models:
            raise ValueError(
                f"cost_models has {len(cost_models)} entries and load_s {len(load_s)}; give "
                "one per stage"
            )
        if min(load_s) < 0:
            raise ValueError(f"load_s={list(load_s)}: each must be >= 0")
        if block_size < 1:
            raise ValueError(f"block_size={block_size}: must be >= 1")
        self.cost_models = list(cost_models)
        self.load_s = list(load_s)
        self.block_size = block_size

    def compute_s(self, start_block: int, num_blocks: int) -> float:
        """Seconds the costliest stage computes blocks [start, start + num) of a prompt."""
        shape = [(start_block * self.block_size, num_blocks * self.block_size)]
        return max(model.microbatch_cost_s(shape) for model in self.cost_models)

    def agreed_blocks(self, hits: Sequence[int], host_hits: Sequence[int], cap: int) -> int:
        """L*: in [min over stages of the device hits, min of the hits], capped at ``cap``,
        the least costly (ties: the larger L*, less compute).

        Args:
            hits: h_s per stage (device plus host run).
            host_hits: m_s per stage (the host part of h_s; <= h_s).
            cap: the most blocks that may be reused (the prompt's last token is computed).
        """
        devices = [hit - host for hit, host in zip(hits, host_hits, strict=True)]
        high = min(min(hits), cap)
        low = min(min(devices), high)
        if high <= low or not any(self.load_s):
            return high
        best, best_cost = high, float("inf")
        # between two device hits the load grows linearly in k and the compute saved is concave
        # (a later block costs more: attention over a longer context), so the least cost lies
        # on a boundary: the ends and each d_s between them
        candidates = {low, high, *(d for d in devices if low < d < high)}
        for k in sorted(candidates, reverse=True):
            load = max(s * max(0, k - d) for s, d in zip(self.load_s, devices, strict=True))
            cost = self.compute_s(k, high - k) + load
            if cost < best_cost:
                best, best_cost = k, cost
        return best


class HostTierShape(Protocol):
    """What :func:`host_load_policy` reads of a replica's RuntimeConfig."""

    num_stages: int
    block_size: int

    def host_kv_blocks_of(self, rank: int) -> int: ...

    def host_load_s_of(self, rank: int) -> float: ...


def host_load_policy(
    config: HostTierShape, cost_models: Sequence[CostModel], *, scale: float = 1.0
) -> HostLoadPolicy | None:
    """The replica's load-or-recompute policy, the agreement's ``agreed_blocks``.

    Args:
        config: the replica's config (its host tier sizes and load time per block, unscaled).
        cost_models: each stage's cost model (S entries) or one for every stage, unscaled.
        scale: multiplies compute and load alike (the emulated engine's and the simulator's
            ``time_scale``; the choice does not depend on it, the figures do).

    Returns:
        None without a host tier on any stage (L* = the least h_s), else the policy.

    Raises:
        ValueError: cost_models has neither 1 nor S entries, or as ``HostLoadPolicy``.
    """
    stages = range(config.num_stages)
    if not any(config.host_kv_blocks_of(rank) for rank in stages):
        return None
    if len(cost_models) not in (1, config.num_stages):
        raise ValueError(
            f"cost_models has {len(cost_models)} entries; give 1 or num_stages={config.num_stages}"
        )
    models = list(cost_models) * (config.num_stages // len(cost_models))
    if scale != 1.0:
        models = [model.scaled(scale) for model in models]
    return HostLoadPolicy(
        models, [config.host_load_s_of(rank) * scale for rank in stages], config.block_size
    )


class ServedReplica(HostTierShape, Protocol):
    """What :func:`serving_agreed_blocks` reads: the host tier and the stages' cost model."""

    cost_model: Mapping[str, object] | None


def serving_agreed_blocks(
    config: ServedReplica, planner_cost_model: CostModel
) -> Callable[[Sequence[int], Sequence[int], int], int] | None:
    """The agreement's ``agreed_blocks`` for a served replica (``LocalPipeline``, the admission service): compute at the
    stages' own cost model when the config carries one (the emulated engine's, unscaled like
    the load times; the engine multiplies both by ``time_scale``), else at the planner's (the
    torch engine's measured fit, real seconds, as the load times).

    Returns:
        ``HostLoadPolicy.agreed_blocks`` of :func:`host_load_policy`; None without a host tier.
    """
    stage_model = (
        CostModel.from_dict(config.cost_model)
        if config.cost_model is not None
        else planner_cost_model
    )
    policy = host_load_policy(config, [stage_model])
    return None if policy is None else policy.agreed_blocks
