"""Stage engine interface: what one pipeline stage runs for one micro-batch.

A stage holds decoder layers ``[first_layer, last_layer)`` and its own paged KV cache. The stage
worker calls, per micro-batch::

    plan arrives -> prepared = engine.prepare(chunks)      # local preparation, off the critical path
    activations arrive -> out = engine.execute(prepared, hidden_in)
    out.hidden -> next stage (None on the last stage); out.last_token_logits -> result

Activations of a micro-batch are the chunks' rows concatenated in chunk order::

    rows:  | chunk 0: x_0 rows | chunk 1: x_1 rows | ... |      (sum x_i = num_tokens)
    chunk i, row j  <->  request i's token at position L_i + j

Paged KV layout of one request (block_size = 4, L = 6 cached tokens, x = 5 new tokens)::

    positions  0 1 2 3 | 4 5 6 7 | 8 9 10 11
    block ids  [  17   ] [  3    ] [  42     ]      block_ids = (17, 3, 42) on this stage
    cached     ######### ###                       positions [0, L) already in the cache
    written                  ##### ########       positions [L, L + x): slot = block*bs + pos%bs

Block ids are local to a stage: two stages may hold the same prefix in different blocks, and a
stage may hold more of it than the agreed L* (``ChunkSpec.num_cached_tokens``): those positions
are computed (the next stage needs their activations) but not written, so a block cached and
shared with other requests is never written (``PreparedBatch.write_rows``).

Host tier (``wavepp.runtime.kv.host``): the stage's pool spills blocks it evicts to host slots
and loads agreed host blocks back into device blocks; it logs each copy as a ``Transfer``. The
stage worker hands each micro-batch's log (``StageWork.transfers``) to ``apply_transfers``
before the micro-batch is prepared, in plan order, whether or not the micro-batch runs::

    allocate_kv(num_blocks, block_size); allocate_host_kv(num_slots)     # once, at start
    plan m -> apply_transfers(m's log) -> prepare(m) -> execute(m)       # log order = copy order

An engine that keeps KV bytes copies, for every layer it holds, the block's bytes (and any
per-block state) between device block ``block_id`` and host slot ``slot``; the copies of one
log are issued in log order and complete before any ``execute`` that follows them starts
reading (an engine may issue them asynchronously and make ``execute`` wait). An engine that
keeps no bytes models their time.

Per-request state: an engine may keep state of a request between its chunks (Kimi-Linear's KDA
layers keep the recurrent state where the request's last chunk ended). The stage worker tells
it, through ``drop_requests``, of every request its KV manager released, before the next
micro-batch runs; a request released before its last chunk ran (withdrawn, failed, expired,
re-formed) then leaves nothing behind.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from wavepp.runtime.kv import Transfer
from wavepp.runtime.stage.chunk import ChunkSpec


@dataclass(frozen=True, eq=False)
class PreparedBatch:
    """Local preparation of one micro-batch on one stage (engine-independent part).

    All tensors are int64 on the engine's device. T = total new tokens, C = chunks.

    Attributes:
        chunks: the chunks, in row order.
        block_size: tokens per block of the KV cache they were prepared for.
        num_blocks: blocks of that KV cache.
        num_tokens: T = sum of the chunks' num_tokens.
        row_starts: chunk i owns activation rows ``[row_starts[i], row_starts[i] + x_i)``.
        positions: [T] token positions (L_i + j).
        slot_mapping: [W] KV cache slot (block_id * block_size + offset) each written token
            writes: every new token (W = T) but those below their chunk's
            ``num_cached_tokens``.
        write_rows: None (every row is written, W = T) or [W] the activation rows whose KV is
            written, in ``slot_mapping``'s order (``written`` selects them).
        block_tables: [C, max_blocks] block ids each chunk reads, padded with -1; row i holds
            ``ceil((L_i + x_i) / block_size)`` valid entries.
        context_lens: [C] L_i + x_i, the keys each chunk's queries attend over.
        key_slots: per chunk, [L_i + x_i] slot of every context position (the gather index).
        token_ids: [T] new token ids (first stage) or None.
        logits_rows: ``(request_id, row)`` of the last token of each ``is_last`` chunk.
        prepared_by: ``id()`` of the engine that prepared it (execute() checks it).
    """

    chunks: tuple[ChunkSpec, ...]
    block_size: int
    num_blocks: int
    num_tokens: int
    row_starts: tuple[int, ...]
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    key_slots: tuple[torch.Tensor, ...]
    token_ids: torch.Tensor | None
    logits_rows: tuple[tuple[str, int], ...]
    prepared_by: int
    write_rows: torch.Tensor | None

    def written(self, rows: torch.Tensor) -> torch.Tensor:
        """The rows of a [T, ...] tensor whose KV is written (``slot_mapping``'s order)."""
        return rows if self.write_rows is None else rows.index_select(0, self.write_rows)

    def base_fields(self) -> dict[str, Any]:
        """The fields of this base class, for building an engine-specific subclass."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(PreparedBatch)}


@dataclass
class StageOutput:
    """What a stage produces for one micro-batch.

    Attributes:
        hidden: [num_tokens, hidden_size] activations for the next stage, in the engine's
            ``activation_dtype``; None on the last stage.
        last_token_logits: last stage only: request_id -> [vocab_size] float32 logits of the
            last token of each ``is_last`` chunk; empty elsewhere.
    """

    hidden: torch.Tensor | None
    last_token_logits: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


@runtime_checkable
class StageEngine(Protocol):
    """One pipeline stage's layers over its paged KV cache."""

    first_layer: int
    last_layer: int
    is_first: bool
    is_last: bool
    hidden_size: int
    activation_dtype: torch.dtype

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        """Allocate (or re-allocate, dropping content) this stage's KV cache."""
        ...

    def prepare(self, chunks: Sequence[ChunkSpec]) -> PreparedBatch:
        """Local preparation of a micro-batch; runs before its activations arrive."""
        ...

    def execute(self, prepared: PreparedBatch, hidden_in: torch.Tensor | None) -> StageOutput:
        """Run the micro-batch; ``hidden_in`` is [num_tokens, hidden_size] (None on stage 0)."""
        ...

    def allocate_host_kv(self, num_slots: int) -> None:
        """Allocate the host tier's ``num_slots`` block slots (0: none)."""
        ...

    def apply_transfers(self, transfers: Sequence[Transfer]) -> None:
        """Issue the host tier's copies, in order, before the next micro-batch runs."""
        ...

    def drop_requests(self, request_ids: Sequence[str]) -> None:
        """Forget the per-request state of ``request_ids`` (module docstring)."""
        ...


def build_prepared_batch(
    chunks: Sequence[ChunkSpec],
    *,
    block_size: int,
    num_blocks: int,
    device: torch.device | str,
    needs_token_ids: bool,
    prepared_by: int,
    vocab_size: int | None = None,
    max_position: int | None = None,
) -> PreparedBatch:
    """Validate a micro-batch and build its block tables, slot mapping and positions.

    Args:
        chunks: the micro-batch, in row order (at least one chunk, request ids unique).
        block_size: tokens per KV block of this stage.
        num_blocks: blocks of this stage's KV cache; block ids must lie in ``[0, num_blocks)``.
        device: where the tensors go.
        needs_token_ids: first stage: every chunk must carry its ``token_ids``.
        prepared_by: ``id()`` of the calling engine, stored in the result.
        vocab_size: if given, token ids must lie in ``[0, vocab_size)``.
        max_position: if given, positions must stay below it.

    Returns:
        The :class:`PreparedBatch`.

    Raises:
        ValueError: naming the chunk field at fault (num_tokens, context_offset, block_ids,
            token_ids, request_id) or overlapping slots between chunks.
    """
    if len(chunks) == 0:
        raise ValueError("chunks is empty; a micro-batch needs at least one chunk")
    seen: set[str] = set()
    key_slot_list: list[torch.Tensor] = []
    positions_list: list[torch.Tensor] = []
    token_list: list[int] = []
    row_starts: list[int] = []
    logits_rows: list[tuple[str, int]] = []
    context_lens: list[int] = []
    tables: list[tuple[int, ...]] = []
    row = 0
    for chunk in chunks:
        rid = chunk.request_id
        if rid in seen:
            raise ValueError(
                f"request_id={rid!r} appears twice in one micro-batch; merge its chunks"
            )
        seen.add(rid)
        if chunk.num_tokens < 1:
            raise ValueError(f"num_tokens={chunk.num_tokens} of request {rid!r} must be >= 1")
        if chunk.context_offset < 0:
            raise ValueError(
                f"context_offset={chunk.context_offset} of request {rid!r} must be >= 0"
            )
        if chunk.num_cached_tokens < 0 or chunk.num_cached_tokens % block_size:
            raise ValueError(
                f"num_cached_tokens={chunk.num_cached_tokens} of request {rid!r} must be a "
                f"whole number of blocks (block_size={block_size}) >= 0"
            )
        context_end = chunk.context_end
        if max_position is not None and context_end > max_position:
            raise ValueError(
                f"context_offset + num_tokens = {context_end} of request {rid!r} exceeds "
                f"max_position={max_position} of the model"
            )
        num_needed = -(-context_end // block_size)
        if len(chunk.block_ids) < num_needed:
            raise ValueError(
                f"block_ids of request {rid!r} has {len(chunk.block_ids)} blocks; "
                f"context_offset + num_tokens = {context_end} tokens need {num_needed} blocks "
                f"of block_size={block_size}"
            )
        table = tuple(chunk.block_ids[:num_needed])
        bad = [b for b in table if not 0 <= b < num_blocks]
        if bad:
            raise ValueError(
                f"block_ids of request {rid!r} contains {bad[:4]} outside [0, {num_blocks}) "
                f"(num_blocks of this stage's KV cache)"
            )
        if needs_token_ids:
            if chunk.token_ids is None:
                raise ValueError(f"token_ids of request {rid!r} is None; the first stage needs it")
            if len(chunk.token_ids) != chunk.num_tokens:
                raise ValueError(
                    f"token_ids of request {rid!r} has {len(chunk.token_ids)} ids; "
                    f"it must have num_tokens={chunk.num_tokens}"
                )
            if vocab_size is not None:
                bad_ids = [t for t in chunk.token_ids if not 0 <= t < vocab_size]
                if bad_ids:
                    raise ValueError(
                        f"token_ids of request {rid!r} contains {bad_ids[:4]} outside "
                        f"[0, vocab_size={vocab_size})"
                    )
            token_list.extend(chunk.token_ids)
        table_t = torch.tensor(table, dtype=torch.int64)
        all_positions = torch.arange(context_end, dtype=torch.int64)
        key_slots = table_t[all_positions // block_size] * block_size + all_positions % block_size
        key_slot_list.append(key_slots)
        positions_list.append(all_positions[chunk.context_offset :])
        row_starts.append(row)
        row += chunk.num_tokens
        if chunk.is_last:
            logits_rows.append((rid, row - 1))
        context_lens.append(context_end)
        tables.append(table)

    write_rows = None
    if any(c.num_cached_tokens > c.context_offset for c in chunks):
        rows = [
            torch.arange(
                start + max(0, min(c.num_tokens, c.num_cached_tokens - c.context_offset)),
                start + c.num_tokens,
                dtype=torch.int64,
            )
            for c, start in zip(chunks, row_starts, strict=True)
        ]
        write_rows = torch.cat(rows)
    slot_mapping = torch.cat(
        [
            ks[max(c.context_offset, c.num_cached_tokens) :]
            for ks, c in zip(key_slot_list, chunks, strict=True)
        ]
    )
    if torch.unique(slot_mapping).numel() != slot_mapping.numel():
        raise ValueError(
            "slot_mapping: two new tokens of this micro-batch write the same KV slot; "
            "the chunks' block_ids overlap in their uncached blocks"
        )
    max_blocks = max(len(t) for t in tables)
    block_tables = torch.full((len(tables), max_blocks), -1, dtype=torch.int64)
    for i, table in enumerate(tables):
        block_tables[i, : len(table)] = torch.tensor(table, dtype=torch.int64)

    dev = torch.device(device)
    non_blocking = dev.type == "cuda"

    def _to(t: torch.Tensor) -> torch.Tensor:
        return t.to(dev, non_blocking=non_blocking)

    return PreparedBatch(
        chunks=tuple(chunks),
        block_size=block_size,
        num_blocks=num_blocks,
        num_tokens=row,
        row_starts=tuple(row_starts),
        positions=_to(torch.cat(positions_list)),
        slot_mapping=_to(slot_mapping),
        block_tables=_to(block_tables),
        context_lens=_to(torch.tensor(context_lens, dtype=torch.int64)),
        key_slots=tuple(_to(ks) for ks in key_slot_list),
        token_ids=_to(torch.tensor(token_list, dtype=torch.int64)) if needs_token_ids else None,
        logits_rows=tuple(logits_rows),
        prepared_by=prepared_by,
        write_rows=_to(write_rows) if write_rows is not None else None,
    )


class PagedStageEngineBase(ABC):
    """Shared bookkeeping of stage engines: layer range, KV geometry, batch checks.

    Subclasses set ``hidden_size`` and ``activation_dtype`` and implement ``prepare``,
    ``execute``, the host tier's two methods (``allocate_host_kv``, ``apply_transfers``) and
    ``drop_requests`` (the module docstring's contract).
    """

    hidden_size: int
    activation_dtype: torch.dtype

    def __init__(
        self,
        *,
        first_layer: int,
        last_layer: int,
        num_layers_total: int,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_layers_total < 1:
            raise ValueError(f"num_layers_total={num_layers_total} must be >= 1")
        if not 0 <= first_layer < last_layer <= num_layers_total:
            raise ValueError(
                f"layer range [first_layer={first_layer}, last_layer={last_layer}) must satisfy "
                f"0 <= first_layer < last_layer <= num_layers_total={num_layers_total}"
            )
        self.first_layer = first_layer
        self.last_layer = last_layer
        self.is_first = first_layer == 0
        self.is_last = last_layer == num_layers_total
        self.device = torch.device(device)
        self.num_blocks = 0
        self.block_size = 0
        self.num_host_slots = 0

    @abstractmethod
    def prepare(self, chunks: Sequence[ChunkSpec]) -> PreparedBatch:
        """Local preparation of a micro-batch; runs before its activations arrive."""

    @abstractmethod
    def execute(self, prepared: PreparedBatch, hidden_in: torch.Tensor | None) -> StageOutput:
        """Run the micro-batch; ``hidden_in`` is [num_tokens, hidden_size] (None on stage 0)."""

    @abstractmethod
    def allocate_host_kv(self, num_slots: int) -> None:
        """Give the stage a host tier of ``num_slots`` block slots (0: none), after
        ``allocate_kv``; an ``allocate_kv`` later drops it. Implementations call
        :meth:`_set_host_slots` first.

        Raises:
            ValueError: ``num_slots`` < 0.
            RuntimeError: ``allocate_kv`` has not run.
        """

    @abstractmethod
    def apply_transfers(self, transfers: Sequence[Transfer]) -> None:
        """Issue the copies of one host-tier transfer log, in its order (module docstring):
        "spill" copies device block ``block_id`` into host slot ``slot``, "load" host slot
        ``slot`` into device block ``block_id``. Every copy issued completes before the next
        ``execute`` reads the cache. Implementations call :meth:`_check_transfers` first.

        Raises:
            ValueError: a transfer's block id or slot out of range (named), or no host tier.
        """

    @abstractmethod
    def drop_requests(self, request_ids: Sequence[str]) -> None:
        """Forget every state kept for these requests between their chunks (module
        docstring). Called on the thread that runs ``execute``, never during it; an id with
        no state here, or an unknown one, is skipped. A later chunk of a dropped request that
        continues it (``context_offset`` past a reused prefix) is then refused by ``execute``
        as one whose earlier chunk did not run here."""

    def _set_host_slots(self, num_slots: int) -> None:
        """Record the host tier's size (the checks of ``allocate_host_kv``)."""
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 0:
            raise ValueError(f"num_host_kv_blocks={num_slots!r} must be an int >= 0")
        if self.block_size == 0:
            raise RuntimeError(
                "allocate_kv(num_blocks, block_size) must run before allocate_host_kv"
            )
        self.num_host_slots = num_slots

    def _check_transfers(self, transfers: Sequence[Transfer]) -> None:
        """Every transfer names a device block in ``[0, num_blocks)`` and a host slot in
        ``[0, num_host_slots)``; ValueError naming the first that does not."""
        for index, transfer in enumerate(transfers):
            if transfer.kind not in ("spill", "load"):
                raise ValueError(f"transfers[{index}].kind={transfer.kind!r}: spill or load")
            if not 0 <= transfer.block_id < self.num_blocks:
                raise ValueError(
                    f"transfers[{index}].block_id={transfer.block_id} is not in [0, "
                    f"{self.num_blocks}) (num_blocks of this stage's KV cache)"
                )
            if not 0 <= transfer.slot < self.num_host_slots:
                raise ValueError(
                    f"transfers[{index}].slot={transfer.slot} is not in [0, "
                    f"{self.num_host_slots}) (num_host_kv_blocks of this stage's host tier)"
                )

    @property
    def num_local_layers(self) -> int:
        """Decoder layers this stage holds."""
        return self.last_layer - self.first_layer

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        """Record the KV geometry (subclasses allocate memory on top); drops the host tier.

        Raises:
            ValueError: num_blocks or block_size < 1.
        """
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1")
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_host_slots = 0

    def _prepare_common(
        self,
        chunks: Sequence[ChunkSpec],
        *,
        vocab_size: int | None = None,
        max_position: int | None = None,
    ) -> PreparedBatch:
        if self.block_size == 0:
            raise RuntimeError("allocate_kv(num_blocks, block_size) must run before prepare()")
        return build_prepared_batch(
            chunks,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            device=self.device,
            needs_token_ids=self.is_first,
            prepared_by=id(self),
            vocab_size=vocab_size,
            max_position=max_position,
        )

    def _check_execute_args(self, prepared: PreparedBatch, hidden_in: torch.Tensor | None) -> None:
        if prepared.prepared_by != id(self):
            raise ValueError("prepared was built by another engine; call this engine's prepare()")
        if prepared.block_size != self.block_size or prepared.num_blocks != self.num_blocks:
            raise ValueError(
                f"prepared is for a KV cache of {prepared.num_blocks} blocks x "
                f"{prepared.block_size} tokens, but this stage now has {self.num_blocks} x "
                f"{self.block_size} (allocate_kv ran in between); prepare again"
            )
        if self.is_first:
            if hidden_in is not None:
                raise ValueError("hidden_in must be None on the first stage (it embeds token_ids)")
            return
        expected = (prepared.num_tokens, self.hidden_size)
        if hidden_in is None:
            raise ValueError(f"hidden_in is None; stage needs activations of shape {expected}")
        if tuple(hidden_in.shape) != expected:
            raise ValueError(
                f"hidden_in has shape {tuple(hidden_in.shape)}; expected [num_tokens, "
                f"hidden_size] = {list(expected)}"
            )
