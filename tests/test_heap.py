"""The serving processes' garbage-collector settings (``wavepp.runtime.heap``)."""

from __future__ import annotations

import gc

import pytest

from wavepp.runtime.heap import YOUNG_COLLECTION_THRESHOLD, settle_heap


def test_settle_heap_freezes_start_up_and_shortens_young_collections() -> None:
    threshold = gc.get_threshold()
    frozen = gc.get_freeze_count()
    start_up = [object() for _ in range(10)]  # a list: tracked by the collector
    try:
        settle_heap()
        assert gc.get_threshold() == (YOUNG_COLLECTION_THRESHOLD, *threshold[1:])
        assert gc.get_freeze_count() > frozen
        assert not any(start_up is o for o in gc.get_objects())  # out of every generation
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


@pytest.mark.parametrize("bad", [0, -5, 1.5, None])
def test_settle_heap_refuses_a_threshold_that_would_stop_the_collector(bad: object) -> None:
    threshold = gc.get_threshold()
    with pytest.raises(ValueError, match="young_threshold"):
        settle_heap(bad)  # type: ignore[arg-type]
    assert gc.get_threshold() == threshold  # nothing changed
