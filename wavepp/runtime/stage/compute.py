"""The stage's compute thread: activations over torch.distributed, the engine's prepare/execute.

One thread per group epoch (``StageCompute._start_compute``) takes ``(work, prepared)`` from the
worker's queue in plan order, receives the micro-batch's activations from rank r-1, prepares it
(unless the loop thread did on arrival), executes the stage's layers, hands the done message back
to the loop thread (``_after_microbatch``) and sends the activations to rank r+1 (at most
``_MAX_PENDING_SENDS`` sends in flight). A micro-batch that failed still sends zeros of the
right shape, so no later stage waits forever. A failed send/receive is the group's failure
(``_on_group_error``, on the loop thread); the thread's liveness is ``compute_alive``.

The loop-thread side (NATS, plan delivery, re-forming) is ``wavepp.runtime.stage.worker``,
whose ``StageWorker`` is the one ``StageCompute``: this class owns the thread, the worker its
state and the two callbacks below.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Mapping
from functools import partial

import torch
import torch.distributed as dist

from wavepp.api.messages import MicroBatchDone, RequestResult
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.stage.core import StageCore, StageWork
from wavepp.runtime.stage.engine import PreparedBatch, StageEngine
from wavepp.runtime.stage.engine.profile import region
from wavepp.runtime.stage.loop_profile import LoopProfile
from wavepp.runtime.stage.rendezvous import EpochRendezvous

log = logging.getLogger(__name__)

_MAX_PENDING_SENDS = 16
_IDLE_BEAT_S = 1.0  # the idle compute thread's beat period


class StageCompute(ABC):
    """The compute thread of one stage, run over the state of its ``StageWorker``.

    The loop thread calls ``_start_compute`` once per epoch (with that epoch's ``_pg``,
    ``_work`` and ``_generation``); the thread calls back on the loop thread through the two
    abstract methods. ``compute_beat`` (monotonic seconds) and ``compute_error`` are its
    liveness record. ``loop_profile``: where the thread's time goes per micro-batch
    (``wavepp.runtime.stage.loop_profile``); None records nothing.
    """

    config: RuntimeConfig
    rank: int
    engine: StageEngine
    core: StageCore
    is_first: bool
    is_last: bool
    is_formed: bool
    rendezvous: EpochRendezvous | None
    group_epoch: int
    compute_beat: float
    compute_error: BaseException | None
    loop_profile: LoopProfile | None
    _pg: dist.ProcessGroup | None
    _work: queue.Queue[tuple[StageWork, PreparedBatch | None] | None]
    _generation: int
    _released: deque[str]
    _loop: asyncio.AbstractEventLoop | None
    _thread: threading.Thread | None

    @abstractmethod
    def _after_microbatch(self, work: StageWork, done: MicroBatchDone) -> None:
        """On the loop thread: ``work`` ended with ``done`` (cache, publish)."""

    @abstractmethod
    def _on_group_error(self, generation: int, exc: BaseException) -> None:
        """On the loop thread: a send/receive of ``generation``'s group raised ``exc``."""

    def _start_compute(self) -> None:
        """A compute thread for the current group and work queue (one per epoch)."""
        self._thread = threading.Thread(
            target=self._compute_loop,
            args=(self._pg, self._work, self._generation),
            name=f"compute-{self.group_epoch}",
            daemon=True,
        )
        self._thread.start()

    @property
    def activation_device(self) -> torch.device:
        """Where the activations sent and received live: the stage's device under nccl (GPU to
        GPU), the CPU under gloo (the engine moves them to its device)."""
        if self.config.resolved_activation_backend == "nccl":
            return torch.device(self.config.device)
        return torch.device("cpu")

    @property
    def compute_alive(self) -> bool:
        """The compute thread runs, has not raised, and beat within the micro-batch deadline
        (a receive or execute stuck longer fails its micro-batch anyway). While the stage waits
        to re-form in place (its group broke, ``is_formed`` False) its epoch's thread has ended
        by design: alive, unless something recorded a ``compute_error``."""
        if self.compute_error is None and not self.is_formed:
            return True
        return (
            self._thread is not None
            and self._thread.is_alive()
            and self.compute_error is None
            and time.monotonic() - self.compute_beat < self.config.microbatch_deadline_s
        )

    def _compute_loop(
        self,
        pg: dist.ProcessGroup | None,
        work_queue: queue.Queue[tuple[StageWork, PreparedBatch | None] | None],
        generation: int,
    ) -> None:
        """One epoch's compute thread: activations over ``pg``; leaves when ``work_queue``
        yields None, when its group fails (a peer died), or when a later epoch replaced it
        (then it publishes nothing more).

        What ends it is recorded: a failed send/receive of a stage that can re-form in place
        (a rendezvous) takes it out of service until the next epoch (``_on_group_error``);
        any other raise, or any raise without a rendezvous, is ``compute_error``
        (``compute_alive`` turns False, so the pod's liveness and readiness fail and the
        operator re-forms the replica)."""
        torch.set_num_threads(self.config.torch_threads)
        pending_sends: deque[tuple[dist.Work, torch.Tensor]] = deque()
        try:
            self._compute(pg, work_queue, generation, pending_sends)
            for handle, _ in pending_sends:
                handle.wait()
        except Exception as exc:  # noqa: BLE001 - torch.distributed: a peer left the group
            if self.rendezvous is None:
                self.compute_error = exc
                log.exception("stage %d: compute thread died", self.rank)
                return
            assert self._loop is not None, "compute thread started before serve()"
            self._loop.call_soon_threadsafe(self._on_group_error, generation, exc)
        except BaseException as exc:
            self.compute_error = exc
            log.exception("stage %d: compute thread died", self.rank)

    def _next_work(
        self, work_queue: queue.Queue[tuple[StageWork, PreparedBatch | None] | None]
    ) -> tuple[StageWork, PreparedBatch | None] | None:
        """The next item of the work queue, beating while idle; first, and at each beat, the
        engine drops the state of the requests released since (``_drop_released``)."""
        while True:
            self.compute_beat = time.monotonic()
            self._drop_released()
            try:
                return work_queue.get(timeout=_IDLE_BEAT_S)
            except queue.Empty:
                continue

    def _drop_released(self) -> None:
        """On the compute thread, between micro-batches: the engine forgets the per-request
        state of every request the KV manager released since the last call. A release follows
        the last stage's result of each of the request's micro-batches, so none of them is
        still to run here."""
        if not self._released:
            return
        request_ids = []
        while self._released:
            request_ids.append(self._released.popleft())
        self.engine.drop_requests(request_ids)

    def _compute(
        self,
        pg: dist.ProcessGroup | None,
        work_queue: queue.Queue[tuple[StageWork, PreparedBatch | None] | None],
        generation: int,
        pending_sends: deque[tuple[dist.Work, torch.Tensor]],
    ) -> None:
        engine = self.engine
        core = self.core
        clock = time.perf_counter
        while True:
            item = self._next_work(work_queue)
            if item is None or generation != self._generation:
                return
            prof = self.loop_profile
            # this micro-batch's compute parts, recorded with its wall once it is sent (one
            # dropped by a re-form or a failed send records neither)
            parts: dict[str, float] = {}
            began = clock()
            work, prepared = item
            num_tokens = work.num_tokens
            hidden_in = None
            if not self.is_first:
                assert pg is not None, "a stage after the first has a group"
                hidden_in = torch.empty(
                    num_tokens,
                    engine.hidden_size,
                    dtype=engine.activation_dtype,
                    device=self.activation_device,
                )
                t = clock()
                with region("recv"):
                    pg.recv([hidden_in], self.rank - 1, 0).wait()
                parts["recv"] = clock() - t
                self.compute_beat = time.monotonic()
            results: list[RequestResult] = []
            hidden_out = None
            exec_start = exec_end = time.time()
            if not work.error:
                try:
                    if prepared is None:
                        t = clock()
                        work.prepare_start_s = time.time()
                        prepared = engine.prepare(work.chunks)
                        work.prepare_end_s = time.time()
                        parts["prepare"] = clock() - t
                    t = clock()
                    exec_start = time.time()
                    out = engine.execute(prepared, hidden_in)
                    exec_end = time.time()
                    parts["execute"] = clock() - t
                    t = clock()
                    hidden_out = out.hidden
                    logits = out.last_token_logits
                    results = core.results(
                        work, partial(_first_token_id, logits), partial(_logits_list, logits)
                    )
                    parts["results"] = clock() - t
                except Exception as exc:  # keep the pipeline moving; report the error
                    log.exception(
                        "stage %d: micro-batch %d failed", self.rank, work.plan.microbatch_id
                    )
                    work.error = f"stage {self.rank}: execute failed: {exc!r}"
            if generation != self._generation:
                return  # re-formed meanwhile: this micro-batch belongs to the old group
            t = clock()
            done = core.done_message(
                work, execute_start_s=exec_start, execute_end_s=exec_end, results=results
            )
            parts["results"] = parts.get("results", 0.0) + clock() - t
            # Cache the computed blocks before the activations leave: a release for this
            # request can only follow the last stage's result, hence this send.
            assert self._loop is not None, "compute thread started before serve()"
            self._loop.call_soon_threadsafe(self._after_microbatch, work, done)
            if not self.is_last:
                assert pg is not None, "a stage before the last has a group"
                if hidden_out is None or work.error:
                    hidden_out = torch.zeros(
                        num_tokens, engine.hidden_size, dtype=engine.activation_dtype
                    )
                t = clock()
                hidden_out = hidden_out.to(self.activation_device).contiguous()
                with region("send"):
                    pending_sends.append((pg.send([hidden_out], self.rank + 1, 0), hidden_out))
                    while len(pending_sends) > _MAX_PENDING_SENDS:
                        pending_sends.popleft()[0].wait()
                parts["send"] = clock() - t
            if prof is not None:
                prof.microbatch_done(clock() - began, parts)


def _first_token_id(logits: Mapping[str, torch.Tensor], request_id: str) -> int:
    """The greedy first output token: argmax of the request's last-token logits."""
    return int(torch.argmax(logits[request_id]).item())


def _logits_list(logits: Mapping[str, torch.Tensor], request_id: str) -> list[float]:
    return [float(v) for v in logits[request_id].tolist()]
