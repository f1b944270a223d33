"""Chained block hashes compared: where two prompts' hash chains part (pure; used by the wire
encoder to send a shared prefix once and by a stage's KV manager to reuse an earlier walk)."""

from __future__ import annotations


def common_prefix(a: tuple[bytes, ...], b: tuple[bytes, ...]) -> int:
    """Length of the longest common prefix of two hash sequences. Chained block hashes are equal
    at i only if equal before i, so a binary search finds it; the result is checked (any
    sequence is encoded right, chained or not) and a linear scan is the fallback."""
    lo, hi = 0, min(len(a), len(b))  # a[:lo] == b[:lo]; a[:hi + 1] != b[:hi + 1] past hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    if a[:lo] == b[:lo]:
        return lo
    n = 0  # pragma: no cover - not chained hashes
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n
