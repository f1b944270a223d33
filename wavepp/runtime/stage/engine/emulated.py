"""Emulated stage engine: real local preparation, cost-model time instead of layers.

``prepare()`` builds the same block tables, slot mapping and positions as the torch engine.
``execute()`` takes ``time_scale * cost_model.microbatch_cost_s([(L, x), ...])`` seconds of wall
time (the design's t(L, x) = c + g*L + b*x + a*(2*L*x + x^2) per chunk, docs/design.md "Cost model")
and returns small, deterministic activations so that real bytes still travel between stages.

Activation row of token t at position p (emulated_hidden_size >= 2 columns)::

    [token_id, position, 0, ..., 0]     made by the first stage, passed on unchanged

Host tier: ``allocate_host_kv`` records the slots (no bytes); ``apply_transfers`` counts the
log's loads, and the next ``prepare`` (on arrival in wave mode, else on the critical path)
queues them on the stage's one host-to-device link, ``time_scale * host_load_s_per_block``
each, starting once the link is free; ``execute`` ends no earlier than its cost-model time
after the loads queued before it landed (the simulator's ``SimStage`` charges the same).

The last stage returns fake logits: a one-hot [emulated_vocab_size] float32 vector at
``(token_id + position) % emulated_vocab_size`` of each is_last chunk's last row, so a test can
check that rows stayed aligned through the pipeline.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from wavepp.runtime.kv import Transfer
from wavepp.runtime.model_config import ModelConfig
from wavepp.runtime.stage.engine.base import (
    ChunkSpec,
    PagedStageEngineBase,
    PreparedBatch,
    StageOutput,
)


class CostModelLike(Protocol):
    """Duck type of ``wavepp.runtime.planning.CostModel`` used here."""

    def microbatch_cost_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        """Seconds one stage takes for chunks given as (context_offset L, num_tokens x)."""
        ...


def fake_logits(token_id: int, position: int, vocab_size: int) -> torch.Tensor:
    """The emulated last stage's logits: one-hot at ``(token_id + position) % vocab_size``."""
    logits = torch.zeros(vocab_size, dtype=torch.float32)
    logits[(token_id + position) % vocab_size] = 1.0
    return logits


class EmulatedStageEngine(PagedStageEngineBase):
    """A stage that sleeps its cost model's micro-batch time.

    Stores no KV memory: ``allocate_kv`` only records the geometry that ``prepare`` validates
    block ids against.
    """

    def __init__(
        self,
        *,
        model: ModelConfig,
        first_layer: int,
        last_layer: int,
        num_layers_total: int,
        cost_model: CostModelLike | Any,
        device: torch.device | str = "cpu",
        time_scale: float = 1.0,
        emulated_hidden_size: int = 8,
        emulated_vocab_size: int = 16,
        host_load_s_per_block: float = 0.0,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """Build the emulated stage.

        Args:
            model: the model being emulated (its name labels the run; its shapes are unused).
            first_layer, last_layer, num_layers_total: this stage's layer range.
            cost_model: this stage's cost model (for its number of layers), with
                ``microbatch_cost_s(seq of (L, x)) -> seconds``.
            device: where prepared tensors and activations live.
            time_scale: multiplies every sleep (> 0; e.g. 0.1 runs 10x faster than modelled).
            emulated_hidden_size: columns of the activations sent on (>= 2).
            emulated_vocab_size: length of the fake logits (>= 1).
            host_load_s_per_block: modelled seconds one block takes from the host tier to the
                device (>= 0; ``RuntimeConfig.host_load_s_per_block``), before ``time_scale``.
            clock, sleep: time source and sleep, injectable for fake-clock tests.

        Raises:
            ValueError: missing cost model or a bad scale / size.
        """
        super().__init__(
            first_layer=first_layer,
            last_layer=last_layer,
            num_layers_total=num_layers_total,
            device=device,
        )
        if cost_model is None or not callable(getattr(cost_model, "microbatch_cost_s", None)):
            raise ValueError(
                f"cost_model={cost_model!r} must have microbatch_cost_s(seq of (L, x)) -> "
                "seconds (wavepp.runtime.planning.CostModel); the emulated engine needs one"
            )
        if not time_scale > 0:
            raise ValueError(f"time_scale={time_scale} must be > 0")
        if emulated_hidden_size < 2:
            raise ValueError(f"emulated_hidden_size={emulated_hidden_size} must be >= 2")
        if emulated_vocab_size < 1:
            raise ValueError(f"emulated_vocab_size={emulated_vocab_size} must be >= 1")
        if not host_load_s_per_block >= 0:
            raise ValueError(f"host_load_s_per_block={host_load_s_per_block} must be >= 0")
        self.model = model
        self.cost_model = cost_model
        self.time_scale = float(time_scale)
        self.hidden_size = emulated_hidden_size
        self.emulated_vocab_size = emulated_vocab_size
        self.activation_dtype = torch.float32
        self._clock = clock
        self._sleep = sleep
        self.last_cost_s = 0.0
        self.load_s_per_block = self.time_scale * float(host_load_s_per_block)
        self.link_free_at_s = 0.0  # clock seconds this stage's host-to-device link is free
        self.num_loaded_blocks = 0
        self._pending_loads = 0  # loads applied, not yet queued on the link

    def allocate_host_kv(self, num_slots: int) -> None:
        """Record the host tier's slots (the emulated stage keeps no bytes)."""
        self._set_host_slots(num_slots)

    def apply_transfers(self, transfers: Sequence[Transfer]) -> None:
        """Count the log's loads for the next ``prepare`` (spills model no time: they leave
        the device over the other direction of the link and nothing waits for them).

        Raises:
            ValueError: a block id or slot out of range (named).
        """
        self._check_transfers(transfers)
        self._pending_loads += sum(transfer.kind == "load" for transfer in transfers)

    def drop_requests(self, request_ids: Sequence[str]) -> None:
        """Nothing to drop: the emulated stage keeps no per-request state."""
        del request_ids

    def prepare(self, chunks: Sequence[ChunkSpec]) -> PreparedBatch:
        """Local preparation: the same block tables, slot mapping and positions as torch; the
        host loads applied since the last one start on the link.

        Raises:
            ValueError: a chunk field is invalid (see ``build_prepared_batch``).
            RuntimeError: allocate_kv has not run.
        """
        prepared = self._prepare_common(chunks)
        if self._pending_loads:
            num_loads, self._pending_loads = self._pending_loads, 0
            self.num_loaded_blocks += num_loads
            begin_s = max(self._clock(), self.link_free_at_s)
            self.link_free_at_s = begin_s + num_loads * self.load_s_per_block
        return prepared

    def stage_cost_s(self, prepared: PreparedBatch) -> float:
        """Modelled seconds of this micro-batch on this stage, before ``time_scale``."""
        return float(
            self.cost_model.microbatch_cost_s(
                [(c.context_offset, c.num_tokens) for c in prepared.chunks]
            )
        )

    def execute(self, prepared: PreparedBatch, hidden_in: torch.Tensor | None) -> StageOutput:
        """Take the modelled time and pass deterministic activations on.

        Wall time of the call is ``time_scale * stage_cost_s(prepared)`` (the sleep covers
        what is left after building the outputs), counted from when the host loads queued
        before it have landed if that is later; ``last_cost_s`` records the cost-model part.

        Args:
            prepared: from this engine's :meth:`prepare`.
            hidden_in: [num_tokens, emulated_hidden_size] from the previous stage; None on
                stage 0.

        Returns:
            hidden [num_tokens, emulated_hidden_size] float32 (None on the last stage); the
            last stage returns :func:`fake_logits` per is_last chunk.

        Raises:
            ValueError: as the torch engine's execute.
        """
        start_s = max(self._clock(), self.link_free_at_s)
        self._check_execute_args(prepared, hidden_in)
        target_s = self.time_scale * self.stage_cost_s(prepared)
        self.last_cost_s = target_s
        if self.is_first:
            assert prepared.token_ids is not None
            hidden = torch.zeros(
                (prepared.num_tokens, self.hidden_size), dtype=torch.float32, device=self.device
            )
            hidden[:, 0] = prepared.token_ids.to(torch.float32)
            hidden[:, 1] = prepared.positions.to(torch.float32)
        else:
            assert hidden_in is not None
            hidden = hidden_in.to(device=self.device, dtype=torch.float32).clone()
        output = StageOutput(hidden=hidden)
        if self.is_last:
            output = StageOutput(hidden=None)
            for rid, row in prepared.logits_rows:
                token_id, position = (int(v) for v in hidden[row, :2].tolist())
                output.last_token_logits[rid] = fake_logits(
                    token_id, position, self.emulated_vocab_size
                )
        remaining_s = start_s + target_s - self._clock()
        if remaining_s > 0:
            self._sleep(remaining_s)
        return output
