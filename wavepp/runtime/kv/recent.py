"""The prefixes a stage remembers per admission instance, for ``kv_batch``'s prefix references.

A probe-reserve round of a chat or agentic workload sends, for each long cached prefix, its
first entry's hashes in full (the others of the round share them in-batch): every round, to
every stage, though the stage saw the same hashes the round before. ``RecentPrefixes`` keeps,
per (owner, root hash), the hashes of that owner's latest probe-reserve entry starting with
that root; the controller mirrors it (``wavepp.runtime.agreement.rounds``) and names the shared
part of such a prefix by its root and its last hash (64 bytes instead of 32 per block).

Why the last hash suffices: block hashes are a chain (each block's hash covers its parent's
hash and its tokens, ``wavepp.runtime.kv.hashing``), so equal hashes at index k - 1 mean equal
first k hashes. Keyed by owner: one admission instance can never make another's entries
resolve to a sequence it sent (under its own owner name; a bus-key holder may sign under any
name, docs/architecture.md's trust table). Bounded: at most ``max_entries`` sequences and
``max_hashes`` hashes in all, the least recently remembered dropped first (an accepted batch's
entries are remembered, those sent by reference too; a refused batch changes nothing); a
dropped one only costs a resend (the controller's entry is answered unresolved and sent again
in full).

Pure: no I/O; one per ``StageKVManager`` (``manager.recent_prefixes``), used by its single
owner.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class RecentPrefixes:
    """Per (owner, root hash): the hashes of the owner's latest probe-reserve entry with that
    root, bounded LRU over all owners.

    Args:
        max_entries: Sequences kept, >= 1.
        max_hashes: Hashes kept over all sequences, >= 1 (a sequence longer than this alone is
            not kept).

    Raises:
        ValueError: a bound below 1.
    """

    def __init__(self, max_entries: int = 4096, max_hashes: int = 1 << 20) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries={max_entries}: must be >= 1")
        if max_hashes < 1:
            raise ValueError(f"max_hashes={max_hashes}: must be >= 1")
        self.max_entries = max_entries
        self.max_hashes = max_hashes
        self._sequences: OrderedDict[tuple[str, bytes], tuple[bytes, ...]] = OrderedDict()
        self._num_hashes = 0

    def __len__(self) -> int:
        return len(self._sequences)

    @property
    def num_hashes(self) -> int:
        """Hashes kept over all sequences."""
        return self._num_hashes

    def remember(self, owner: str, hashes: Sequence[bytes]) -> None:
        """Keep ``hashes`` (a probe-reserve entry's, in the batch's entry order) as ``owner``'s
        latest sequence with root ``hashes[0]``; nothing for an empty one."""
        if not hashes:
            return
        hashes = tuple(hashes)
        key = (owner, hashes[0])
        sequences = self._sequences
        self.forget(owner, hashes[0])
        if len(hashes) > self.max_hashes:
            return
        sequences[key] = hashes
        self._num_hashes += len(hashes)
        while len(sequences) > self.max_entries or self._num_hashes > self.max_hashes:
            _, dropped = sequences.popitem(last=False)
            self._num_hashes -= len(dropped)

    def resolve(
        self, owner: str, root: bytes, num_shared: int, last_hash: bytes
    ) -> tuple[bytes, ...] | None:
        """The first ``num_shared`` hashes of ``owner``'s sequence with root ``root`` if it is at
        least that long and its hash at index ``num_shared - 1`` is ``last_hash``; else None
        (nothing remembered, another owner's, too short, or it parts earlier).

        Changes nothing, not even the eviction order: a stage resolves while it decodes, before
        it knows the batch is accepted (its op number new, the rest well formed); a resolved
        entry of an accepted batch is remembered again (``remember``), which makes it the most
        recent."""
        key = (owner, root)
        hashes = self._sequences.get(key)
        if hashes is None or not 0 < num_shared <= len(hashes):
            return None
        if hashes[num_shared - 1] != last_hash:
            return None
        return hashes[:num_shared]

    def latest(self, owner: str, root: bytes) -> tuple[bytes, ...] | None:
        """``owner``'s whole remembered sequence with root ``root``, or None; changes nothing
        (a controller's mirror of what its stages remember asks it)."""
        return self._sequences.get((owner, root))

    def forget(self, owner: str, root: bytes) -> None:
        """Drop ``owner``'s sequence with root ``root`` (nothing if none)."""
        dropped = self._sequences.pop((owner, root), None)
        if dropped is not None:
            self._num_hashes -= len(dropped)

    def clear(self) -> None:
        """Forget everything (a stage that restarted remembers nothing either)."""
        self._sequences.clear()
        self._num_hashes = 0
