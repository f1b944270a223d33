"""Emulated stage engine: cost-model time, activation shapes, same local preparation as torch."""

from __future__ import annotations

import time

import pytest
import torch

from wavepp.runtime.planning import CostModel
from wavepp.runtime.stage.engine import ChunkSpec, ModelConfig, make_engine
from wavepp.runtime.stage.engine.emulated import EmulatedStageEngine, fake_logits

pytestmark = pytest.mark.timeout(60)

MODEL = ModelConfig(num_layers=6)
# A tiny-model-like stage cost: 4 ms fixed, 40 us per new token, attention term.
COST = CostModel(c=4e-3, g=2e-6, b=4e-5, a=1e-8, label="derived", source="test")


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0
        self.sleeps_s: list[float] = []

    def clock(self) -> float:
        return self.now_s

    def sleep(self, seconds: float) -> None:
        self.sleeps_s.append(seconds)
        self.now_s += seconds


def emulated(first: int, last: int, **kw) -> EmulatedStageEngine:
    engine = make_engine(
        "emulated",
        model=MODEL,
        first_layer=first,
        last_layer=last,
        num_layers_total=MODEL.num_layers,
        cost_model=kw.pop("cost_model", COST),
        **kw,
    )
    assert isinstance(engine, EmulatedStageEngine)
    engine.allocate_kv(64, 16)
    return engine


def chunks_for(first_stage: bool) -> list[ChunkSpec]:
    tokens = {"a": tuple(range(100, 130)), "b": tuple(range(5, 25))}
    return [
        ChunkSpec("a", 200, 30, tuple(range(15)), tokens["a"] if first_stage else None, True),
        ChunkSpec("b", 0, 20, (40, 41), tokens["b"] if first_stage else None, False),
    ]


@pytest.mark.parametrize("time_scale", [1.0, 0.25])
def test_execute_takes_the_scaled_cost_fake_clock(time_scale: float) -> None:
    fake = FakeClock()
    engine = emulated(2, 4, time_scale=time_scale, clock=fake.clock, sleep=fake.sleep)
    prepared = engine.prepare(chunks_for(False))
    start_s = fake.now_s
    engine.execute(prepared, torch.zeros(50, 8))
    expected_s = time_scale * COST.microbatch_cost_s([(200, 30), (0, 20)])
    assert expected_s > 1e-3
    assert fake.now_s - start_s == pytest.approx(expected_s)
    assert engine.last_cost_s == pytest.approx(expected_s)


@pytest.mark.serial
def test_execute_sleeps_about_the_cost_in_real_time() -> None:
    engine = emulated(0, 2, time_scale=2.0)
    prepared = engine.prepare(chunks_for(True))
    target_s = 2.0 * COST.microbatch_cost_s([(200, 30), (0, 20)])
    start_s = time.perf_counter()
    engine.execute(prepared, None)
    elapsed_s = time.perf_counter() - start_s
    assert target_s - 1e-3 <= elapsed_s < target_s + 0.2


def test_pipeline_shapes_and_fake_logits() -> None:
    fake = FakeClock()
    stages = [
        emulated(first, last, clock=fake.clock, sleep=fake.sleep)
        for first, last in [(0, 2), (2, 4), (4, 6)]
    ]
    assert [(s.is_first, s.is_last) for s in stages] == [
        (True, False),
        (False, False),
        (False, True),
    ]
    prepared = [s.prepare(chunks_for(s.is_first)) for s in stages]
    hidden = None
    for stage, batch in zip(stages[:-1], prepared[:-1], strict=True):
        out = stage.execute(batch, hidden)
        assert out.hidden is not None
        assert out.hidden.shape == (50, 8) and out.hidden.dtype == torch.float32
        assert out.last_token_logits == {}
        hidden = out.hidden
    assert hidden is not None
    # first stage rows: [token_id, position, 0...], in chunk order
    assert hidden[:30, 0].tolist() == list(range(100, 130))
    assert hidden[:30, 1].tolist() == list(range(200, 230))
    assert hidden[30:, 0].tolist() == list(range(5, 25))
    assert hidden[30:, 1].tolist() == list(range(20))
    out = stages[-1].execute(prepared[-1], hidden)
    assert out.hidden is None
    assert set(out.last_token_logits) == {"a"}
    # last token of "a": id 129 at position 229
    assert torch.equal(out.last_token_logits["a"], fake_logits(129, 229, 16))
    assert int(out.last_token_logits["a"].argmax()) == (129 + 229) % 16
    assert len(fake.sleeps_s) == 3


def test_prepare_matches_the_torch_engine() -> None:
    torch_engine = make_engine(
        "torch", model=MODEL, first_layer=2, last_layer=4, num_layers_total=MODEL.num_layers
    )
    torch_engine.allocate_kv(64, 16)
    emu = emulated(2, 4)
    a = torch_engine.prepare(chunks_for(False))
    b = emu.prepare(chunks_for(False))
    for name in ("positions", "slot_mapping", "block_tables", "context_lens"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.logits_rows == b.logits_rows and a.row_starts == b.row_starts


def test_emulated_errors() -> None:
    with pytest.raises(ValueError, match="cost_model=None"):
        emulated(0, 2, cost_model=None)
    with pytest.raises(ValueError, match="time_scale=0"):
        emulated(0, 2, time_scale=0)
    with pytest.raises(ValueError, match="emulated_hidden_size=1"):
        emulated(0, 2, emulated_hidden_size=1)
    engine = emulated(2, 4)
    prepared = engine.prepare(chunks_for(False))
    with pytest.raises(ValueError, match=r"hidden_in has shape \(50, 128\)"):
        engine.execute(prepared, torch.zeros(50, 128))
    with pytest.raises(ValueError, match="block_ids"):
        engine.prepare([ChunkSpec("a", 0, 40, (1, 2), None, True)])


def test_host_loads_delay_execute_on_one_link_fake_clock() -> None:
    from wavepp.runtime.kv import Transfer

    fake = FakeClock()
    engine = emulated(
        0, 2, time_scale=0.5, host_load_s_per_block=0.01, clock=fake.clock, sleep=fake.sleep
    )
    engine.allocate_host_kv(8)
    # spills take no modelled time; 3 loads take 3 x 0.5 x 10 ms on the link from prepare
    engine.apply_transfers([Transfer("spill", 1, 0), Transfer("load", 2, 0)])
    engine.apply_transfers([Transfer("load", 3, 1), Transfer("load", 4, 2)])
    prepared = engine.prepare(chunks_for(True))
    assert engine.link_free_at_s == pytest.approx(100.0 + 0.015)
    assert engine.num_loaded_blocks == 3
    engine.execute(prepared, None)
    cost_s = 0.5 * engine.stage_cost_s(prepared)
    assert fake.now_s == pytest.approx(100.0 + 0.015 + cost_s)
    # a prepare after the link is free again: no wait
    engine.apply_transfers([Transfer("load", 5, 3)])
    prepared = engine.prepare(chunks_for(True))
    engine.execute(prepared, None)
    assert fake.now_s == pytest.approx(100.0 + 0.015 + cost_s + 0.005 + cost_s)
    with pytest.raises(ValueError, match=r"transfers\[0\]\.slot=8 is not in \[0, 8\)"):
        engine.apply_transfers([Transfer("load", 5, 8)])
