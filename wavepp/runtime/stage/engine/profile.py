"""Named regions of a stage's micro-batch for ``torch.profiler``, and their per-part summary.

The engine and the stage worker wrap their parts in :func:`region` (``torch.profiler``'s
``record_function`` while a profiler records, a no-op otherwise, so an unprofiled stage pays
one flag check per region). Regions do not nest: every part of a micro-batch is in at most one,
so their times add up and the rest of a micro-batch's wall time is Python and glue
(:func:`part_table`'s ``other``).

    with torch.profiler.profile() as prof:
        engine.execute(engine.prepare(chunks), None)
    print("\\n".join(part_table(region_totals_us(prof.key_averages()), wall_us, batches)))
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.autograd.profiler import record_function

PREFIX = "wavepp."
PARTS: dict[str, str] = {
    "prepare": "plan handling: block tables, slots, positions, RoPE tables (engine.prepare)",
    "embed": "token embedding (first stage)",
    "norm": "RMSNorms (input, post-attention)",
    "qkv": "attention input projections, q/k norms, RoPE (MLA: latent and query paths)",
    "kv_write": "scatter of the new tokens' K/V (latents) into the paged cache",
    "kv_gather": "gather of a chunk's context from the paged cache (MLA: and its expansion)",
    "attention": "softmax attention kernel of every chunk (DSA: plus its top-k selection)",
    "attn_out": "attention output projection and its TP all-reduce",
    "mlp": "dense SwiGLU MLP",
    "moe": "MoE router, routed and shared experts",
    "linear_attn": "KDA linear-attention layer (whole layer)",
    "head": "final norm and lm_head (last stage)",
    "recv": "activation receive from the previous stage",
    "send": "activation send to the next stage",
}
"""Region name (without :data:`PREFIX`) -> what it covers."""

_NULL = contextlib.nullcontext()


def region(part: str) -> contextlib.AbstractContextManager[Any]:
    """A ``record_function("wavepp.<part>")`` while a profiler records, else a no-op.

    Raises:
        KeyError: ``part`` is not one of :data:`PARTS`.
    """
    if part not in PARTS:
        raise KeyError(f"part={part!r} is not a profile region; one of {sorted(PARTS)}")
    if torch.autograd._profiler_enabled():
        return record_function(PREFIX + part)
    return _NULL


def region_totals_us(events: Iterable[Any], field: str = "cpu_time_total") -> dict[str, float]:
    """Total time (microseconds) per part from ``profiler.key_averages()``: the events whose
    key is ``wavepp.<part>``; a part never entered is absent. ``field``: ``cpu_time_total``
    (host time: on a CPU the part's compute) or ``device_time_total`` (the GPU kernels run
    inside the part, with ``ProfilerActivity.CUDA``)."""
    totals: dict[str, float] = {}
    for event in events:
        key = getattr(event, "key", "")
        if key.startswith(PREFIX) and key[len(PREFIX) :] in PARTS:
            part = key[len(PREFIX) :]
            totals[part] = totals.get(part, 0.0) + float(getattr(event, field))
    return totals


def part_table(totals_us: Mapping[str, float], wall_us: float, microbatches: int) -> list[str]:
    """Lines of a per-part table: ms per micro-batch and share of ``wall_us`` (the profiled
    micro-batches' wall time, microseconds) for every part present, then ``other`` (wall time
    outside every region: Python, allocation, glue; negative only if regions overlapped).

    Raises:
        ValueError: ``microbatches`` < 1 or ``wall_us`` <= 0.
    """
    if microbatches < 1:
        raise ValueError(f"microbatches={microbatches} must be >= 1")
    if wall_us <= 0:
        raise ValueError(f"wall_us={wall_us} must be > 0")
    lines = [f"{'part':<12} {'ms/micro-batch':>15} {'share':>7}"]
    covered = 0.0
    for part in PARTS:
        if part in totals_us:
            us = totals_us[part]
            covered += us
            lines.append(f"{part:<12} {us / 1e3 / microbatches:>15.3f} {us / wall_us:>7.1%}")
    other = wall_us - covered
    lines.append(f"{'other':<12} {other / 1e3 / microbatches:>15.3f} {other / wall_us:>7.1%}")
    lines.append(f"{'total':<12} {wall_us / 1e3 / microbatches:>15.3f} {1:>7.1%}")
    return lines
