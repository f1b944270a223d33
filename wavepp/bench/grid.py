"""``wavepp bench grid``: WavePP (--mode wave) against the synchronous baseline, side by side.

For every setting (model x host tier x concurrency x reuse) both modes run back to back, each on a fresh
local pipeline (real nats-server, real ``wavepp stage`` processes, emulated engine sleeping
``time_scale`` x the derived H200 cost of the model's slowest stage). One run::

    start pipeline -> warm-up prompts (one per shared prefix, sequential, not measured)
                   -> closed loop at concurrency C over the workload's prompts (measured)
                   -> summary (throughput, TTFT p50/p99, wave fill, hit ratio, stage idle)

Ablations switch one WavePP mechanism to its baseline form (agreement sync, chunking static,
local preparation off) in wave mode; each adds a row.

Repeats (``GridSpec.repeats``): each setting runs wave then sync ``repeats`` times in a row;
the CSV keeps every run (column ``repeat``) with its paired ratio, and the table and plots use
the median over repeats (``median_rows``), with the smallest and largest paired ratio.

Stage idle (``idle_by_stage``): within the measured window [first execute start, last execute
end], the time each stage is not executing, and its largest single gap; this is how the report
says which stage idles and when.

Each setting's RuntimeConfig and planner cost model come from the caller
(``launch.grid.runtime_config``); this module runs them and keeps the books.
"""

from __future__ import annotations

import asyncio
import csv
import io
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wavepp.bench.report import ReplayReport, run_closed_loop
from wavepp.bench.workloads import Workload, ideal_hit_ratio, mooncake_workload, preset_workload
from wavepp.runtime.config import AgreementMode, RuntimeConfig
from wavepp.runtime.scheduling.stats import WaveStats
from wavepp.runtime.serving.local import LocalPipeline

# name -> RuntimeConfig overrides applied in wave mode (one mechanism reverted to the baseline)
ABLATIONS: dict[str, dict[str, Any]] = {
    "agreement-sync": {"agreement": AgreementMode.SYNC},
    "chunking-static": {"chunk_policy": "static"},
    "local-prepare-off": {"local_prepare": False},
}

# The columns that name a run's setting (one value per run, not a measurement).
_SETTING_COLUMNS = [
    "model",
    "host_memory_gib",
    "concurrency",
    "reuse",
    "mode",
    "ablation",
    "repeat",
    "requests",
]
CSV_COLUMNS = [
    *_SETTING_COLUMNS,
    "completed",
    "failed",
    "ideal_hit_ratio",
    "cache_hit_ratio",
    "throughput_tokens_per_s",
    "new_tokens_per_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "wave_fill",
    "bound_tokens_per_s",
    "efficiency",
    "agreement_p50_s",
    "agreement_p99_s",
    "microbatches",
    "idle_s_by_stage",
    "max_gap_s_by_stage",
    "host_reused_blocks_by_stage",
    "wall_s",
    "time_scale",
    "ratio_vs_sync",
]


@dataclass(frozen=True)
class GridSpec:
    """What the grid runs. Defaults: H200 time (time scale 1.0). A smaller time scale shrinks the
    stages' compute but not the control plane's costs (NATS, agreement, planning): use it as a
    stress test of the control plane, not as a measure of WavePP against its baseline."""

    models: tuple[str, ...] = ("glm-5.2", "minimax-m2.7")
    concurrencies: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 192, 256)
    reuses: tuple[str, ...] = ("low", "high")
    ablations: tuple[str, ...] = tuple(ABLATIONS)
    ablation_concurrency: int = 128
    ablation_reuse: str = "high"
    num_stages: int = 4
    time_scale: float = 1.0
    block_size: int = 64
    # NOTE: None: each stage's capacity derived from the model and the H200 (planning.memory)
    num_kv_blocks: int | None = None
    chunk_tokens: int = 8192
    min_requests: int = 32
    requests_per_concurrency: float = 1.0
    repeats: int = 1
    seed: int = 0
    # reuse "mooncake": the first trace_requests requests of this Mooncake trace (its own reuse)
    trace: str | None = None
    trace_requests: int = 200
    # host KV tier per GPU, GiB, one grid dimension (0: none; launch.capacity)
    host_memory_gib: tuple[float, ...] = (0.0,)

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError(f"repeats={self.repeats}: must be >= 1")
        if "mooncake" in self.reuses and not self.trace:
            raise ValueError("reuse 'mooncake' needs a trace (--trace PATH)")

    def num_requests(self, concurrency: int) -> int:
        """Measured requests of a setting: max(min_requests, concurrency x factor)."""
        return max(self.min_requests, int(round(concurrency * self.requests_per_concurrency)))


@dataclass(frozen=True)
class Setting:
    model: str
    concurrency: int
    reuse: str
    mode: str
    ablation: str = ""
    repeat: int = 0
    host_memory_gib: float = 0.0  # host KV tier per GPU (0: none)

    @property
    def label(self) -> str:
        extra = f" [{self.ablation}]" if self.ablation else ""
        host = f" host {self.host_memory_gib:g} GiB" if self.host_memory_gib else ""
        return (
            f"{self.model}{host} C={self.concurrency} {self.reuse} {self.mode}{extra} "
            f"#{self.repeat}"
        )


def grid_settings(spec: GridSpec) -> list[Setting]:
    """Every run of the grid in order: per setting (wave, sync) x repeats; ablations last (at
    the first host tier)."""
    runs = [
        Setting(model, c, reuse, mode, repeat=r, host_memory_gib=gib)
        for model in spec.models
        for gib in spec.host_memory_gib
        for reuse in spec.reuses
        for c in spec.concurrencies
        for r in range(spec.repeats)
        for mode in ("wave", "sync")
    ]
    for model in spec.models:
        for name in spec.ablations:
            if name not in ABLATIONS:
                raise ValueError(f"ablation={name!r}: choose from {sorted(ABLATIONS)}")
            for r in range(spec.repeats):
                runs.append(
                    Setting(
                        model,
                        spec.ablation_concurrency,
                        spec.ablation_reuse,
                        "wave",
                        name,
                        r,
                        host_memory_gib=spec.host_memory_gib[0],
                    )
                )
    return runs


def idle_by_stage(stats: WaveStats, num_stages: int) -> tuple[list[float], list[float]]:
    """Per stage: idle seconds and the largest idle gap within the execution window.

    Window: first execute start to last execute end over all stages (as wave fill), over the
    stats' recent spans (every span of a grid run: ``WaveStats.window`` holds more).

    Returns:
        (idle_s, max_gap_s), one entry per stage, seconds.
    """
    if not stats.spans:
        return [0.0] * num_stages, [0.0] * num_stages
    start = min(s.execute_start_s for s in stats.spans)
    end = max(s.execute_end_s for s in stats.spans)
    idle, gaps = [], []
    for rank in range(num_stages):
        spans = sorted((s.execute_start_s, s.execute_end_s) for s in stats.spans if s.rank == rank)
        cursor, total, largest = start, 0.0, 0.0
        for begin, finish in spans:
            gap = max(0.0, begin - cursor)
            total += gap
            largest = max(largest, gap)
            cursor = max(cursor, finish)
        tail = max(0.0, end - cursor)
        idle.append(total + tail)
        gaps.append(max(largest, tail))
    return idle, gaps


async def run_workload(
    config: RuntimeConfig,
    planner_cost_model: Any,
    workload: Workload,
    *,
    concurrency: int,
) -> ReplayReport:
    """Warm up, then replay ``workload`` closed-loop at ``concurrency`` on a fresh pipeline.

    Raises:
        ValueError: concurrency < 1.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency={concurrency}: must be >= 1")
    async with LocalPipeline(config, planner_cost_model) as pipeline:
        scheduler = pipeline.scheduler
        assert scheduler is not None, "pipeline started without a scheduler"
        return await run_closed_loop(
            scheduler,
            config,
            list(zip(workload.request_ids, workload.prompts, strict=True)),
            concurrency=concurrency,
            warmup=workload.warmup,
        )


def run_setting(
    spec: GridSpec, setting: Setting, config: RuntimeConfig, planner_cost: Any
) -> dict[str, Any]:
    """Run one setting on a fresh pipeline with its stages' ``config`` and the planner's cost
    model (``launch.grid.runtime_config``); returns one CSV row (CSV_COLUMNS, no ratio yet).

    Raises:
        ValueError: reuse 'mooncake' without ``spec.trace``.
    """
    if setting.reuse == "mooncake":
        if not spec.trace:
            raise ValueError("reuse 'mooncake' needs GridSpec.trace")
        workload = mooncake_workload(
            spec.trace, spec.trace_requests, vocab_size=config.model.vocab_size, seed=spec.seed
        )
    else:
        workload = preset_workload(
            setting.reuse,
            spec.num_requests(setting.concurrency),
            vocab_size=config.model.vocab_size,
            seed=spec.seed,
        )
    report = asyncio.run(
        run_workload(config, planner_cost, workload, concurrency=setting.concurrency)
    )
    summary = report.summary()
    idle, gaps = idle_by_stage(report.stats, spec.num_stages)
    row = {key: summary.get(key, "") for key in CSV_COLUMNS}
    row.update(
        model=setting.model,
        host_memory_gib=setting.host_memory_gib,
        concurrency=setting.concurrency,
        reuse=setting.reuse,
        mode=setting.mode,
        ablation=setting.ablation,
        repeat=setting.repeat,
        ideal_hit_ratio=round(
            ideal_hit_ratio(workload.prompts, spec.block_size, workload.warmup), 4
        ),
        idle_s_by_stage=" ".join(f"{v:.3f}" for v in idle),
        max_gap_s_by_stage=" ".join(f"{v:.3f}" for v in gaps),
        host_reused_blocks_by_stage=" ".join(
            str(v) for v in summary.get("stage_host_reused_blocks", [])
        ),
        time_scale=spec.time_scale,
        ratio_vs_sync="",
    )
    return row


def host_gib_of(row: dict[str, Any]) -> str:
    """A row's host tier, GiB per GPU, as one string ("0" for rows that predate the column)."""
    return f"{float(row.get('host_memory_gib') or 0):g}"


def _where(row: dict[str, Any]) -> tuple[str, str, str, str]:
    """A row's (model, host tier, concurrency, reuse), as strings: the cell it belongs to."""
    return (row["model"], host_gib_of(row), str(row["concurrency"]), row["reuse"])


def _key(row: dict[str, Any]) -> tuple[str, ...]:
    return (*_where(row), str(row.get("repeat", 0) or 0))


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Set ratio_vs_sync = throughput / the throughput of the sync row of the same setting and
    repeat."""
    sync = {
        _key(r): float(r["throughput_tokens_per_s"])
        for r in rows
        if r["mode"] == "sync" and not r["ablation"]
    }
    for row in rows:
        base = sync.get(_key(row))
        if base:
            row["ratio_vs_sync"] = round(float(row["throughput_tokens_per_s"]) / base, 4)


# Per-run metrics aggregated over repeats; the rest of CSV_COLUMNS name the setting, repeat
# the same value, or are per-stage strings.
_NOT_MEDIAN = {
    *_SETTING_COLUMNS,
    "ideal_hit_ratio",
    "idle_s_by_stage",
    "max_gap_s_by_stage",
    "host_reused_blocks_by_stage",
    "time_scale",
}
_MEDIAN_FIELDS = tuple(c for c in CSV_COLUMNS if c not in _NOT_MEDIAN)


def median_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (model, host tier, C, reuse, mode, ablation): the median of each metric over
    repeats.

    Adds ``repeats`` (runs aggregated), ``ratio_min`` and ``ratio_max`` (the extreme paired
    ratios). Rows keep their first-seen order; the per-stage idle strings are the first run's.
    """
    groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((*_where(r), r["mode"], r["ablation"] or ""), []).append(r)
    out = []
    for members in groups.values():
        row = dict(members[0])
        for name in _MEDIAN_FIELDS:
            values = [float(m[name]) for m in members if m.get(name) not in ("", None)]
            if values:
                row[name] = statistics.median(values)
        ratios = [float(m["ratio_vs_sync"]) for m in members if m.get("ratio_vs_sync") != ""]
        row["repeats"] = len(members)
        row["ratio_min"] = min(ratios) if ratios else ""
        row["ratio_max"] = max(ratios) if ratios else ""
        out.append(row)
    return out


def write_csv(rows: Sequence[dict[str, Any]], path: str | Path) -> None:
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def read_csv(path: str | Path) -> list[dict[str, Any]]:
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def _fmt(value: Any, digits: int = 3) -> str:
    try:
        return f"{float(value):.{digits}f}"
    except (TypeError, ValueError):
        return str(value)


def markdown_table(rows: Sequence[dict[str, Any]], spec: GridSpec, command: str = "") -> str:
    """The grid as Markdown: one line per setting (wave and sync side by side), then ablations,
    then the win count. Throughput in prompt tokens per second of *emulated* wall time at
    ``time_scale`` (divide by 1/time_scale for H200-scale figures; ratios are unaffected).
    With repeats, every figure is the median over repeats; the ratio is the median of the
    paired (same repeat) ratios, with their range."""
    rows = median_rows(rows)
    out = io.StringIO()
    out.write(
        f"Emulated engine: each of {spec.num_stages} stages sleeps time_scale={spec.time_scale}"
        " x the derived H200 cost of the model's slowest stage; NATS, agreement, planning,"
        " stage processes and activations are real. Block size "
        f"{spec.block_size}, "
        f"{spec.num_kv_blocks or 'derived (model and H200 memory, planning.memory)'} KV blocks "
        "per stage, chunk_tokens "
        f"{spec.chunk_tokens}. Throughput: prompt tokens/s of wall time (x{spec.time_scale} "
        "scale). hit: measured cached/prompt tokens.\n\n"
    )
    if spec.trace and "mooncake" in spec.reuses:
        out.write(
            f"reuse `mooncake`: the first {spec.trace_requests} requests of `{spec.trace}` "
            "(each hash id a 512-token block of seeded tokens; the trace's own reuse, no "
            "warm-up).\n\n"
        )
    if spec.repeats > 1:
        out.write(
            f"Each setting ran {spec.repeats} times (wave, sync, wave, sync, ...); figures are "
            "medians, the ratio is the median of the paired ratios [min-max].\n\n"
        )
    if command:
        out.write(f"Command: `{command}`\n\n")
    by_key = {(*_where(r), r["mode"] + r["ablation"]): r for r in rows}
    out.write(
        "| model | host GiB | C | reuse | hit wave/sync | tok/s wave | tok/s sync | ratio | "
        "bound tok/s | efficiency wave/sync | "
        "TTFT p50 wave/sync (s) | TTFT p99 wave/sync (s) | wave fill wave/sync |\n"
    )
    out.write(
        "| --- | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | --- | --- | --- | --- |\n"
    )
    wins = total = 0
    seen = []
    for r in rows:
        key = _where(r)
        if r["ablation"] or key in seen:
            continue
        seen.append(key)
        w, s = by_key.get((*key, "wave")), by_key.get((*key, "sync"))
        if w is None or s is None:
            continue
        ratio = (
            float(w["ratio_vs_sync"])
            if w.get("ratio_vs_sync") not in ("", None)
            else (
                float(w["throughput_tokens_per_s"]) / max(float(s["throughput_tokens_per_s"]), 1e-9)
            )
        )
        spread = (
            f" [{float(w['ratio_min']):.2f}-{float(w['ratio_max']):.2f}]"
            if w.get("repeats", 1) > 1 and w.get("ratio_min") != ""
            else ""
        )
        total += 1
        wins += ratio > 1.0
        out.write(
            f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {_fmt(w['cache_hit_ratio'], 2)}/"
            f"{_fmt(s['cache_hit_ratio'], 2)} | {_fmt(w['throughput_tokens_per_s'], 0)} | "
            f"{_fmt(s['throughput_tokens_per_s'], 0)} | **{ratio:.2f}**{spread} | "
            f"{_fmt(w.get('bound_tokens_per_s', ''), 0)} | "
            f"{_fmt(w.get('efficiency', ''), 2)}/{_fmt(s.get('efficiency', ''), 2)} | "
            f"{_fmt(w['ttft_p50_s'])}/{_fmt(s['ttft_p50_s'])} | "
            f"{_fmt(w['ttft_p99_s'])}/{_fmt(s['ttft_p99_s'])} | "
            f"{_fmt(w['wave_fill'], 2)}/{_fmt(s['wave_fill'], 2)} |\n"
        )
    out.write(f"\nWavePP wins {wins} of {total} settings (ratio > 1.00).\n")
    ablations = [r for r in rows if r["ablation"]]
    if ablations:
        out.write(
            "\nAblations (wave mode with one mechanism reverted to the baseline's):\n\n"
            "| model | C | reuse | variant | tok/s | vs sync | vs full wave | TTFT p50 (s) | "
            "wave fill |\n| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |\n"
        )
        for r in ablations:
            key = _where(r)
            w, s = by_key.get((*key, "wave")), by_key.get((*key, "sync"))
            thr = float(r["throughput_tokens_per_s"])
            vs_sync = thr / float(s["throughput_tokens_per_s"]) if s else float("nan")
            vs_wave = thr / float(w["throughput_tokens_per_s"]) if w else float("nan")
            out.write(
                f"| {key[0]} | {key[2]} | {key[3]} | {r['ablation']} | {thr:.0f} | "
                f"{vs_sync:.2f} | {vs_wave:.2f} | {_fmt(r['ttft_p50_s'])} | "
                f"{_fmt(r['wave_fill'], 2)} |\n"
            )
    return out.getvalue()
