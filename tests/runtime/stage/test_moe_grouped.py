"""``layers.moe.grouped_linear``: one grouped product equals one matmul per group, on the
grouped kernel's path (aligned float32) and the fallback (widths it does not take), with
empty groups."""

from __future__ import annotations

import pytest
import torch

from wavepp.runtime.stage.engine.layers import moe
from wavepp.runtime.stage.engine.layers.moe import grouped_linear


@pytest.mark.parametrize(("width_in", "width_out"), [(16, 8), (6, 5)])
def test_grouped_linear_equals_one_matmul_per_group(width_in, width_out, monkeypatch) -> None:  # noqa: ANN001
    gen = torch.Generator().manual_seed(width_in)
    counts = [3, 0, 5, 0, 2]  # groups 1 and 3 empty
    rows = torch.randn(sum(counts), width_in, generator=gen)
    weight = torch.randn(len(counts), width_out, width_in, generator=gen)
    ends = torch.tensor(counts).cumsum(0)
    calls = []
    real = torch.nn.functional.grouped_mm
    monkeypatch.setattr(moe.F, "grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = grouped_linear(rows, weight, ends)
    want = torch.cat(
        [
            rows[lo:hi] @ weight[g].T
            for g, (lo, hi) in enumerate(zip([0, *ends[:-1]], ends, strict=True))
        ]
    )
    assert torch.allclose(got, want, atol=1e-5)
    assert len(calls) == (1 if width_in == 16 else 0)  # 6 and 5 floats are not 16-byte rows
