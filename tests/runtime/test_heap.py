"""The serving processes' garbage-collector settings (``wavepp.runtime.heap``)."""

from __future__ import annotations

import asyncio
import gc

import pytest

from wavepp.runtime.heap import collect_young_soon, settle_heap


def test_settle_heap_freezes_what_start_up_made() -> None:
    frozen = gc.get_freeze_count()
    start_up = [object() for _ in range(10)]  # a list: tracked by the collector
    try:
        settle_heap()
        assert gc.get_freeze_count() > frozen
        assert not any(start_up is o for o in gc.get_objects())  # out of every generation
    finally:
        gc.unfreeze()


async def test_a_burst_of_answers_collects_the_young_generation_once_after_it() -> None:
    """Three stages of one process answer the same round: each asks for a collection right
    after its answer; it runs once, after all three (they were ready before it)."""
    loop = asyncio.get_running_loop()
    gc.disable()  # no collection but the ones asked for (allocations would start some)
    try:
        collections = gc.get_stats()[0]["collections"]
        seen: list[int] = []

        def answer() -> None:
            collect_young_soon()
            seen.append(gc.get_stats()[0]["collections"])

        for _ in range(3):
            loop.call_soon(answer)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert seen == [collections] * 3  # the collection came after every answer
        assert gc.get_stats()[0]["collections"] == collections + 1  # once for the burst
        loop.call_soon(answer)  # a later round: again
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert gc.get_stats()[0]["collections"] == collections + 2
    finally:
        gc.enable()


def test_collect_young_soon_needs_a_running_loop() -> None:
    with pytest.raises(RuntimeError):
        collect_young_soon()
