"""The stage core: a stage's decisions with no NATS, no torch, and a fake clock.

The stage process (``StageWorker``) and the simulator (``SimStage``) drive the same core; the
last tests check that neither keeps a copy of its logic.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
from typing import Any, cast

import pytest

from wavepp.api.kv_batch import BatchOp, KVBatch, ReserveEntry, encode_batch
from wavepp.api.kv_reply import decode_reply
from wavepp.api.messages import MicroBatchPlan, PlannedChunk, RequestResult
from wavepp.runtime.kv import BlockPool, StageKVManager, hash_prompt_blocks
from wavepp.runtime.stage.core import StageCore, StageWork

BLOCK = 4
MODEL_ID = "core-test"


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def make_core(rank: int = 0, num_stages: int = 1, *, num_blocks: int = 32) -> StageCore:
    clock = FakeClock()
    return StageCore(
        StageKVManager(BlockPool(num_blocks, BLOCK), clock=clock),
        rank=rank,
        num_stages=num_stages,
        local_prepare=True,
        clock=clock,
    )


def hashes(token_ids: list[int]) -> list[str]:
    return [h.hex() for h in hash_prompt_blocks(token_ids, BLOCK, model_id=MODEL_ID)]


def admit(core: StageCore, request_id: str, token_ids: list[int]) -> int:
    """Probe-reserve ``request_id`` on the core, over its KV wire handler; its hit in blocks."""
    entry = ReserveEntry(
        request_id,
        tuple(hash_prompt_blocks(token_ids, BLOCK, model_id=MODEL_ID)),
        -(-len(token_ids) // BLOCK),
    )
    batch = KVBatch(BatchOp.PROBE_RESERVE, (entry,), 30.0)
    (result,) = decode_reply(core.handle_kv_batch(encode_batch(batch))).results
    assert result.ok
    return result.value


def release(core: StageCore, *request_ids: str) -> None:
    """Release ``request_ids`` on the core, over its KV wire handler."""
    reply = decode_reply(core.handle_kv_batch(encode_batch(KVBatch(BatchOp.RELEASE, request_ids))))
    assert all(result.ok for result in reply.results)


def chunk(
    request_id: str, token_ids: list[int], offset: int, *, is_last: bool, index: int = 0
) -> PlannedChunk:
    return PlannedChunk(
        request_id=request_id,
        chunk_index=index,
        context_offset=offset,
        token_ids=token_ids,
        is_last=is_last,
    )


def plan(microbatch_id: int, *chunks: PlannedChunk, epoch: str = "e1") -> MicroBatchPlan:
    return MicroBatchPlan(microbatch_id=microbatch_id, chunks=list(chunks), epoch=epoch)


def run(core: StageCore, work: StageWork, first_token_id: int = 7) -> Any:
    """What a driver does after execution: results, done message, complete."""
    results = core.results(work, lambda request_id: first_token_id)
    done = core.done_message(work, execute_start_s=1.0, execute_end_s=2.0, results=results)
    core.complete(work, done)
    return done


PROMPT = list(range(1, 13))  # 12 tokens = 3 full blocks of 4


def test_importing_the_core_loads_neither_nats_nor_torch() -> None:
    code = (
        "import sys, wavepp.runtime.stage.core, wavepp.sim.stage; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'nats', 'torch'}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]"


def test_a_plan_for_a_request_not_held_moves_on_with_the_error_in_its_done() -> None:
    core = make_core(rank=0, num_stages=1)
    admit(core, "held", PROMPT)
    work = core.accept(
        plan(
            0, chunk("held", PROMPT[:4], 0, is_last=False), chunk("ghost", [1, 2], 0, is_last=True)
        )
    )
    assert "stage 0: cannot build block tables" in work.error and "ghost" in work.error
    assert work.chunks == () and not work.prepare_on_arrival
    assert work.num_agreed_blocks == [0, -1]  # per plan chunk; -1: not reserved here
    done = run(core, work)
    assert done.error == work.error
    assert done.results == []  # the last stage answers nothing for a micro-batch that failed
    assert done.num_tokens == 6 and done.num_agreed_blocks == [0, -1]
    # nothing was marked computed: the held request's blocks got no hash
    assert core.manager.pool.num_cached_blocks == 0


def test_results_only_on_the_last_stage_and_only_for_last_chunks() -> None:
    cores = [make_core(rank=r, num_stages=2) for r in range(2)]
    the_plan = plan(
        0, chunk("a", PROMPT[:8], 0, is_last=False), chunk("b", PROMPT[:5], 0, is_last=True)
    )
    dones = []
    for core in cores:
        admit(core, "a", PROMPT)
        admit(core, "b", PROMPT[:5])
        work = core.accept(the_plan)
        assert work.error == "" and work.prepare_on_arrival
        # block tables from this stage's manager; token ids only on the first stage
        assert [c.block_ids for c in work.chunks] == [
            tuple(core.manager.block_table("a")),
            tuple(core.manager.block_table("b")),
        ]
        assert [c.token_ids is not None for c in work.chunks] == [core.is_first] * 2
        dones.append(run(core, work))
    assert dones[0].results == []
    assert dones[1].results == [RequestResult(request_id="b", first_token_id=7)]
    assert [d.rank for d in dones] == [0, 1]
    assert all(d.prepare_start_s == 100.0 and d.execute_end_s == 2.0 for d in dones)


def test_logits_only_for_chunks_that_ask_for_them() -> None:
    core = make_core()
    admit(core, "a", PROMPT[:4])
    admit(core, "b", PROMPT[:4])
    asks = chunk("a", PROMPT[:4], 0, is_last=True).model_copy(update={"return_logits": True})
    work = core.accept(plan(0, asks, chunk("b", PROMPT[:4], 0, is_last=True)))
    results = core.results(work, lambda rid: 3, lambda rid: [0.5, 1.5])
    assert [(r.request_id, r.logits) for r in results] == [("a", [0.5, 1.5]), ("b", None)]


def test_complete_marks_computed_blocks_cached_for_the_next_request() -> None:
    core = make_core()
    admit(core, "a", PROMPT)
    core.take_kv_events()
    # chunk 1: tokens [0, 6) -> one full block computed
    run(core, core.accept(plan(0, chunk("a", PROMPT[:6], 0, is_last=False))))
    assert core.manager.pool.num_cached_blocks == 1
    batch = core.take_kv_events()
    assert batch is not None and batch.rank == 0
    assert batch.stored == [hashes(PROMPT)[:1]] and batch.removed == []
    # chunk 2: tokens [6, 12) -> all three blocks
    run(core, core.accept(plan(1, chunk("a", PROMPT[6:], 6, is_last=True, index=1))))
    assert core.manager.pool.num_cached_blocks == 3
    assert core.take_kv_events() is not None and core.take_kv_events() is None
    assert core.num_microbatches == 2
    # released, the blocks stay cached: a new request with the same prompt hits all three
    release(core, "a")
    assert admit(core, "a2", PROMPT) == 3


def test_complete_counts_chunks_over_a_cached_context_and_the_context_they_attend() -> None:
    core = make_core()
    admit(core, "a", PROMPT)
    admit(core, "b", PROMPT[:4])
    run(core, core.accept(plan(0, chunk("a", PROMPT[:6], 0, is_last=False))))
    run(
        core,
        core.accept(
            plan(
                1,
                chunk("a", PROMPT[6:], 6, is_last=True, index=1),
                chunk("b", PROMPT[:4], 0, is_last=True),
            )
        ),
    )
    assert (core.num_chunks, core.num_context_chunks) == (3, 1)
    assert (core.num_new_tokens, core.num_context_tokens) == (12 + 4, 6)
    from types import SimpleNamespace

    from wavepp.runtime.stage.metrics import StageMetrics, snapshot_of

    worker = SimpleNamespace(
        config=SimpleNamespace(pipeline="p"),
        rank=0,
        core=core,
        is_formed=True,
        group_epoch=0,
        num_reforms=0,
    )
    metrics = StageMetrics(lambda: snapshot_of(worker))
    try:
        text = metrics.scrape()[0].decode()
    finally:
        metrics.shutdown()
    labels = 'pipeline="p",stage_rank="0"'
    for series in (
        f'wavepp_stage_chunks_total{{context="none",{labels}}} 2.0',
        f'wavepp_stage_chunks_total{{context="cached",{labels}}} 1.0',
        f'wavepp_stage_tokens_total{{kind="new",{labels}}} 16.0',
        f'wavepp_stage_tokens_total{{kind="context",{labels}}} 6.0',
    ):
        assert series in text, text


def test_a_request_released_before_its_chunk_completes_caches_nothing() -> None:
    core = make_core()
    admit(core, "a", PROMPT)
    work = core.accept(plan(0, chunk("a", PROMPT, 0, is_last=True)))
    release(core, "a")
    done = run(core, work)
    assert done.error == "" and core.manager.pool.num_cached_blocks == 0


def test_the_manager_is_the_one_record_of_a_request() -> None:
    core = make_core()
    admit(core, "a", PROMPT)
    manager = core.manager
    assert manager.request_ids() == ["a"]
    assert [h.hex() for h in manager.block_hashes("a")] == hashes(PROMPT)
    assert manager.num_agreed_blocks("a") == -1  # L* arrives with the first chunk
    run(core, core.accept(plan(0, chunk("a", PROMPT[:4], 0, is_last=False))))
    assert manager.num_agreed_blocks("a") == 0
    manager.probe_pin("p", [bytes.fromhex(h) for h in hashes(PROMPT)], 30.0)
    assert manager.num_agreed_blocks("p") == -1  # probed, not reserved
    release(core, "a", "p")
    assert manager.request_ids() == [] and manager.block_hashes("a") == ()


def test_plans_are_due_in_id_order_once_and_dones_are_kept_for_replay() -> None:
    core = StageCore(
        StageKVManager(BlockPool(8, BLOCK)),
        rank=0,
        num_stages=1,
        local_prepare=False,
        clock=FakeClock(),
        done_log_size=2,
    )
    admit(core, "a", PROMPT[:4])
    plans = [plan(i, chunk("a", PROMPT[:4], 0, is_last=True)) for i in range(4)]
    assert core.receive_plan(plans[1]) == []  # waits on the hole [0, 1)
    assert core.sequencer.gap() == (0, 1)
    due = core.receive_plan(plans[0], {"h": "v"})
    assert [(p.microbatch_id, headers) for p, headers in due] == [(0, {"h": "v"}), (1, None)]
    assert core.receive_plan(plans[1]) == []  # a duplicate
    dones = [run(core, core.accept(p)) for p in plans[:3]]
    assert not core.accept(plans[0]).prepare_on_arrival  # local_prepare off
    assert core.dones("e1", [0, 1, 2, 3]) == dones[1:]  # bounded: the oldest went first
    assert core.dones("other", [1, 2]) == []


def test_bad_rank_is_refused() -> None:
    with pytest.raises(ValueError, match=r"rank=2 must be in \[0, num_stages=2\)"):
        make_core(rank=2, num_stages=2)


def test_the_simulator_and_the_worker_drive_the_same_core() -> None:
    """Both construct ``StageCore``; the simulated stage keeps no copy of its logic."""
    import wavepp.sim.stage as sim_stage
    from wavepp.bench.grid import GridSpec, Setting
    from wavepp.launch.grid import runtime_config
    from wavepp.runtime.planning import CostModel
    from wavepp.runtime.stage.worker import StageWorker
    from wavepp.sim.bus import SimBus, SimLatencies

    config, _ = runtime_config(GridSpec(num_kv_blocks=64), Setting("glm-5.2", 2, "low", "wave"))
    manager = StageKVManager(BlockPool(config.kv_blocks_of(1), config.block_size))
    cost_model = CostModel.from_dict(config.cost_model or {})
    sim = sim_stage.SimStage(1, config, cost_model, SimLatencies(), SimBus(0.0), manager)
    worker = StageWorker(config, 1, cast(Any, None), cast(Any, None))
    assert type(sim.core) is StageCore and type(worker.core) is StageCore
    assert sim.core.manager is manager and sim.manager is manager
    is_last = config.num_stages == 2
    assert (
        (sim.core.rank, sim.core.is_last) == (worker.core.rank, worker.core.is_last) == (1, is_last)
    )
    source = inspect.getsource(sim_stage)
    for decision in ("block_table", "mark_computed", "MicroBatchDone(", "RequestResult("):
        assert decision not in source, f"sim/stage.py decides {decision} itself"
