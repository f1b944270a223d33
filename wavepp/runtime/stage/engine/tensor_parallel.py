"""Tensor parallelism inside one pipeline stage: T processes, one per device, one shard each.

A stage with ``tensor_parallel_size`` T runs T processes over a per-stage process group (gloo on
the CPU, NCCL on CUDA), separate from the pipeline group. TP rank 0 is the stage's *leader*: it
alone speaks NATS and sends/receives activations to/from the neighbouring stages. Ranks 1..T-1
are *followers*: for every micro-batch the leader broadcasts the chunks (JSON) and, after the
first stage, the incoming activations; every rank prepares the same batch and runs its shard of
every layer (Megatron-style)::

    leader (TP rank 0)                                 follower (TP rank t > 0)
    execute(prepared, hidden_in):                      serve_follower():
      broadcast [op, bytes, tokens, has_hidden]  --->    receive header
      broadcast chunks (JSON, uint8)             --->    receive chunks -> prepare()
      broadcast hidden_in (stages after the first) -->    receive hidden_in
      layers: column-parallel q/k/v/gate/up,             the same layers on its shard;
              row-parallel o/down + all-reduce   <-->    the all-reduces pair up
      final norm + lm_head (the leader only)             (no lm_head: nothing to return)

Sharding (``TPGroup.shard``): attention heads are split by TP rank (query heads, and K/V heads
of GQA, which must both divide by T), so each rank's paged cache holds its own heads only;
MLA's latent cache is per token, not per head, so it is replicated on every rank (each rank
expands its own heads from it). Dense and expert FFNs split their intermediate dimension (each
expert's, the shared experts' too); the router, the norms, the embedding, the DSA indexer and
its key cache are replicated; ``lm_head`` is read by the leader only. Kimi-Linear's KDA layers
are not sharded: that family is refused for T > 1 (its ``ModelFamily.tensor_parallel`` is
false, ``wavepp.runtime.families``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from wavepp.runtime.stage.chunk import ChunkSpec

OP_STOP = 0
OP_EXECUTE = 1


@dataclass(frozen=True)
class TPGroup:
    """One process's place in its stage's tensor-parallel group.

    Attributes:
        rank: TP rank in [0, size); 0 is the stage's leader.
        size: T, processes (devices) computing the stage.
        pg: the per-stage process group (None when size is 1).
        device: where collective buffers live (the engine's device; NCCL needs CUDA tensors).
    """

    rank: int = 0
    size: int = 1
    pg: dist.ProcessGroup | None = None
    device: str = "cpu"

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"TP rank {self.rank} outside [0, {self.size})")
        if self.size > 1 and self.pg is None:
            raise ValueError(f"tensor_parallel_size={self.size} needs a process group")

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def shard(self, n: int, what: str) -> slice:
        """This rank's contiguous share of ``n`` items (heads, intermediate rows).

        Raises:
            ValueError: ``n`` does not divide by T (names ``what`` and the TP size field).
        """
        if n % self.size:
            raise ValueError(
                f"{what}={n} is not divisible by tensor_parallel_size={self.size} "
                "(--tensor-parallel-size / spec.tensorParallelSize); choose a divisor"
            )
        step = n // self.size
        return slice(self.rank * step, (self.rank + 1) * step)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the group in place (no-op for T = 1); returns ``t``."""
        if self.size > 1:
            assert self.pg is not None
            self.pg.allreduce([t]).wait()
        return t

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``t`` into every rank's ``t`` (in place); returns ``t``."""
        if self.size > 1:
            assert self.pg is not None
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            self.pg.broadcast([t], opts).wait()
        return t


SINGLE = TPGroup()


def tp_device(device: str, tp_rank: int) -> str:
    """The device of TP rank ``tp_rank``: ``cpu`` stays ``cpu``; ``cuda`` / ``cuda:N`` becomes
    ``cuda:N+tp_rank`` (one GPU per process, as the pod requests T GPUs)."""
    if not device.startswith("cuda"):
        return device
    base = int(device.split(":", 1)[1]) if ":" in device else 0
    return f"cuda:{base + tp_rank}"


def encode_chunks(chunks: Sequence[ChunkSpec]) -> bytes:
    """The chunks as JSON (what the leader broadcasts; no pickle)."""
    return json.dumps([dataclasses.asdict(c) for c in chunks]).encode()


def decode_chunks(data: bytes) -> list[ChunkSpec]:
    """Inverse of :func:`encode_chunks`."""
    out = []
    for raw in json.loads(data.decode()):
        raw["block_ids"] = tuple(raw["block_ids"])
        if raw["token_ids"] is not None:
            raw["token_ids"] = tuple(raw["token_ids"])
        out.append(ChunkSpec(**raw))
    return out


def _header(tp: TPGroup, values: Sequence[int] = (0, 0, 0, 0)) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64, device=tp.device)


class TensorParallelEngine:
    """The leader's engine: broadcasts each micro-batch to the followers, then runs its own
    shard (``inner``, built with this ``TPGroup``). Everything else is ``inner``'s."""

    def __init__(self, inner: Any, tp: TPGroup) -> None:
        if not tp.is_leader:
            raise ValueError("TensorParallelEngine wraps the leader's (TP rank 0) engine")
        self.inner = inner
        self.tp = tp
        # NOTE: set when a batch failed after its broadcast: the followers may be waiting in a
        # collective the leader never reached, so the group is out of step for good.
        self.broken: BaseException | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def prepare(self, chunks: Sequence[ChunkSpec]) -> Any:
        return self.inner.prepare(chunks)

    def execute(self, prepared: Any, hidden_in: torch.Tensor | None) -> Any:
        """Broadcast the batch (chunks, activations) to the followers, run the leader's shard.

        A batch ``inner`` refuses (a bad ``prepared`` or ``hidden_in``) is refused before any
        broadcast, so the followers never start a batch the leader does not run.

        Raises:
            RuntimeError: an earlier batch failed after its broadcast (``broken``): the group
                is out of step and the stage must restart.
        """
        if self.broken is not None:
            raise RuntimeError(
                f"tensor-parallel group out of step since a batch failed: {self.broken!r}"
            )
        self.inner._check_execute_args(prepared, hidden_in)
        payload = encode_chunks(prepared.chunks)
        has_hidden = hidden_in is not None
        try:
            self.tp.broadcast(
                _header(self.tp, (OP_EXECUTE, len(payload), prepared.num_tokens, int(has_hidden)))
            )
            self.tp.broadcast(
                torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.tp.device)
            )
            if hidden_in is not None:
                hidden_in = hidden_in.to(device=self.tp.device, dtype=self.inner.activation_dtype)
                self.tp.broadcast(hidden_in.contiguous())
            return self.inner.execute(prepared, hidden_in)
        except BaseException as exc:
            self.broken = exc
            raise

    def drop_requests(self, request_ids: Sequence[str]) -> None:
        """The leader's shard drops them; the followers hold no per-request state (the only
        layers that keep one, KDA, belong to a family without tensor-parallel support, which
        ``CheckpointStageEngine`` refuses)."""
        self.inner.drop_requests(request_ids)

    def stop_followers(self) -> None:
        """Tell the followers to leave :func:`serve_follower` (call from the thread that runs
        ``execute``, never beside it: the group's collectives must stay in one order)."""
        self.tp.broadcast(_header(self.tp, (OP_STOP, 0, 0, 0)))


def serve_follower(engine: Any, tp: TPGroup) -> int:
    """A follower's loop: run each batch the leader broadcasts on this rank's shard, until the
    leader says stop (or the group fails: the error propagates).

    Returns:
        Micro-batches run.
    """
    if tp.is_leader:
        raise ValueError("serve_follower runs on TP ranks > 0")
    done = 0
    while True:
        header = tp.broadcast(_header(tp))
        op, size, num_tokens, has_hidden = (int(v) for v in header.tolist())
        if op == OP_STOP:
            return done
        payload = tp.broadcast(torch.empty(size, dtype=torch.uint8, device=tp.device))
        chunks = decode_chunks(payload.cpu().numpy().tobytes())
        hidden = None
        if has_hidden:
            hidden = tp.broadcast(
                torch.empty(
                    num_tokens, engine.hidden_size, dtype=engine.activation_dtype, device=tp.device
                )
            )
        engine.execute(engine.prepare(chunks), hidden)
        done += 1
