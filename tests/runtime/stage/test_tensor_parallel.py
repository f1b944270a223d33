"""Tensor parallelism inside a stage: TP = 2 x PP = 2 on the CPU (gloo, 4 processes) equals the
reference (transformers' monolithic forward) within 1e-4 fp32.

``test_tp2_x_pp2_equals_the_reference``: four processes (forked from a fork server that
imported torch once) drive the engines directly over real torch.distributed groups: each
stage's TP group (leader + follower: the leader's ``TensorParallelEngine`` broadcasts every
micro-batch, the follower runs ``serve_follower``) and a pipeline group between the two leaders
(activations by send/recv, as the stage worker does). The chunks are built here: a first
request in three chunks, then a second one reusing three cached blocks of the first, in two
chunks, with a third request's chunks in the same micro-batches. Four families and the seeded
Llama engine.

``test_wavepp_stage_processes_with_tp2_x_pp2_match_the_reference`` runs the real ``wavepp
stage`` processes (NATS, scheduler, workers) with TP = 2 on one family;
``tests/operator/test_tensor_parallel_pod.py`` runs the operator's rendered stage pods.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import random
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from proc_support import children_running

from wavepp.api.layer_split import split_layers
from wavepp.runtime.families import TENSOR_PARALLEL
from wavepp.runtime.hf_config import load_model_dir
from wavepp.runtime.model_config import ModelConfig
from wavepp.runtime.stage.engine import ChunkSpec, make_engine
from wavepp.runtime.stage.engine.tensor_parallel import (
    SINGLE,
    TensorParallelEngine,
    TPGroup,
    serve_follower,
)

pytestmark = pytest.mark.timeout(180)

ATOL = 1e-4
VOCAB = 256
NUM_LAYERS = 5
PARTITION = [3, 2]  # unequal layers per stage
BLOCK = 4
# NOTE: every family the registry shards (kimi_linear is refused: the test below).
FAMILIES = sorted(TENSOR_PARALLEL)
SEEDED = ModelConfig(
    name="tp-seeded", num_layers=NUM_LAYERS, vocab_size=VOCAB, hidden_size=64, num_heads=4,
    num_kv_heads=2, head_dim=16, intermediate_size=96,
)  # fmt: skip
TIMEOUT = datetime.timedelta(seconds=60)


def _prompts() -> dict[str, list[int]]:
    rng = random.Random(5)
    a = [rng.randrange(VOCAB) for _ in range(23)]
    return {
        "a": a,
        "b": a[:14] + [rng.randrange(VOCAB) for _ in range(9)],
        "c": [rng.randrange(VOCAB) for _ in range(11)],
    }


def _tables(stage: int) -> dict[str, list[int]]:
    """Per request, the stage's block ids (shuffled pool; b shares a's first 3 blocks)."""
    ids = list(range(40 + 5 * stage))
    random.Random(stage).shuffle(ids)
    a = [ids.pop() for _ in range(6)]
    return {"a": a, "b": a[:3] + [ids.pop() for _ in range(3)], "c": [ids.pop() for _ in range(3)]}


# (request, offset, tokens, is_last) per chunk; one micro-batch per list.
MICROBATCHES = [
    [("a", 0, 7, False), ("c", 0, 5, False)],
    [("a", 7, 9, False), ("c", 5, 6, True)],
    [("a", 16, 7, True)],
    [("b", 12, 5, False)],  # 3 blocks (12 tokens) of a reused
    [("b", 17, 6, True)],
]


def _chunks(stage: int, batch: list[tuple[str, int, int, bool]]) -> list[ChunkSpec]:
    prompts, tables = _prompts(), _tables(stage)
    return [
        ChunkSpec(
            request_id=rid,
            context_offset=offset,
            num_tokens=n,
            block_ids=tuple(tables[rid]),
            token_ids=tuple(prompts[rid][offset : offset + n]) if stage == 0 else None,
            is_last=last,
        )
        for rid, offset, n, last in batch
    ]


def _engine(source: str | ModelConfig, stage: int, tp: TPGroup) -> Any:
    if isinstance(source, ModelConfig):
        model, extra = source, {}
    else:
        model, extra = load_model_dir(source), {"model_dir": source}
    first, last = split_layers(model.num_layers, 2, PARTITION)[stage]
    engine = make_engine(
        "torch",
        model=model,
        first_layer=first,
        last_layer=last,
        num_layers_total=model.num_layers,
        tp=tp,
        **extra,
    )
    engine.allocate_kv(40 + 5 * stage, BLOCK)
    return engine


def _worker(rank: int, port: int, sources: list[Any], out: Any) -> None:
    """Global rank g: stage g // 2, TP rank g % 2; runs every source in turn."""
    try:
        torch.set_num_threads(1)
        stage, tp_rank = divmod(rank, 2)
        store = dist.TCPStore("127.0.0.1", port, 5, False, timeout=TIMEOUT)
        tp_pg = dist.ProcessGroupGloo(dist.PrefixStore(f"tp{stage}/", store), tp_rank, 2, TIMEOUT)
        tp = TPGroup(rank=tp_rank, size=2, pg=tp_pg)
        pp = None
        if tp_rank == 0:
            pp = dist.ProcessGroupGloo(dist.PrefixStore("pp/", store), stage, 2, TIMEOUT)
        for name, source in sources:
            engine = _engine(source, stage, tp)
            out.put(("bytes", name, rank, getattr(engine, "bytes_read", 0)))
            if tp_rank == 1:
                serve_follower(engine, tp)
                continue
            leader = TensorParallelEngine(engine, tp)
            assert pp is not None
            for batch in MICROBATCHES:
                chunks = _chunks(stage, batch)
                prepared = leader.prepare(chunks)
                hidden = None
                if stage == 1:
                    hidden = torch.empty(prepared.num_tokens, engine.hidden_size)
                    pp.recv([hidden], 0, 0).wait()
                result = leader.execute(prepared, hidden)
                if stage == 0:
                    pp.send([result.hidden.contiguous()], 1, 0).wait()
                for rid, logits in result.last_token_logits.items():
                    out.put(("logits", name, rid, logits.tolist()))
            leader.stop_followers()
        out.put(("done", rank))
    except BaseException:  # noqa: BLE001 - reported to the parent
        out.put(("error", rank, traceback.format_exc()))


def _reference(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0, -1].float()


def _single_process(config: ModelConfig, tokens: list[int]) -> torch.Tensor:
    """The seeded Llama engine in one process, all layers (itself checked against
    transformers by tests/runtime/stage/test_engine_reference.py)."""
    engine = make_engine(
        "torch", model=config, first_layer=0, last_layer=NUM_LAYERS, num_layers_total=NUM_LAYERS
    )
    engine.allocate_kv(8, BLOCK)
    spec = ChunkSpec("x", 0, len(tokens), tuple(range(8)), tuple(tokens), is_last=True)
    return engine.execute(engine.prepare([spec]), None).last_token_logits["x"]


def test_tp2_x_pp2_equals_the_reference(tmp_path: Path) -> None:
    # NOTE: imported here, not at module level: the spawned workers import this module.
    pytest.importorskip("transformers")
    from wavepp.bench.checkpoints import save_random_checkpoint

    references: dict[str, Any] = {}
    sources: list[tuple[str, Any]] = []
    for family in FAMILIES:
        out_dir = tmp_path / family
        references[family] = save_random_checkpoint(
            family, out_dir, num_layers=NUM_LAYERS, vocab_size=VOCAB
        )
        sources.append((family, str(out_dir)))
    sources.append(("seeded-llama", SEEDED))
    # NOTE: a fork server that imported torch and the engines once forks the 4 workers (as
    # spawn, they never inherit this process's threads; unlike spawn, each skips the imports).
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "wavepp.runtime.stage.engine"])
    store = dist.TCPStore("127.0.0.1", 0, 5, True, timeout=TIMEOUT, wait_for_workers=False)
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, store.port, sources, out)) for r in range(4)]
    for p in procs:
        p.start()
    got: dict[tuple[str, str], torch.Tensor] = {}
    read: dict[tuple[str, int], int] = {}
    finished = 0
    try:
        while finished < 4:
            item = out.get(timeout=150)
            if item[0] == "error":
                pytest.fail(f"rank {item[1]} failed:\n{item[2]}")
            elif item[0] == "done":
                finished += 1
            elif item[0] == "bytes":
                read[(item[1], item[2])] = item[3]
            else:
                got[(item[1], item[2])] = torch.tensor(item[3])
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    prompts = _prompts()
    errors = {}
    for name, source in sources:
        for rid in ("a", "b", "c"):
            if isinstance(source, ModelConfig):
                expected = _single_process(source, prompts[rid])
            else:
                expected = _reference(references[name], prompts[rid])
            assert expected.std() > 0.3, "reference logits too flat for a meaningful check"
            errors[(name, rid)] = (got[(name, rid)] - expected).abs().max().item()
    print("max |logits - reference| per (family, request):", errors)
    assert max(errors.values()) < ATOL, errors
    # Each TP rank reads its share: the sharded tensors halve, the replicated ones do not.
    for name, source in sources:
        if isinstance(source, ModelConfig):
            continue
        for stage in (0, 1):
            whole = _engine(source, stage, SINGLE).bytes_read
            leader, follower = read[(name, 2 * stage)], read[(name, 2 * stage + 1)]
            print(f"{name} stage {stage}: one process {whole} B, TP ranks {leader} / {follower} B")
            assert follower < 0.75 * whole and leader < whole


def test_unsharded_family_and_bad_sizes_are_refused_by_name(tmp_path: Path) -> None:
    from wavepp.bench.checkpoints import save_random_checkpoint
    from wavepp.launch.flags import ArgError
    from wavepp.launch.replica import with_tensor_parallel
    from wavepp.runtime.config import RuntimeConfig

    save_random_checkpoint("kimi_linear", tmp_path, num_layers=2, vocab_size=VOCAB)
    model = load_model_dir(tmp_path)
    # NOTE: no collective runs before the refusal, so a placeholder group object suffices.
    two = TPGroup(rank=1, size=2, pg=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"tensorParallelSize\): family 'kimi_linear'"):
        make_engine(
            "torch", model=model, first_layer=0, last_layer=2, num_layers_total=2,
            model_dir=tmp_path, tp=two,
        )  # fmt: skip
    three = TPGroup(rank=0, size=3, pg=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_heads=4 is not divisible by tensor_parallel_size=3"):
        make_engine(
            "torch", model=SEEDED, first_layer=0, last_layer=1, num_layers_total=5, tp=three
        )
    config = RuntimeConfig(num_stages=1, engine="emulated", cost_model={})
    with pytest.raises(ArgError, match="--tensor-parallel-size 2: .*emulated"):
        with_tensor_parallel(config, 2)
    assert with_tensor_parallel(RuntimeConfig(num_stages=1), 2).tensor_parallel_size == 2


def test_a_batch_failing_after_its_broadcast_breaks_the_group_for_good() -> None:
    """Leader and follower as two threads over a real gloo group: a batch the leader fails
    after the broadcast leaves the follower in a collective the leader never reaches; the
    leader's engine says ``broken`` and refuses every later batch (the stage worker then stops
    the stage) instead of pairing the next broadcast with that stale collective."""
    import threading

    store = dist.HashStore()
    timeout = datetime.timedelta(seconds=3)
    groups: dict[int, TPGroup] = {}
    follower_error: list[BaseException] = []

    def join(rank: int) -> None:
        groups[rank] = TPGroup(rank, 2, dist.ProcessGroupGloo(store, rank, 2, timeout))

    def follow() -> None:
        try:
            serve_follower(_engine(SEEDED, 0, groups[1]), groups[1])
        except BaseException as exc:  # noqa: BLE001 - the stale collective times out
            follower_error.append(exc)

    joiners = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in joiners:
        t.start()
    for t in joiners:
        t.join()
    follower = threading.Thread(target=follow)
    follower.start()
    leader = TensorParallelEngine(_engine(SEEDED, 0, groups[0]), groups[0])
    chunks = _chunks(0, MICROBATCHES[0])
    out = leader.execute(leader.prepare(chunks), None)
    whole = _engine(SEEDED, 0, SINGLE)
    expected = whole.execute(whole.prepare(chunks), None).hidden
    assert (out.hidden - expected).abs().max().item() < ATOL

    def fail(prepared: Any, hidden: Any) -> Any:
        raise RuntimeError("out of memory")

    leader.inner.execute = fail
    with pytest.raises(RuntimeError, match="out of memory"):
        leader.execute(leader.prepare(_chunks(0, MICROBATCHES[1])), None)
    assert isinstance(leader.broken, RuntimeError)
    with pytest.raises(RuntimeError, match="out of step"):
        leader.execute(leader.prepare(_chunks(0, MICROBATCHES[1])), None)
    follower.join(30)
    assert follower_error, "the follower's unmatched collective should have failed"


def test_a_tp_stage_on_cuda_needs_one_gpu_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    from wavepp.runtime.config import RuntimeConfig
    from wavepp.runtime.stage import build

    config = RuntimeConfig(num_stages=1, tensor_parallel_size=2, device="cuda")
    monkeypatch.setattr(build.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(build.torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"tensorParallelSize=2: .* sees 1 CUDA device"):
        build.check_environment(config)
    monkeypatch.setattr(build.torch.cuda, "device_count", lambda: 2)
    build.check_environment(config)


@pytest.mark.slow
async def test_wavepp_stage_processes_with_tp2_x_pp2_match_the_reference(tmp_path: Path) -> None:
    """The real path: ``LocalPipeline`` (nats-server, scheduler, ``wavepp stage`` processes,
    as ``wavepp up`` runs them) with tensor_parallel_size 2 and 2 stages: each stage process
    starts its follower (4 stage processes); a MiniMax-M2 checkpoint (GQA KV sharded by head,
    the sharded QK-norm, MoE); chunked prefill (chunk_tokens 8) and a second request reusing 3
    cached blocks; logits vs transformers within 1e-4."""
    pytest.importorskip("transformers")
    from wavepp.bench.checkpoints import save_random_checkpoint
    from wavepp.launch.runtime_config import with_checkpoint
    from wavepp.runtime.config import RuntimeConfig
    from wavepp.runtime.planning import CostModel
    from wavepp.runtime.request import PromptRequest
    from wavepp.runtime.serving.local import LocalPipeline

    reference = save_random_checkpoint("minimax_m2", tmp_path / "ckpt", num_layers=NUM_LAYERS)
    base = RuntimeConfig(
        num_stages=2,
        tensor_parallel_size=2,
        block_size=BLOCK,
        num_kv_blocks=[64],
        chunk_tokens=8,
        mode="sync",  # static 8-token chunks: every prompt is prefilled in several chunks
    )
    served = with_checkpoint(base, str(tmp_path / "ckpt"))
    config = RuntimeConfig.model_validate(served.model_dump() | {"partition": PARTITION})
    cost = CostModel(c=1e-4, g=1e-7, b=1e-5, a=1e-8, label="measured", source="test")
    prompts = _prompts()
    async with LocalPipeline(config, cost, log_dir=str(tmp_path / "logs")) as pipeline:
        assert pipeline.scheduler is not None
        for proc in pipeline.procs:  # one follower per stage process
            assert len(children_running(proc.pid, "wavepp.runtime.stage.tp_launch")) == 1
        first = await pipeline.scheduler.submit(
            PromptRequest("a", prompts["a"], return_logits=True)
        )
        second = await pipeline.scheduler.submit(
            PromptRequest("b", prompts["b"], return_logits=True)
        )
    assert first.ok and second.ok, (first.error, second.error)
    assert second.num_cached_tokens == 12  # 3 full blocks of a's 14 shared tokens
    for outcome, tokens in ((first, prompts["a"]), (second, prompts["b"])):
        want = _reference(reference, tokens)
        error = (torch.tensor(outcome.logits) - want).abs().max().item()
        print(f"wavepp stage TP=2 x PP=2, request {outcome.request_id}: max |diff| {error:.2e}")
        assert error < ATOL


async def test_a_stopped_follower_stops_its_stage_within_the_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A SIGSTOPped follower is noticed (the leader watches for stopped followers, not only
    exits), so requests do not wait for the group's 120 s collective timeout or their own
    deadline."""
    import asyncio
    import signal
    import subprocess
    import sys
    import time

    from wavepp.runtime.stage import process
    from wavepp.runtime.stage.tp_launch import FollowerSet

    class Engine:
        broken = None

    monkeypatch.setattr(process, "TP_STOPPED_LIMIT_S", 1.0)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        followers = FollowerSet(None, [proc], None)  # type: ignore[arg-type]
        assert followers.stopped() == []
        proc.send_signal(signal.SIGSTOP)
        for _ in range(50):  # the state changes as the signal is delivered
            if followers.stopped():
                break
            await asyncio.sleep(0.02)
        assert followers.stopped() == [1]
        stop = asyncio.Event()
        started = time.monotonic()
        why = await asyncio.wait_for(process._watch_followers(followers, Engine(), 0, stop), 10)
        assert "[1] stopped for 1 s" in why and stop.is_set()
        assert 1.0 <= time.monotonic() - started < 5.0
        proc.send_signal(signal.SIGCONT)
        for _ in range(50):
            if not followers.stopped():
                break
            await asyncio.sleep(0.02)
        assert followers.stopped() == []
    finally:
        proc.kill()
        proc.wait()
