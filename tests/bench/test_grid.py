"""Grid bookkeeping (no processes): settings, stage idle, ratios, the Markdown table, the CLI."""

from __future__ import annotations

import pytest

from wavepp.bench.grid import (
    GridSpec,
    add_ratios,
    grid_settings,
    idle_by_stage,
    markdown_table,
    median_rows,
    read_csv,
    write_csv,
)
from wavepp.cli import main
from wavepp.launch.capacity import host_tier_fields
from wavepp.launch.grid import runtime_config
from wavepp.runtime.config import AgreementMode
from wavepp.runtime.scheduling.stats import StageSpan, WaveStats


def test_grid_has_every_setting_in_both_modes_and_the_ablations() -> None:
    settings = grid_settings(GridSpec())
    base = [s for s in settings if not s.ablation]
    assert len(base) == 2 * 10 * 2 * 2
    assert {(s.mode) for s in base} == {"wave", "sync"}
    assert [s.ablation for s in settings if s.ablation] == [
        "agreement-sync",
        "chunking-static",
        "local-prepare-off",
    ] * 2
    assert GridSpec().num_requests(1) == 32 and GridSpec().num_requests(256) == 256


def test_ablation_reverts_exactly_one_mechanism() -> None:
    spec = GridSpec(time_scale=0.2)
    (setting,) = [s for s in grid_settings(spec) if s.ablation == "chunking-static"][:1]
    config, planner = runtime_config(spec, setting)
    assert config.mode == "wave"
    assert config.resolved_chunk_policy == "static"
    assert config.resolved_agreement is AgreementMode.ASYNC and config.resolved_local_prepare
    stage = config.cost_model or {}
    assert planner.c == pytest.approx(0.2 * float(stage["c"]))  # planner gets the scaled model


def _span(rank: int, start: float, end: float) -> StageSpan:
    return StageSpan(rank, 0, 1, start, start, start, end)


def test_idle_by_stage_finds_gaps_and_the_tail() -> None:
    stats = WaveStats(
        spans=[_span(0, 0.0, 1.0), _span(0, 3.0, 4.0), _span(1, 1.0, 2.0), _span(1, 2.0, 5.0)]
    )
    idle, gaps = idle_by_stage(stats, 2)
    assert idle == pytest.approx([3.0, 1.0])  # stage 0: gap 1-3 and tail 4-5; stage 1: head 0-1
    assert gaps == pytest.approx([2.0, 1.0])


def _row(
    model: str,
    c: int,
    mode: str,
    thr: float,
    ablation: str = "",
    repeat: int = 0,
    host_memory_gib: float = 0.0,
) -> dict:
    return {
        "model": model,
        "host_memory_gib": host_memory_gib,
        "concurrency": c,
        "reuse": "high",
        "mode": mode,
        "ablation": ablation,
        "repeat": repeat,
        "throughput_tokens_per_s": thr,
        "cache_hit_ratio": 0.8,
        "ttft_p50_s": 0.1,
        "ttft_p99_s": 0.2,
        "wave_fill": 0.5,
    }


def test_ratios_wins_and_table(tmp_path) -> None:  # noqa: ANN001
    rows = [
        _row("m", 1, "wave", 300.0),
        _row("m", 1, "sync", 100.0),
        _row("m", 2, "wave", 90.0),
        _row("m", 2, "sync", 100.0),
        _row("m", 2, "wave", 150.0, ablation="chunking-static"),
    ]
    add_ratios(rows)
    assert [r["ratio_vs_sync"] for r in rows] == [3.0, 1.0, 0.9, 1.0, 1.5]
    table = markdown_table(rows, GridSpec(time_scale=0.1), "wavepp bench grid --x")
    assert "**3.00**" in table and "**0.90**" in table
    assert "WavePP wins 1 of 2 settings" in table
    assert "| m | 2 | high | chunking-static | 150 | 1.50 | 1.67 |" in table
    assert "`wavepp bench grid --x`" in table and "time_scale=0.1" in table
    write_csv(rows, tmp_path / "g.csv")
    back = read_csv(tmp_path / "g.csv")
    assert [float(r["ratio_vs_sync"]) for r in back] == [3.0, 1.0, 0.9, 1.0, 1.5]


def test_repeats_pair_each_wave_run_with_its_sync_run_and_report_medians() -> None:
    spec = GridSpec(models=("m",), concurrencies=(4,), reuses=("high",), ablations=(), repeats=3)
    assert [(s.mode, s.repeat) for s in grid_settings(spec)] == [
        ("wave", 0),
        ("sync", 0),
        ("wave", 1),
        ("sync", 1),
        ("wave", 2),
        ("sync", 2),
    ]
    # Repeat 1's sync run was slow (noise): its pair's ratio is high, the median is not.
    thr = {
        ("wave", 0): 110.0,
        ("sync", 0): 100.0,
        ("wave", 1): 100.0,
        ("sync", 1): 50.0,
        ("wave", 2): 90.0,
        ("sync", 2): 100.0,
    }
    rows = [_row("m", 4, mode, v, repeat=r) for (mode, r), v in thr.items()]
    add_ratios(rows)
    assert [r["ratio_vs_sync"] for r in rows if r["mode"] == "wave"] == [1.1, 2.0, 0.9]
    wave, sync = median_rows(rows)
    assert (wave["throughput_tokens_per_s"], sync["throughput_tokens_per_s"]) == (100.0, 100.0)
    assert (wave["ratio_vs_sync"], wave["ratio_min"], wave["ratio_max"]) == (1.1, 0.9, 2.0)
    assert wave["repeats"] == 3
    table = markdown_table(rows, spec)
    assert "**1.10** [0.90-2.00]" in table and "WavePP wins 1 of 1" in table
    with pytest.raises(ValueError, match="repeats"):
        GridSpec(repeats=0)


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["bench", "grid", "--models", "nope"], "--models"),
        (["bench", "grid", "--reuse", "medium"], "--reuse"),
        (["bench", "grid", "--concurrency", "0"], "--concurrency"),
        (["bench", "grid", "--ablations", "x"], "--ablations"),
        (["bench", "grid", "--time-scale", "0"], "--time-scale"),
        (["bench", "grid", "--trace-requests", "0"], "--trace-requests"),
        (["bench", "grid", "--repeats", "0"], "--repeats"),
        (["bench", "grid", "--reuse", "mooncake"], "--trace"),
        (["bench", "grid", "--reuse", "mooncake", "--trace", "/no/such.jsonl"], "--trace"),
        (["bench", "grid", "--host-memory-gib", "x"], "--host-memory-gib"),
        (["bench", "grid", "--host-memory-gib", "0,-1"], "--host-memory-gib"),
        (["bench", "grid", "--host-memory-gib", "2000"], "--host-memory-gib"),
        (["bench", "grid", "--host-memory-gib", "1e-9"], "--host-memory-gib"),
        (["bench", "grid", "--host-memory-gib", ","], "--host-memory-gib"),
        (["bench", "plot", "/no/such.csv"], "CSV"),
    ],
)
def test_cli_rejects_bad_flags(argv: list[str], flag: str, capsys, tmp_path) -> None:  # noqa: ANN001
    assert main([*argv, *(["--out", str(tmp_path)] if "grid" in argv else [])]) == 2
    assert flag in capsys.readouterr().err


def test_plot_cli_writes_pngs(tmp_path) -> None:  # noqa: ANN001
    rows = [_row("m", c, mode, 100.0 * c) for c in (1, 2, 4) for mode in ("wave", "sync")]
    add_ratios(rows)
    write_csv(rows, tmp_path / "grid.csv")
    assert main(["bench", "plot", str(tmp_path / "grid.csv")]) == 0
    for name in ("throughput.png", "wave_fill.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_host_tiers_are_a_grid_dimension_honoured_by_each_setting() -> None:
    spec = GridSpec(
        models=("glm-5.2",),
        concurrencies=(8,),
        reuses=("high",),
        ablations=("chunking-static",),
        host_memory_gib=(0.0, 64.0),
    )
    settings = grid_settings(spec)
    assert [(s.host_memory_gib, s.mode, s.ablation) for s in settings] == [
        (0.0, "wave", ""),
        (0.0, "sync", ""),
        (64.0, "wave", ""),
        (64.0, "sync", ""),
        (0.0, "wave", "chunking-static"),
    ]
    without, _ = runtime_config(spec, settings[0])
    with_tier, _ = runtime_config(spec, settings[2])
    assert without.num_host_kv_blocks == [0]
    expected, _ = host_tier_fields(
        "glm-5.2",
        64.0,
        num_stages=4,
        block_size=spec.block_size,
        max_microbatch_tokens=with_tier.largest_microbatch_tokens,
    )
    assert with_tier.num_host_kv_blocks == expected["num_host_kv_blocks"]
    assert min(with_tier.num_host_kv_blocks) > 0
    assert with_tier.host_load_s_per_block == expected["host_load_s_per_block"]


def test_each_host_tier_is_paired_with_its_own_sync_run_and_has_a_column() -> None:
    rows = [
        _row("m", 8, "wave", 120.0),
        _row("m", 8, "sync", 100.0),
        _row("m", 8, "wave", 300.0, host_memory_gib=64.0),
        _row("m", 8, "sync", 150.0, host_memory_gib=64.0),
    ]
    add_ratios(rows)
    assert [r["ratio_vs_sync"] for r in rows] == [1.2, 1.0, 2.0, 1.0]
    assert len(median_rows(rows)) == 4
    table = markdown_table(rows, GridSpec())
    assert "| model | host GiB | C |" in table
    assert "| m | 0 | 8 | high |" in table and "| m | 64 | 8 | high |" in table
    assert "**1.20**" in table and "**2.00**" in table and "WavePP wins 2 of 2" in table
