"""The one layer split (``wavepp.api.layer_split.split_layers``): balanced and explicit counts,
and its refusals naming the spec field at fault."""

from __future__ import annotations

import pytest

from wavepp.api.layer_split import LayerSplitError, split_layers


def test_balanced_and_explicit_splits() -> None:
    assert split_layers(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert split_layers(78, 4) == [(0, 20), (20, 40), (40, 59), (59, 78)]
    assert split_layers(8, 1) == [(0, 8)]
    assert split_layers(8, 3, [2, 5, 1]) == [(0, 2), (2, 7), (7, 8)]


@pytest.mark.parametrize(("num_layers", "num_stages"), [(93, 7), (61, 8), (62, 62), (3, 2)])
def test_balanced_split_is_contiguous_and_even(num_layers: int, num_stages: int) -> None:
    ranges = split_layers(num_layers, num_stages)
    assert ranges[0][0] == 0 and ranges[-1][1] == num_layers
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    sizes = [last - first for first, last in ranges]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize(
    ("args", "field", "match"),
    [
        ((8, 3, [2, 5]), "layerPartition", "has 2 entries for stages=3"),
        ((8, 3, [2, 5, 2]), "layerPartition", "sums to 9 layers; the model has 8"),
        ((8, 2, [8, 0]), "layerPartition", "every stage needs >= 1 layer"),
        ((2, 3, None), "stages", "exceeds the model's 2 layers"),
        ((4, 0, None), "stages", "stages=0 must be >= 1"),
    ],
)
def test_refusals_name_the_field(args: tuple, field: str, match: str) -> None:
    with pytest.raises(LayerSplitError, match=match) as info:
        split_layers(*args)
    assert info.value.field == field and isinstance(info.value, ValueError)
