"""The intake messages a gateway withdrew (``wavepp.api.prefill.IntakeCancel``), as the
admission service remembers them: pure bookkeeping, no I/O.

A cancel names a message by its key and ``arrival_s``; a later message with the same key (a
client retry: a new arrival) is not cancelled by it. Entries are kept ``memory_s`` seconds
(longer than a redelivery, ``ack_wait_s``, and a re-form of the stages) and at most
``max_entries`` (the oldest forgotten first), so a flood of cancels bounds its memory.
"""

from __future__ import annotations

from wavepp.api.prefill import IntakeCancel, IntakeRequest

CANCEL_MEMORY_S = 600.0
MAX_CANCELLED = 65536


class CancelMemory:
    """Cancelled intake messages, oldest first.

    Args:
        memory_s: seconds (of the caller's monotonic clock) an entry is kept; > 0.
        max_entries: entries kept at most; >= 1.

    Raises:
        ValueError: ``memory_s`` <= 0 or ``max_entries`` < 1.
    """

    def __init__(self, memory_s: float = CANCEL_MEMORY_S, max_entries: int = MAX_CANCELLED):
        if not memory_s > 0:
            raise ValueError(f"memory_s={memory_s}: must be > 0")
        if max_entries < 1:
            raise ValueError(f"max_entries={max_entries}: must be >= 1")
        self.memory_s = memory_s
        self.max_entries = max_entries
        # key -> (the cancelled message's arrival_s, when the cancel came)
        self._entries: dict[str, tuple[float, float]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, cancel: IntakeCancel, now_s: float) -> None:
        """Remember ``cancel`` at ``now_s``; forget entries past ``memory_s`` or the cap."""
        self._entries.pop(cancel.key, None)
        self._entries[cancel.key] = (cancel.arrival_s, now_s)
        while self._entries:
            oldest = next(iter(self._entries))
            expired = now_s - self._entries[oldest][1] > self.memory_s
            if len(self._entries) <= self.max_entries and not expired:
                break
            del self._entries[oldest]

    def discard(self, key: str) -> None:
        """Forget the cancel of ``key`` (a retry of it is served); none: nothing happens."""
        self._entries.pop(key, None)

    def __contains__(self, request: IntakeRequest) -> bool:
        """``request`` (its key and arrival) was cancelled."""
        entry = self._entries.get(request.key)
        return entry is not None and entry[0] == request.arrival_s
