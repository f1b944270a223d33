"""A stage pod's resource requests and limits: ``resources.cpu``, ``resources.memory`` plus the
host KV tier's memory (``cache.hostMemoryGiB``), the GPUs."""

from __future__ import annotations

import math
from typing import Any

from lightkube.utils.quantity import parse_quantity

from wavepp.api.spec import WavePipelineSpec


def host_tier_bytes(spec: WavePipelineSpec) -> int:
    """Host memory a stage pod's KV host tier holds, bytes: ``cache.hostMemoryGiB`` per GPU x
    the pod's GPUs (at least one: a CPU stage is one process) for the torch engine, rounded
    up; 0 for the emulated engine (it keeps no KV bytes) or without a tier."""
    if spec.engine != "torch" or not spec.cache.host_memory_gib:
        return 0
    return math.ceil(spec.cache.host_memory_gib * 2**30 * max(1, spec.gpus_per_stage()))


def _memory_quantity(num_bytes: int) -> str:
    """``num_bytes`` as a Kubernetes quantity: whole Gi or Mi when exact, else bytes."""
    for unit, size in (("Gi", 2**30), ("Mi", 2**20)):
        if num_bytes % size == 0:
            return f"{num_bytes // size}{unit}"
    return str(num_bytes)


def stage_resources(spec: WavePipelineSpec) -> dict[str, Any]:
    """The stage container's requests and limits: ``resources.cpu``, ``resources.memory`` plus
    the host KV tier (:func:`host_tier_bytes`; without ``resources.memory`` the tier alone is
    requested and no memory limit set), the GPUs."""
    amounts: dict[str, Any] = {}
    if spec.resources.cpu:
        amounts["cpu"] = spec.resources.cpu
    host = host_tier_bytes(spec)
    if spec.resources.memory:
        memory = parse_quantity(spec.resources.memory)
        amounts["memory"] = (
            _memory_quantity(math.ceil(memory) + host) if host else spec.resources.memory
        )
    if spec.gpus_per_stage() > 0:
        amounts[spec.resources.gpu_resource_name] = str(spec.gpus_per_stage())
    requests = dict(amounts)
    if host and not spec.resources.memory:
        requests["memory"] = _memory_quantity(host)
    if not requests:
        return {}
    return {"requests": requests} | ({"limits": dict(amounts)} if amounts else {})
