"""``stage.loop_profile``: a stage's loop parts per micro-batch, and a 2-stage pipeline's
profile (receive, send, plan handling per stage; parts plus the rest equal the wall)."""

from __future__ import annotations

import asyncio
import math
import queue
import time
from collections import deque
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from hf_reference import PIPELINE_COST, small_llama

from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.request import PromptRequest
from wavepp.runtime.serving.local import LocalPipeline
from wavepp.runtime.stage.compute import StageCompute
from wavepp.runtime.stage.loop_profile import (
    COMPUTE_PARTS,
    LoopProfile,
    loop_table,
    read_profiles,
)
from wavepp.runtime.stage.worker import StageWorker


def test_other_is_the_wall_less_the_compute_parts_only(tmp_path: Path) -> None:
    profile = LoopProfile(rank=1)
    profile.add("recv", 0.25)
    profile.add("execute", 0.5)
    profile.add("send", 0.05)
    profile.add("plan_decode", 0.125)  # loop thread: concurrent, not part of the wall
    profile.microbatch_done(0.5)
    profile.microbatch_done(0.5)
    profile.plan_done()
    data = profile.to_json()
    assert data["microbatches"] == 2 and data["plans"] == 1
    assert data["other_s"] == pytest.approx(1.0 - 0.8)
    assert read_profiles(tmp_path) == []
    profile.write(tmp_path)
    assert read_profiles(tmp_path) == [data]
    rows = {line.split()[0]: line.split()[1:] for line in loop_table(data)[1:]}
    assert rows["recv"] == ["125.000", "25.0%"]
    assert rows["other"] == ["100.000", "20.0%"]
    assert rows["wall"] == ["500.000", "100.0%"]
    assert rows["plan_decode"][0] == "125.000" and "prepare" not in rows
    with pytest.raises(KeyError, match="not a stage-loop part"):
        profile.add("mlp", 1.0)
    with pytest.raises(ValueError, match="microbatches=0"):
        loop_table(LoopProfile(rank=0).to_json())


def test_a_stage_without_a_profile_dir_has_no_profile() -> None:
    config = RuntimeConfig(model=small_llama("lp", seed=1, num_layers=2), num_stages=2)
    off = StageWorker(config, 1, cast(Any, None), cast(Any, None))
    assert off.loop_profile is None
    on = StageWorker(
        config.model_copy(update={"profile_dir": "x"}), 1, cast(Any, None), cast(Any, None)
    )
    assert isinstance(on.loop_profile, LoopProfile) and on.loop_profile.rank == 1


@pytest.mark.slow
async def test_two_stage_pipeline_profiles_receive_send_and_plans(tmp_path: Path) -> None:
    profile_dir = tmp_path / "profile"
    config = RuntimeConfig(
        model=small_llama("lp", seed=1, num_layers=4),
        engine="torch",
        num_stages=2,
        block_size=4,
        num_kv_blocks=[256, 256],
        chunk_tokens=32,
        profile_dir=str(profile_dir),
    )
    async with LocalPipeline(config, PIPELINE_COST, log_dir=str(tmp_path / "logs")) as pipeline:
        scheduler = pipeline.scheduler
        assert scheduler is not None
        outcomes = await asyncio.gather(
            *(scheduler.submit(PromptRequest(f"r{i}", list(range(5, 45 + i)))) for i in range(4))
        )
    assert all(o.ok for o in outcomes), [o.error for o in outcomes]
    profiles = read_profiles(profile_dir)
    assert [p["rank"] for p in profiles] == [0, 1]
    for p in profiles:
        parts = p["parts_s"]
        assert p["microbatches"] >= 1 and p["plans"] >= p["microbatches"]
        assert parts["execute"] > 0 and parts["plan_decode"] > 0 and parts["plan_accept"] > 0
        assert p["other_s"] >= 0
        covered = sum(v for k, v in parts.items() if k in COMPUTE_PARTS)
        assert math.isclose(covered + p["other_s"], p["wall_s"], rel_tol=1e-9)
    first, last = profiles
    assert first["parts_s"]["send"] > 0 and "recv" not in first["parts_s"]
    assert last["parts_s"]["recv"] > 0 and "send" not in last["parts_s"]
    assert "results" in last["parts_s"]


class _ReformingStage(StageCompute):
    """One stage (first and last) whose engine pass sees a re-form (a later generation): its
    micro-batch belongs to the old group and is dropped."""

    def __init__(self) -> None:
        self.rank = 0
        self.is_first = self.is_last = True
        self.loop_profile = LoopProfile(rank=0)
        self._generation = 1
        self._released = deque()
        self._loop = None
        stage = self

        class Engine:
            hidden_size = 4

            def prepare(self, chunks: object) -> object:
                return object()

            def execute(self, prepared: object, hidden_in: object) -> Any:
                time.sleep(0.01)
                stage._generation += 1  # the loop thread re-formed meanwhile
                return SimpleNamespace(hidden=None, last_token_logits={})

        class Core:
            def results(self, *args: object) -> list[Any]:
                return []

        self.engine = cast(Any, Engine())
        self.core = cast(Any, Core())

    def _after_microbatch(self, work: Any, done: Any) -> None:
        raise AssertionError("a dropped micro-batch publishes nothing")

    def _on_group_error(self, generation: int, exc: BaseException) -> None:
        raise AssertionError(exc)


def test_a_microbatch_dropped_by_a_re_form_adds_no_part_without_its_wall() -> None:
    stage = _ReformingStage()
    work = SimpleNamespace(num_tokens=2, error="", chunks=(), plan=None)
    work_queue: queue.Queue[Any] = queue.Queue()
    work_queue.put((work, None))
    stage._compute(None, work_queue, 1, deque())
    data = stage.loop_profile.to_json() if stage.loop_profile else {}
    assert data["microbatches"] == 0
    assert data["other_s"] >= 0, data  # wall = parts + other, other >= 0
    with pytest.raises(KeyError, match="not compute parts"):
        LoopProfile(rank=0).microbatch_done(1.0, {"plan_decode": 0.5})
