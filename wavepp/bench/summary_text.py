"""The replay summary in words (pure): what each number is, in which unit, and what it means,
for the table ``wavepp replay`` prints; nothing here prints.

Units: ``tokens`` are prompt tokens; ``blocks`` are KV blocks of ``block_size`` tokens; times in
seconds. A stage's *local hit* is how many leading blocks of a prompt that stage held when the
request was agreed; the *agreed prefix* (L*) is the smallest local hit over the stages (capped so
the last token is computed): only it is reused, so blocks a stage held beyond it are recomputed
there. With host tiers a local hit is the device run and then the host run after it (*host
hit*); of the agreed prefix, a stage loads from its host tier what its device run falls short
of (*from host*) and reads the rest from its device.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

_PATH = re.compile(r"(?:[A-Za-z]:)?(?:/[\w.+-]+){2,}/?")


def clean_source(text: str) -> str:
    """``text`` with every absolute path cut to its last part (no machine paths in output)."""
    return _PATH.sub(lambda m: m.group(0).rstrip("/").rsplit("/", 1)[-1], text)


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f} %"


def summary_rows(summary: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """``(metric with unit, value, what it means)`` rows of the replay summary."""
    engine = summary.get("engine", "")
    model = summary.get("model", "")
    runs_on = (
        f"{model}'s cost model at H200 speed, slept by each stage (emulated engine)"
        if engine == "emulated"
        else f"{model}'s layers computed by torch (seeded random weights)"
    )
    stages = summary.get("stages", 0)
    rows = [
        ("model", str(model), runs_on),
        ("mode", str(summary.get("mode")), "wave = WavePP; sync = the baseline (--mode sync)"),
        ("stages", str(stages), "pipeline stages S, one process each"),
        (
            "requests",
            f"{summary.get('completed')} ok / {summary.get('failed')} failed",
            f"of {summary.get('requests')} ({summary.get('invalid_lines', 0)} invalid lines)",
        ),
        (
            "prompt tokens",
            f"{summary.get('prompt_tokens'):,}",
            f"{summary.get('cached_tokens'):,} reused from the cache (cached_tokens), "
            f"{summary.get('new_tokens'):,} computed",
        ),
        (
            "cache hit",
            _pct(summary.get("cache_hit_ratio")),
            "share of prompt tokens reused (the prefix agreed on every stage)",
        ),
        (
            "throughput (tokens/s)",
            f"{summary.get('throughput_tokens_per_s'):,}",
            "prompt tokens (reused and computed) per second of wall time",
        ),
    ]
    bound = summary.get("bound_tokens_per_s")
    rows.append(
        (
            "efficiency",
            _pct(summary.get("efficiency")),
            f"throughput / the physical bound of these stages ({bound:,} tokens/s)"
            if bound
            else "unknown for the torch engine (its cost is measured, not modelled)",
        )
    )
    rows += [
        (
            "wave fill",
            _pct(summary.get("wave_fill")),
            f"time the {stages} stages were busy / ({stages} x the run); 100 % = no bubbles",
        ),
        (
            "TTFT p50 / p99 (s)",
            f"{summary.get('ttft_p50_s')} / {summary.get('ttft_p99_s')}",
            "arrival to first token, per request",
        ),
        (
            "agreement p50 / p99 (s)",
            f"{summary.get('agreement_p50_s')} / {summary.get('agreement_p99_s')}",
            "time to agree on the shared prefix with every stage",
        ),
        (
            "reservation refusals",
            str(summary.get("reservation_refusals")),
            "admissions retried because a stage had no free blocks",
        ),
        ("micro-batches", str(summary.get("microbatches")), "plans sent to the stages"),
        ("wall time (s)", str(summary.get("wall_s")), "first arrival to last answer"),
        (
            "planner cost model",
            clean_source(str(summary.get("planner_cost_model", ""))),
            "what the planner assumes a chunk costs",
        ),
    ]
    for error in summary.get("errors", [])[:3]:
        rows.append(("error", clean_source(str(error)), "first distinct errors"))
    return rows


def stage_rows(summary: Mapping[str, Any]) -> list[tuple[str, ...]]:
    """Per stage: ``(rank, layers, KV capacity (blocks), local hit (blocks), of it host hit
    (blocks), agreed prefix (blocks), of it from host (blocks), held but not shared (blocks),
    busy (s))``; totals over completed requests."""
    stages = int(summary.get("stages", 0))
    hits = summary.get("stage_local_hit_blocks") or [0] * stages
    host_hits = summary.get("stage_host_hit_blocks") or [0] * stages
    host_reused = summary.get("stage_host_reused_blocks") or [0] * stages
    capacity = summary.get("kv_blocks_per_stage") or [0] * stages
    layers = summary.get("layers_per_stage")
    busy = summary.get("stage_busy_s") or [0.0] * stages
    agreed = int(summary.get("agreed_prefix_blocks", 0))
    return [
        (
            str(r),
            "-" if not layers else str(layers[r]),
            f"{capacity[r]:,}",
            f"{hits[r]:,}",
            f"{host_hits[r]:,}",
            f"{agreed:,}",
            f"{host_reused[r]:,}",
            f"{max(0, hits[r] - agreed):,}",
            f"{busy[r]:.2f}",
        )
        for r in range(stages)
    ]
