"""Which cores a stage process runs on (``RuntimeConfig.pin_cores``, ``wavepp stage --cores``).

A launcher that starts several stage processes on one host (``LocalPipeline``, ``wavepp up``)
gives each, with ``pin_cores``, a disjoint, equal, contiguous share of the cores it may use
itself, in stage order (``stage_cores``), and the stage restricts itself to it at start
(``pin_to``), before torch starts its threads: a stage's torch threads then never migrate onto
another stage's core. The control processes (scheduler, admission, gateway, nats-server) are
not placed: they float over every core. A pod's stage is alone in its container, placed by the
kubelet's CPU manager; the operator refuses ``pinCores``.
"""

from __future__ import annotations

import os
from collections.abc import Collection


def stage_cores(allowed: Collection[int], num_stages: int, index: int) -> tuple[int, ...]:
    """Stage ``index``'s share of ``allowed`` (CPU ids) among ``num_stages`` stages on one host:
    the ``index``-th of ``num_stages`` contiguous groups of ``len(allowed) // num_stages``
    cores, in ascending id order (cores past the last whole group are left to the control
    processes).

    Raises:
        ValueError: ``num_stages`` < 1 or ``index`` outside [0, num_stages); naming
            ``engineOptions.pinCores``, fewer cores than stages (no share for each).
    """
    if num_stages < 1:
        raise ValueError(f"num_stages={num_stages}: must be >= 1")
    if not 0 <= index < num_stages:
        raise ValueError(f"index={index}: must be in [0, num_stages={num_stages})")
    cores = sorted(allowed)
    per_stage = len(cores) // num_stages
    if per_stage == 0:
        raise ValueError(
            f"engineOptions.pinCores: {num_stages} stages on {len(cores)} cores: each stage "
            "needs a core of its own (fewer stages, or pinCores false)"
        )
    return tuple(cores[index * per_stage : (index + 1) * per_stage])


def launcher_cores() -> list[int]:
    """The cores this process may use (what a launcher shares among its stages)."""
    return sorted(os.sched_getaffinity(0))


def parse_cores(text: str) -> tuple[int, ...]:
    """``--cores`` ("0,1,4"): the CPU ids, each once.

    Raises:
        ValueError: naming ``--cores``: empty, not integers, negative or repeated ids.
    """
    try:
        cores = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--cores {text!r}: must be CPU ids separated by commas") from None
    if any(core < 0 for core in cores) or len(set(cores)) != len(cores):
        raise ValueError(f"--cores {text!r}: CPU ids must be >= 0, each once")
    return cores


def pin_to(cores: Collection[int]) -> None:
    """Restrict this process's calling thread, and every thread it starts afterwards, to
    ``cores``, every one of which this process may use (the kernel would silently drop the
    others).

    Raises:
        ValueError: naming ``--cores``: a core this process may not use (or none at all).
    """
    allowed = launcher_cores()
    outside = sorted(set(cores) - set(allowed))
    if outside or not cores:
        raise ValueError(
            f"--cores {','.join(map(str, cores))}: not cores this process may use "
            f"({','.join(map(str, outside)) or 'none given'}; it may use "
            f"{','.join(map(str, allowed))})"
        )
    try:
        os.sched_setaffinity(0, cores)
    except OSError as exc:  # the cores allowed changed meanwhile (a cgroup's cpuset)
        raise ValueError(f"--cores {','.join(map(str, cores))}: {exc.strerror}") from None
