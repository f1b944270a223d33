"""The garbage collector in a long-running serving process (a stage, an admission instance):
start-up's objects frozen out of the collector's generations, and the young generation
collected right after a KV round has been answered, while the process would idle, instead of
at a random point of a later round.

Why: CPython (3.11) starts a young collection after ``threshold0`` (700) allocations of
tracked objects, counting every deallocation of one, young or old, back down. A stage frees as
many old records per round as it makes new ones (each finished request's ``HeldRequest``, table
and hashes go as a new request's arrive), so the count seldom reaches the threshold and the
young generation piles up, to be walked in one long pause inside whichever round it falls in.
Collected after every answered round, the same objects are walked once each (each tuple of ints
or hashes leaves the collector's lists at its first pass), in short pauses that overlap the
controller's reading of the replies. ``threshold0`` stays CPython's: lowering it shortens the
pauses but costs the stage CPU in collections (pause lengths and costs: docs/bench/cadence.md,
"The young generation is collected right after a round is answered").
"""

from __future__ import annotations

import asyncio
import gc

_scheduled: set[asyncio.AbstractEventLoop] = set()


def settle_heap() -> None:
    """Call once start-up is done (pools, engine, connections built): freeze every object that
    exists now out of the collector's generations (``gc.freeze``: no collection walks them
    again)."""
    gc.freeze()


def collect_young_soon() -> None:
    """Collect the young generation (``gc.collect(0)``) once the running event loop has run
    the callbacks ready now: call it right after answering a round, so the other stages of a
    process that got the same round answer first. At most one is pending per loop (a burst of
    answers collects once).

    Raises:
        RuntimeError: no running event loop.
    """
    loop = asyncio.get_running_loop()
    if loop in _scheduled:
        return
    _scheduled.add(loop)
    loop.call_soon(_collect_young, loop)


def _collect_young(loop: asyncio.AbstractEventLoop) -> None:
    _scheduled.discard(loop)
    gc.collect(0)
