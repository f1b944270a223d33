"""The picture of the pipeline: a per-stage Gantt chart of micro-batches, and throughput over time.

Top panel: one row per stage (stage 0 on top), one bar per micro-batch's execute phase, coloured
by micro-batch id (so one micro-batch's diagonal through the stages is visible), a thin bar below
it for its prepare phase; white gaps are bubbles. The title carries the wave fill computed from
the same spans. Bottom panel: tokens per second leaving the last stage, in ``num_bins`` bins.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from wavepp.telemetry.spans import SpanRecord
from wavepp.telemetry.wavefill import num_stages_of, stage_intervals, wave_fill_from_spans


def draw_timeline(
    records: Iterable[SpanRecord],
    path: str | os.PathLike[str],
    *,
    num_stages: int | None = None,
    title: str = "",
    num_bins: int | None = None,
) -> dict[str, float]:
    """Write the timeline PNG of ``records`` to ``path``.

    Args:
        records: spans of one run (``stage.prepare`` / ``stage.execute`` are drawn).
        path: output PNG.
        num_stages: S; None: from the spans.
        title: prefix of the figure title.
        num_bins: bins of the throughput plot (None: half the micro-batches, in [5, 40]).

    Returns:
        ``{"wave_fill", "num_stages", "num_microbatches", "window_s"}`` of what was drawn.

    Raises:
        ValueError: there are no stage spans to draw, or ``num_bins`` < 1.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if num_bins is not None and num_bins < 1:
        raise ValueError(f"num_bins={num_bins}: must be >= 1")
    records = list(records)
    intervals = stage_intervals(records)
    execute = [i for i in intervals if i.phase == "execute"]
    if not execute:
        raise ValueError("no stage.execute spans to draw (was tracing on and sampled?)")
    num_microbatches = len({i.microbatch_id for i in execute})
    if num_bins is None:
        num_bins = max(5, min(40, num_microbatches // 2))
    stages = num_stages or num_stages_of(execute)
    fill = wave_fill_from_spans(records, stages)
    t0 = min(i.start_s for i in intervals)
    t_end = max(i.end_s for i in execute)
    window_s = max(t_end - t0, 1e-9)
    cmap = plt.get_cmap("tab20")

    fig, (ax, ax_tp) = plt.subplots(
        2, 1, figsize=(12, 1.0 + 0.8 * stages + 2.2), height_ratios=[0.8 * stages, 2.2]
    )
    for interval in intervals:
        row = stages - 1 - interval.rank
        x = (interval.start_s - t0, max(interval.end_s - interval.start_s, 1e-9))
        if interval.phase == "execute":
            ax.broken_barh(
                [x],
                (row - 0.3, 0.6),
                facecolors=cmap(interval.microbatch_id % 20),
                edgecolor="black",
                linewidth=0.3,
            )
        else:
            ax.broken_barh([x], (row - 0.42, 0.1), facecolors="0.45")
    ax.set_yticks(range(stages), [f"stage {stages - 1 - r}" for r in range(stages)])
    ax.set_xlim(0, window_s)
    ax.set_xlabel(
        "time since the first stage span (s); bars: execute, coloured by micro-batch; "
        "grey ticks below: prepare; gaps: bubbles"
    )
    heading = f"{title}: " if title else ""
    ax.set_title(
        f"{heading}wave fill {fill:.1%} (bubbles {1 - fill:.1%}), {stages} stages, "
        f"{num_microbatches} micro-batches"
    )

    last = [i for i in execute if i.rank == stages - 1]
    bin_s = window_s / num_bins
    tokens = [0.0] * num_bins
    for interval in last:
        index = min(int((interval.end_s - t0) / bin_s), num_bins - 1)
        tokens[index] += interval.num_tokens
    centers = [(b + 0.5) * bin_s for b in range(num_bins)]
    ax_tp.bar(centers, [t / bin_s for t in tokens], width=bin_s * 0.9, color="tab:blue")
    ax_tp.set_xlim(0, window_s)
    ax_tp.set_xlabel("time (s)")
    ax_tp.set_ylabel("new tokens/s\n(last stage)")
    ax_tp.set_title("throughput over time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return {
        "wave_fill": fill,
        "num_stages": float(stages),
        "num_microbatches": float(num_microbatches),
        "window_s": window_s,
    }
