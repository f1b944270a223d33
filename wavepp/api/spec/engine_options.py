"""``spec.engineOptions``: the runtime knobs the spec has no typed field for, checked (pure).

``engineOptions`` is free-form in the CRD (``x-kubernetes-preserve-unknown-fields``), so its
values arrive untyped; :func:`check_engine_options` refuses, naming the key, every value the
runtime could not honour: an unknown key, a wrong type (``timeScale: abc``, a mapping where a
number belongs), a non-finite number (``.inf``, ``.nan``) or one past the documented bound.
Which engine reads which key, and the refusal of a key the spec's engine does not read (e.g.
``device``, which follows ``resources.gpusPerStage``), is ``checks.ENGINE_OPTIONS`` (run first);
a test checks its keys are these.

| key              | type                                  | bound                              |
| ---------------- | ------------------------------------- | ---------------------------------- |
| ``kvBlocks``     | int, or a list of ints (one per stage) | each in [1, 2**31 - 1]; <= 64 entries |
| ``timeScale``    | number                                | in (0, 1000]                       |
| ``emulate``      | string (a cost model's name)          | 1 to 128 characters                |
| ``torchThreads`` | int                                   | in [1, 1024]                       |
| ``torchCompile`` | bool (``torch.compile`` the layers' dense parts) | true or false            |
| ``packWeights``  | bool (pre-packed projection weights; default true) | true or false          |
| ``pinCores``     | bool (wavepp up pins each stage to its share of the cores; the operator refuses it; default false) | true or false |
| ``seed``         | int                                   | in [0, 2**63 - 1]                  |
| ``maxInflight``  | int (micro-batches in flight)         | in [1, 1024]                       |
| ``returnMicrobatches`` | int (micro-batch times a closed-loop round's way back counts) | in [0, 1024] |
| ``leaseSeconds`` | number (pin and reservation lease)    | in (0, 86400]                      |
| ``maxBlocksPerOwner`` | int (KV blocks one admission instance may hold per stage) | in [1, 2**31 - 1] |
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from wavepp.api.spec.errors import SpecError

MAX_KV_BLOCKS = 2**31 - 1


def _int(key: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"engineOptions.{key}", f"{value!r:.60}: must be an integer")
    if not low <= value <= high:
        raise SpecError(f"engineOptions.{key}", f"{value}: must be in [{low}, {high}]")


def _number(key: str, value: object, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(f"engineOptions.{key}", f"{value!r:.60}: must be a number")
    if not math.isfinite(value) or not 0 < value <= high:
        raise SpecError(f"engineOptions.{key}", f"{value}: must be a finite number in (0, {high}]")


def _kv_blocks(value: object) -> None:
    values = value if isinstance(value, list) else [value]
    if not values or len(values) > 64:
        raise SpecError("engineOptions.kvBlocks", "give an int or a list of 1 to 64 ints")
    for item in values:
        _int("kvBlocks", item, 1, MAX_KV_BLOCKS)


def _bool(key: str, value: object) -> None:
    if not isinstance(value, bool):
        raise SpecError(f"engineOptions.{key}", f"{value!r:.60}: must be true or false")


def _string(key: str, value: object) -> None:
    if not isinstance(value, str) or not 1 <= len(value) <= 128:
        raise SpecError(f"engineOptions.{key}", f"{value!r:.60}: must be a string")


_CHECKS: dict[str, Any] = {
    "kvBlocks": _kv_blocks,
    "timeScale": lambda v: _number("timeScale", v, 1000.0),
    "emulate": lambda v: _string("emulate", v),
    "torchThreads": lambda v: _int("torchThreads", v, 1, 1024),
    "torchCompile": lambda v: _bool("torchCompile", v),
    "packWeights": lambda v: _bool("packWeights", v),
    "pinCores": lambda v: _bool("pinCores", v),
    "seed": lambda v: _int("seed", v, 0, 2**63 - 1),
    "maxInflight": lambda v: _int("maxInflight", v, 1, 1024),
    "returnMicrobatches": lambda v: _int("returnMicrobatches", v, 0, 1024),
    "leaseSeconds": lambda v: _number("leaseSeconds", v, 86400.0),
    "maxBlocksPerOwner": lambda v: _int("maxBlocksPerOwner", v, 1, MAX_KV_BLOCKS),
}
ENGINE_OPTION_KEYS = tuple(_CHECKS)


def check_engine_options(options: Mapping[str, object]) -> None:
    """Refuse the first engine option the runtime could not honour.

    Args:
        options: ``spec.engineOptions`` as read (camelCase keys).

    Raises:
        SpecError: naming ``engineOptions.<key>`` and the type or bound it breaks.
    """
    for key, value in options.items():
        check = _CHECKS.get(key)
        if check is None:
            raise SpecError(
                f"engineOptions.{key}", f"unknown option; known: {', '.join(ENGINE_OPTION_KEYS)}"
            )
        check(value)
