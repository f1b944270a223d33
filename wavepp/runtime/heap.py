"""The garbage collector's settings for a long-running serving process (a stage, an admission
instance): start-up's objects frozen out of the collector's generations, and a young generation
collected often enough that one collection stays short.

Why the threshold: CPython (3.11) counts a young collection down from ``threshold0``
allocations of tracked objects, and every deallocation of one, young or old, counts back up.
A stage frees as many old records per round as it makes new ones (each finished request's
table and hashes go as a new request's arrive), so the count seldom reaches 700 (CPython's
default) and the young generation grows between collections: measured in the admission bench
(``wavepp bench admission``, 4 stages and the controller in one process, S = 8, 16 in flight),
~4,000 survivors per young collection and pauses up to 2.9 ms, every ~60 ms: a pause in a
round adds to every request in it, so they set the p99. At 200 the same run's pauses were at
most 0.7 ms, with the same total time in the collector (16 against 14 ms over the run); at 100
and 50 the total grew 3x. A pure function of the process's state: no I/O.
"""

from __future__ import annotations

import gc

__all__ = ["YOUNG_COLLECTION_THRESHOLD", "settle_heap"]

YOUNG_COLLECTION_THRESHOLD = 200
"""``gc`` threshold0 for serving processes (allocations less deallocations of tracked objects
between young collections; CPython's default is 700). See the module docstring."""


def settle_heap(young_threshold: int = YOUNG_COLLECTION_THRESHOLD) -> None:
    """Call once start-up is done (pools, engine, connections built): freeze every object that
    exists now out of the collector's generations (``gc.freeze``: a full collection no longer
    walks them) and set the young generation's threshold (the older ones' stay).

    Args:
        young_threshold: ``gc`` threshold0, >= 1.

    Raises:
        ValueError: ``young_threshold`` < 1 (0 would turn the collector off).
    """
    if not isinstance(young_threshold, int) or young_threshold < 1:
        raise ValueError(f"young_threshold={young_threshold!r}: must be an int >= 1")
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(young_threshold, older, oldest)
