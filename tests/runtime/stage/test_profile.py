"""``engine.profile``: regions are recorded only under a profiler, and the per-part table."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from wavepp.runtime.stage.engine.profile import part_table, region, region_totals_us


def test_regions_are_recorded_under_a_profiler_only() -> None:
    with region("mlp"):  # no profiler: a no-op
        pass
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with region("mlp"):
            torch.ones(64, 64) @ torch.ones(64, 64)
        with region("attention"):
            torch.ones(8).sum()
    totals = region_totals_us(prof.key_averages())
    assert set(totals) == {"mlp", "attention"}
    assert all(v > 0 for v in totals.values())
    with pytest.raises(KeyError, match="not a profile region"):
        region("bogus")


def test_part_table_adds_other_and_total() -> None:
    lines = part_table({"mlp": 6000.0, "attention": 2000.0}, wall_us=10000.0, microbatches=2)
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:]}
    assert rows["mlp"] == ["3.000", "60.0%"]
    assert rows["attention"] == ["1.000", "20.0%"]
    assert rows["other"] == ["1.000", "20.0%"]
    assert rows["total"] == ["5.000", "100.0%"]
    assert list(rows) == ["attention", "mlp", "other", "total"]  # PARTS order
    with pytest.raises(ValueError, match="microbatches=0"):
        part_table({}, wall_us=1.0, microbatches=0)
