"""Wave fill and stage intervals from recorded spans (docs/design.md 'Terms': wave fill).

The runtime's own number is ``WaveStats.wave_fill`` (from the stages' ``MicroBatchDone``
reports); this recomputes it from ``stage.execute`` spans alone, so a trace file is enough:

    wave fill = sum over (stage, micro-batch) of execute time / (S x (last end - first start))

Each request chunk of a micro-batch has its own ``stage.execute`` span (see ``pipeline.py``);
spans are deduplicated on (``stage.rank``, ``microbatch.id``) first.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from wavepp.telemetry.spans import SpanRecord


@dataclass(frozen=True)
class StageInterval:
    """One stage's phase of one micro-batch. Times: seconds since the epoch."""

    rank: int
    microbatch_id: int
    phase: str  # "prepare" or "execute"
    start_s: float
    end_s: float
    num_tokens: int


def stage_intervals(records: Iterable[SpanRecord]) -> list[StageInterval]:
    """One interval per (stage, micro-batch, phase), sorted by start; ignores other spans."""
    seen: dict[tuple[int, int, str], StageInterval] = {}
    for record in records:
        if record.name not in ("stage.prepare", "stage.execute"):
            continue
        attrs = record.attributes
        key = (int(attrs["stage.rank"]), int(attrs["microbatch.id"]), record.name[6:])
        if key in seen:
            continue
        seen[key] = StageInterval(
            rank=key[0],
            microbatch_id=key[1],
            phase=key[2],
            start_s=record.start_ns / 1e9,
            end_s=record.end_ns / 1e9,
            num_tokens=int(attrs.get("microbatch.num_tokens", attrs.get("tokens.new", 0))),
        )
    return sorted(seen.values(), key=lambda i: (i.start_s, i.rank))


def num_stages_of(intervals: Iterable[StageInterval]) -> int:
    """S as seen in the spans: highest stage rank + 1 (0 if there are none)."""
    return max((i.rank for i in intervals), default=-1) + 1


def wave_fill_from_spans(records: Iterable[SpanRecord], num_stages: int | None = None) -> float:
    """Wave fill in [0, 1] from ``stage.execute`` spans; 0.0 when there are none.

    Args:
        records: spans of one run (any order; other span names are ignored).
        num_stages: S; None takes it from the highest ``stage.rank`` seen.

    Raises:
        ValueError: ``num_stages`` < 1, or smaller than a stage rank seen.
    """
    execute = [i for i in stage_intervals(records) if i.phase == "execute"]
    seen_stages = num_stages_of(execute)
    stages = seen_stages if num_stages is None else num_stages
    if num_stages is not None and (num_stages < 1 or num_stages < seen_stages):
        raise ValueError(
            f"num_stages={num_stages}: must be >= 1 and >= the {seen_stages} stages in the spans"
        )
    if not execute:
        return 0.0
    start = min(i.start_s for i in execute)
    end = max(i.end_s for i in execute)
    busy = sum(i.end_s - i.start_s for i in execute)
    return busy / (stages * (end - start)) if end > start else 0.0
