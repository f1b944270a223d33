"""A stage passes the requests its KV manager released to its engine's ``drop_requests`` on the
compute thread, before the next micro-batch and at each idle beat, so that an engine's
per-request state (Kimi-Linear's running recurrent states) leaves with the request."""

from __future__ import annotations

import queue
from typing import Any, cast

from hf_reference import small_llama

from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.kv import hash_prompt_blocks
from wavepp.runtime.stage.worker import StageWorker


class _Engine:
    """Records what it is told, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def drop_requests(self, request_ids: list[str]) -> None:
        self.calls.append(("drop", list(request_ids)))


def _stage() -> tuple[StageWorker, _Engine]:
    config = RuntimeConfig(model=small_llama("drops", seed=1, num_layers=2), num_stages=2)
    engine = _Engine()
    return StageWorker(config, 1, cast(Any, None), cast(Any, engine)), engine


def _hold(stage: StageWorker, request_id: str) -> None:
    manager = stage.core.manager
    hashes = hash_prompt_blocks(list(range(40)), stage.config.block_size, "m")
    manager.probe_pin(request_id, hashes, lease_s=10)


def test_released_requests_are_dropped_before_the_next_microbatch_is_taken() -> None:
    stage, engine = _stage()
    for rid in ("a", "b", "c"):
        _hold(stage, rid)
    stage.core.manager.release("a")
    stage.core.reform()  # releases b and c
    work: queue.Queue[Any] = queue.Queue()
    work.put("micro-batch")
    assert stage._next_work(work) == "micro-batch"
    assert engine.calls == [("drop", ["a", "b", "c"])]
    work.put("next")
    assert stage._next_work(work) == "next"
    assert engine.calls == [("drop", ["a", "b", "c"])]  # each once: nothing new released


def test_an_idle_stage_drops_at_its_beat() -> None:
    stage, engine = _stage()
    _hold(stage, "a")
    work: queue.Queue[Any] = queue.Queue()
    waits = 0

    def get(timeout: float) -> Any:
        nonlocal waits
        waits += 1
        if waits == 1:  # the loop thread releases while the compute thread waits
            stage.core.manager.release("a")
            raise queue.Empty
        return None

    work.get = get  # type: ignore[method-assign]
    assert stage._next_work(work) is None
    assert waits == 2 and engine.calls == [("drop", ["a"])]
