"""The torch engines' host tier: host copies of a stage's paged caches, block by block.

A stage's paged caches (GQA K/V, MLA latents, DSA indexer keys: every tensor with a token-slot
dimension of ``num_blocks * block_size`` slots) are seen block-first: cache ``c`` with its slot
dimension at ``d`` becomes ``c.unflatten(d, (num_blocks, block_size)).movedim(d, 0)``, a view
[num_blocks, ...] whose row b is device block b's bytes of that cache. Each gets a host buffer
[num_slots, ...] of the same row shape (pinned where the cache lives on CUDA). Per-block states
kept in a dict by block id (Kimi-Linear's recurrent state after a block) are copied with their
block: a slot holds the state of the block spilled into it, or none.

A transfer log (``wavepp.runtime.kv.Transfer``) is applied in its order. It is cut into runs of
one kind; within a run no copy reads what another writes (spills read device rows and write
host rows; loads the reverse), so a run is one gather and one scatter per cache, the last copy
to a row winning as it would in order. On CPU the copies run at once; on CUDA they are queued
on a side stream (host rows pinned: non-blocking), after the work queued so far on the
device's current stream, and ``wait`` makes the current stream wait for them (an event).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from wavepp.runtime.kv import Transfer

BlockStates = dict[int, tuple[torch.Tensor, ...]]
"""Per-block state of one layer: device block id -> its tensors (e.g. KDA's (S, conv tail))."""


def block_rows(cache: torch.Tensor, slot_dim: int, block_size: int) -> torch.Tensor:
    """``cache``'s block-first view [num_blocks, ...] (``slot_dim``: its token-slot dimension,
    whose size is a multiple of ``block_size``); writes through it reach ``cache``."""
    num_slots = cache.shape[slot_dim]
    if num_slots % block_size:
        raise ValueError(
            f"a cache of {num_slots} token slots is not whole blocks of block_size={block_size}"
        )
    return cache.unflatten(slot_dim, (num_slots // block_size, block_size)).movedim(slot_dim, 0)


def _runs(transfers: Sequence[Transfer]) -> list[tuple[str, list[Transfer]]]:
    """Maximal runs of one kind, log order kept."""
    runs: list[tuple[str, list[Transfer]]] = []
    for transfer in transfers:
        if runs and runs[-1][0] == transfer.kind:
            runs[-1][1].append(transfer)
        else:
            runs.append((transfer.kind, [transfer]))
    return runs


def _last_per(pairs: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """(destination, source) pairs -> destinations and sources with each destination once,
    its last source (what applying them in order leaves)."""
    last = dict(pairs)  # later pairs overwrite earlier ones; insertion order of first sight
    return list(last), list(last.values())


class HostCopies:
    """Host buffers for one stage's paged caches and per-block states, and the copies.

    Args:
        caches: block-first views [num_blocks, ...] of the stage's paged caches
            (``block_rows``), all on one device.
        states: per-block state dicts (``BlockStates``), copied with their blocks.
        num_slots: host slots, >= 1.
        device: the caches' device.

    Counters: ``num_spilled`` and ``num_loaded`` blocks, ``bytes_copied`` (both directions,
    paged caches only).
    """

    def __init__(
        self,
        caches: Sequence[torch.Tensor],
        states: Sequence[BlockStates],
        num_slots: int,
        device: torch.device,
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"num_host_kv_blocks={num_slots} must be >= 1 for host buffers")
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.caches = list(caches)
        self.hosts = [
            torch.empty((num_slots, *cache.shape[1:]), dtype=cache.dtype, pin_memory=self.is_cuda)
            for cache in self.caches
        ]
        self.states = list(states)
        self.host_states: list[BlockStates] = [{} for _ in self.states]
        self.row_bytes = sum(c[0].numel() * c.element_size() for c in self.caches)
        self._stream = torch.cuda.Stream(device) if self.is_cuda else None
        self._event: torch.cuda.Event | None = None
        self.num_spilled = 0
        self.num_loaded = 0
        self.bytes_copied = 0

    @property
    def host_bytes(self) -> int:
        """Bytes of the host buffers (paged caches; states are held as they come)."""
        return sum(h.numel() * h.element_size() for h in self.hosts)

    def apply(self, transfers: Sequence[Transfer]) -> None:
        """Issue the log's copies in order (checked ids are the caller's)."""
        if not transfers:
            return
        runs = _runs(transfers)
        if self._stream is None:
            self._apply_caches(runs)
        else:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                self._apply_caches(runs)
                event = torch.cuda.Event()
                event.record(self._stream)
            self._event = event
        # per-block states: small tensors, copied on the current stream (ordered with compute)
        for kind, run in runs:
            if kind == "spill":
                self._copy_states(self.states, [t.block_id for t in run], [t.slot for t in run])
            else:
                self._copy_states(
                    self.host_states, [t.slot for t in run], [t.block_id for t in run]
                )

    def wait(self) -> None:
        """Make the current stream wait for every copy issued so far (no-op on CPU)."""
        if self._event is not None:
            torch.cuda.current_stream(self.device).wait_event(self._event)

    def _apply_caches(self, runs: list[tuple[str, list[Transfer]]]) -> None:
        for kind, run in runs:
            if kind == "spill":
                slots, blocks = _last_per([(t.slot, t.block_id) for t in run])
                self._copy(self.caches, blocks, self.hosts, slots)
                self.num_spilled += len(run)
            else:
                blocks, slots = _last_per([(t.block_id, t.slot) for t in run])
                self._copy(self.hosts, slots, self.caches, blocks)
                self.num_loaded += len(run)
            self.bytes_copied += len(run) * self.row_bytes

    def _copy(
        self,
        sources: Sequence[torch.Tensor],
        src_rows: list[int],
        targets: Sequence[torch.Tensor],
        dst_rows: list[int],
    ) -> None:
        """Row ``src_rows[i]`` of each source into row ``dst_rows[i]`` of its target."""
        if not self.is_cuda:
            src = torch.tensor(src_rows, dtype=torch.int64)
            dst = torch.tensor(dst_rows, dtype=torch.int64)
            for source, target in zip(sources, targets, strict=True):
                target.index_copy_(0, dst, source.index_select(0, src))
            return
        # one copy per row: host rows are pinned and contiguous, so each is one DMA transfer
        for source, target in zip(sources, targets, strict=True):
            for s, d in zip(src_rows, dst_rows, strict=True):
                target[d].copy_(source[s], non_blocking=True)

    def _copy_states(
        self, sources: Sequence[BlockStates], src_keys: list[int], dst_keys: list[int]
    ) -> None:
        """In order, the state under each source key (or its absence) to the other side's
        destination key: device dicts -> host dicts (CPU) or host dicts -> device dicts."""
        to_host = sources is self.states
        targets = self.host_states if to_host else self.states
        where = torch.device("cpu") if to_host else self.device
        for source, target in zip(sources, targets, strict=True):
            for s, d in zip(src_keys, dst_keys, strict=True):
                state = source.get(s)
                if state is None:
                    target.pop(d, None)
                else:
                    target[d] = tuple(t.to(where, copy=True) for t in state)
