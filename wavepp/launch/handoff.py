"""The modelled KV handoff ``wavepp sim --handoff`` runs, from its flags: every stage's link (the
per-GPU line rate, achieved fraction and per-transfer latency, ``planning.handoff_cost``'s
``H200_RDMA`` by default), its GPUs (the t ``planning.memory`` derives for the emulated model)
and its bytes per token and per request. Every refusal is a :class:`FlagError` naming the flag.
"""

from __future__ import annotations

import argparse
import math

from wavepp.launch.flags import FlagError
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.planning.handoff_cost import (
    H200_RDMA,
    HandoffModel,
    LinkSpec,
    stage_handoff_bytes,
)
from wavepp.runtime.planning.memory import derived_stage_memory
from wavepp.runtime.planning.published import get_model

HANDOFF_FLAGS = ("--handoff-gbps", "--handoff-efficiency", "--handoff-latency-s")
"""The link's flags; each is refused without ``--handoff`` (a setting nothing would honour)."""


def _attr(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def check_handoff_flags(args: argparse.Namespace) -> bool:
    """Whether ``--handoff`` is on.

    Raises:
        FlagError: one of ``HANDOFF_FLAGS`` given without ``--handoff`` (it would not be
            honoured), naming it.
    """
    given = [flag for flag in HANDOFF_FLAGS if getattr(args, _attr(flag)) is not None]
    if not args.handoff and given:
        raise FlagError(given[0], "needs --handoff (nothing else uses the handoff's link)")
    return bool(args.handoff)


def plan_handoff(
    args: argparse.Namespace, *, model: str, config: RuntimeConfig
) -> HandoffModel | None:
    """Resolve ``--handoff`` and the link's flags (``HANDOFF_FLAGS``; None: the H200 default).

    Args:
        args: the parsed flags (``handoff`` and one attribute per ``HANDOFF_FLAGS``).
        model: the emulated model (``catalogue.list_models()``).
        config: the pipeline's; its stages, block size and largest micro-batch decide the
            GPUs per stage t (``planning.memory.derived_stage_memory``; 1 for a device without
            a memory figure).

    Returns:
        The handoff model, or None without ``--handoff``.

    Raises:
        FlagError: a link flag without ``--handoff``; ``--handoff-gbps`` not finite and > 0,
            ``--handoff-efficiency`` outside (0, 1], ``--handoff-latency-s`` not finite or
            outside [0, 1]; or the model's stages cannot be laid out (``--stages``).
    """
    if not check_handoff_flags(args):
        return None
    gbps = H200_RDMA.gbps_per_gpu if args.handoff_gbps is None else args.handoff_gbps
    efficiency = (
        H200_RDMA.efficiency if args.handoff_efficiency is None else args.handoff_efficiency
    )
    latency_s = H200_RDMA.latency_s if args.handoff_latency_s is None else args.handoff_latency_s
    if not (math.isfinite(gbps) and gbps > 0):
        raise FlagError("--handoff-gbps", f"{gbps}: must be a number > 0 (Gb/s per GPU)")
    if not 0 < efficiency <= 1:
        raise FlagError("--handoff-efficiency", f"{efficiency}: must be in (0, 1]")
    if not (math.isfinite(latency_s) and 0 <= latency_s <= 1):
        raise FlagError("--handoff-latency-s", f"{latency_s}: must be in [0, 1] seconds")
    link = (
        H200_RDMA
        if (gbps, efficiency, latency_s)
        == (H200_RDMA.gbps_per_gpu, H200_RDMA.efficiency, H200_RDMA.latency_s)
        else LinkSpec(f"{gbps:g} Gb/s per GPU", gbps, efficiency, latency_s)
    )
    try:
        num_gpus = 1  # a roofline without a memory figure (tiny-llama): one device per stage
        if get_model(model).default_gpu.memory_bytes is not None:
            num_gpus = derived_stage_memory(
                model,
                num_stages=config.num_stages,
                block_size=config.block_size,
                max_microbatch_tokens=config.largest_microbatch_tokens,
            )[0].num_gpus
        stages = stage_handoff_bytes(
            model, num_stages=config.num_stages, num_gpus_per_stage=num_gpus
        )
    except ValueError as exc:
        raise FlagError("--stages", str(exc)) from None
    return HandoffModel(link=link, stages=tuple(stages))
