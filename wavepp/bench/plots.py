"""PNG plots of a grid: throughput (with the physical bound), efficiency against the bound, and
wave fill vs concurrency (both modes), per model and reuse.

matplotlib with the Agg backend (no display). Input: the rows of ``grid.csv``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def plot_grid(rows: Sequence[dict[str, Any]], out_dir: str | Path) -> list[Path]:
    """Write throughput.png (with the bound), efficiency.png and wave_fill.png into ``out_dir``.

    One panel per (model, reuse, host tier); x = concurrency (log2), one line per mode; the median over
    repeats. Ablation rows are left out.

    Returns:
        The paths written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from wavepp.bench.grid import host_gib_of, median_rows

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = [r for r in median_rows(rows) if not r.get("ablation")]
    panels = sorted({(r["model"], r["reuse"], host_gib_of(r)) for r in base})
    if not panels:
        return []
    written = []
    for metric, ylabel, name in (
        ("throughput_tokens_per_s", "prompt tokens/s (emulated wall time)", "throughput.png"),
        ("efficiency", "throughput / physical bound", "efficiency.png"),
        ("wave_fill", "wave fill (busy / S x wall)", "wave_fill.png"),
    ):
        fig, axes = plt.subplots(
            1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False, sharey=False
        )
        for ax, (model, reuse, gib) in zip(axes[0], panels, strict=True):
            lines = [("wave", metric, "o-"), ("sync", metric, "s--")]
            if metric == "throughput_tokens_per_s":
                lines.append(("wave", "bound_tokens_per_s", "k:"))
            for mode, column, style in lines:
                points = sorted(
                    (int(r["concurrency"]), float(r[column]))
                    for r in base
                    if r["model"] == model
                    and r["reuse"] == reuse
                    and host_gib_of(r) == gib
                    and r["mode"] == mode
                    and r.get(column) not in ("", None)
                )
                if points:
                    xs, ys = zip(*points, strict=True)
                    ax.plot(xs, ys, style, label="bound" if column != metric else mode)
            ax.set_xscale("log", base=2)
            host = f", host {gib} GiB" if gib != "0" else ""
            ax.set_title(f"{model}, {reuse} reuse{host}", fontsize=10)
            ax.set_xlabel("concurrency")
            ax.grid(True, alpha=0.3)
        axes[0][0].set_ylabel(ylabel)
        if axes[0][0].get_legend_handles_labels()[0]:
            axes[0][0].legend()
        fig.tight_layout()
        path = out / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
