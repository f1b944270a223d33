"""KV capacity per stage derived from the model and device (wavepp.runtime.planning.memory)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from trace_data import TRACE

from wavepp.api.spec import WavePipelineSpec
from wavepp.bench.trace import TokenMapper, load_trace
from wavepp.launch.runtime_config import runtime_configs_from_spec
from wavepp.runtime.agreement import AgreementController, AgreementRefused
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.planning.catalogue import H200, GPUSpec, LayerCost, ModelShape
from wavepp.runtime.planning.memory import (
    FIXED_KV_BLOCKS,
    default_kv_blocks,
    derived_stage_memory,
)
from wavepp.runtime.request import PromptRequest

ROOT = Path(__file__).resolve().parents[3]
# The engine's largest micro-batch: the scheduler's cap where the config has one.
LARGEST_MICROBATCH_TOKENS = max(RuntimeConfig().max_microbatch_tokens, 8192)


def _blocks(model: str | ModelShape, **kwargs: object) -> list[int]:
    """Each stage's derived KV capacity in blocks (``derived_stage_memory``'s num_blocks)."""
    return [stage.num_blocks for stage in derived_stage_memory(model, **kwargs)]  # type: ignore[arg-type]


TOY_GPU = GPUSpec("toy", peak_flops=1.0, hbm_bytes_per_s=1.0, memory_bytes=1000.0)


def _toy_model(weight_bytes: float, kv_bytes: list[float], num_kv_heads: int = 1) -> ModelShape:
    layers = tuple(
        LayerCost(
            kind="toy",
            linear_flops_per_token=1.0,
            other_flops_per_token=0.0,
            pair_flops=0.0,
            context_flops_per_token=0.0,
            kv_bytes_per_token=kv,
            num_params=1.0,
            weight_bytes=weight_bytes,
            num_kv_heads=num_kv_heads,
        )
        for kv in kv_bytes
    )
    return ModelShape(
        name="toy",
        hf_repo="(none)",
        layers=layers,
        num_embedding_params=1.0,
        lm_head_weight_bytes=50.0,
        attention_note="toy",
        default_gpu=TOY_GPU,
        activation_bytes_per_token=1.0,
    )


def test_toy_model_by_hand() -> None:
    # 1000 B x 0.9 = 900 usable. Stage 0: layers 0,1 (2 x 100) + embedding 50 = 250 B of
    # weights; stage 1: layers 2,3 + lm_head 50 = 250. Activations: 100 tokens x 1 B = 100.
    # KV left: 900 - 250 - 100 = 550 B. Stage 0: 2 + 2 B per token -> 16 B per 4-token block
    # -> floor(550 / 16) = 34 blocks; stage 1: 3 + 3 -> 24 B per block -> floor(550 / 24) = 22.
    stages = derived_stage_memory(
        _toy_model(100.0, [2.0, 2.0, 3.0, 3.0]),
        num_stages=2,
        block_size=4,
        max_microbatch_tokens=100,
    )
    assert [s.num_blocks for s in stages] == [34, 22]
    assert [s.layers for s in stages] == [(0, 2), (2, 4)]
    assert [s.num_gpus for s in stages] == [1, 1]
    assert stages[0].usable_bytes == pytest.approx(900.0)
    assert stages[0].weight_bytes == 250.0 and stages[0].activation_bytes == 100.0
    assert stages[1].kv_bytes == pytest.approx(550.0) and stages[1].num_kv_tokens == 88


def test_toy_model_needing_two_gpus_per_stage() -> None:
    # 2 x 500 + 50 = 1050 B per stage > 900: t = 2 -> 525 B of weights per GPU, 100 B of
    # activations, 275 B of KV. One KV head (MLA): each GPU holds the whole 4 B per token
    # -> floor(275 / 16) = 17 blocks. Two KV heads (GQA): 2 B per token per GPU -> 34 blocks.
    for heads, blocks in ((1, 17), (2, 34)):
        stages = derived_stage_memory(
            _toy_model(500.0, [2.0, 2.0, 2.0, 2.0], num_kv_heads=heads),
            num_stages=2,
            block_size=4,
            max_microbatch_tokens=100,
        )
        assert [s.num_gpus for s in stages] == [2, 2]
        assert [s.num_blocks for s in stages] == [blocks, blocks]
    with pytest.raises(
        ValueError, match=r"toy on 2 stages of 1 x toy does not fit.*needs 1\.15 kB per GPU"
    ):
        derived_stage_memory(
            _toy_model(500.0, [2.0] * 4),
            num_stages=2,
            block_size=4,
            max_microbatch_tokens=100,
            num_gpus_per_stage=1,
        )


def test_weights_that_fit_no_node_raise_naming_model_stages_and_memory() -> None:
    with pytest.raises(ValueError, match=r"kimi-k3 on 1 stages of 8 x H200 does not fit.*GB"):
        _blocks("kimi-k3", num_stages=1, block_size=16, max_microbatch_tokens=8192)
    with pytest.raises(
        ValueError, match=r"glm-5.2 on 4 stages of 1 x H200.*needs 199\.\d GB.*126\.9 GB is usable"
    ):
        _blocks(
            "glm-5.2",
            num_stages=4,
            block_size=16,
            max_microbatch_tokens=8192,
            num_gpus_per_stage=1,
        )
    with pytest.raises(ValueError, match="no memory_bytes"):
        _blocks("tiny-llama", num_stages=2, block_size=16, max_microbatch_tokens=64)


def _first_300_prompt_tokens() -> list[int]:
    records, invalid = load_trace(str(TRACE), 300)
    assert not invalid and len(records) == 300
    mapper = TokenMapper(512, 4096)  # the trace's own 512 tokens per hash id
    return [mapper.num_tokens(record) for record in records]


@pytest.mark.parametrize("model", ["glm-5.2", "minimax-m2.7"])
@pytest.mark.parametrize("num_stages", [4, 8])
@pytest.mark.parametrize("block_size", [16, 64])
def test_paper_settings_fit_the_trace_longest_prompt(
    model: str, num_stages: int, block_size: int
) -> None:
    stages = derived_stage_memory(
        model,
        num_stages=num_stages,
        block_size=block_size,
        max_microbatch_tokens=LARGEST_MICROBATCH_TOKENS,
    )
    assert len(stages) == num_stages and all(s.num_blocks > 0 for s in stages)
    # One H200 per stage wherever the weights fit one; GLM-5.2 at PP4 needs two.
    assert {s.num_gpus for s in stages} == {2 if (model, num_stages) == ("glm-5.2", 4) else 1}
    # About a million tokens or more per stage at H200 scale.
    assert min(s.num_kv_tokens for s in stages) > 900_000
    longest = max(_first_300_prompt_tokens())
    assert longest > FIXED_KV_BLOCKS * 16  # a fixed default could not hold it
    controller = AgreementController(
        [object()],  # type: ignore[list-item]  # check_fits calls no stage
        block_size=block_size,
        model_id="m",
        stage_capacities=[s.num_blocks for s in stages],
    )
    controller.check_fits(PromptRequest("longest", [0] * longest))
    too_long = max(s.num_blocks for s in stages) * block_size + 1
    with pytest.raises(AgreementRefused, match="needs"):
        controller.check_fits(PromptRequest("too-long", [0] * too_long))


def test_default_is_fixed_for_tiny_llama_and_derived_for_h200_models() -> None:
    blocks, source = default_kv_blocks(
        "tiny-llama", num_stages=3, block_size=16, max_microbatch_tokens=8192
    )
    assert blocks == [FIXED_KV_BLOCKS] * 3 and "fixed default 4096" in source
    blocks, source = default_kv_blocks(
        "minimax-m2.7", num_stages=4, block_size=64, max_microbatch_tokens=8192
    )
    assert blocks == _blocks(
        "minimax-m2.7", num_stages=4, block_size=64, max_microbatch_tokens=8192
    )
    assert source.startswith("derived: minimax-m2.7, 4 stages of 1 x H200 (141 GB x 0.9")
    assert H200.memory_bytes == 141e9


def test_more_activation_or_utilisation_moves_capacity_the_right_way() -> None:
    def blocks(**kwargs: float) -> int:
        base = {"num_stages": 8, "block_size": 16, "max_microbatch_tokens": 8192}
        return sum(_blocks("glm-5.2", **(base | kwargs)))  # type: ignore[arg-type]

    assert blocks(max_microbatch_tokens=16384) < blocks()
    assert blocks(memory_utilization=0.95) > blocks()
    assert blocks(block_size=64) == pytest.approx(blocks() / 4, rel=1e-3)


def test_spec_path_derives_for_emulated_and_keeps_explicit_and_torch_defaults() -> None:
    raw = {"model": {"name": "tiny-llama"}, "stages": 4, "engine": "emulated"}
    derived = _blocks(
        "glm-5.2", num_stages=4, block_size=16, max_microbatch_tokens=LARGEST_MICROBATCH_TOKENS
    )
    spec = WavePipelineSpec.model_validate(raw | {"engineOptions": {"emulate": "glm-5.2"}})
    assert runtime_configs_from_spec(spec, pool="p")[0].num_kv_blocks == derived
    spec = WavePipelineSpec.model_validate(
        raw | {"engineOptions": {"emulate": "glm-5.2", "kvBlocks": 256}}
    )
    assert runtime_configs_from_spec(spec, pool="p")[0].num_kv_blocks == [256]
    spec = WavePipelineSpec.model_validate(raw)  # emulates tiny-llama: fixed default
    assert runtime_configs_from_spec(spec, pool="p")[0].num_kv_blocks == [FIXED_KV_BLOCKS] * 4
    spec = WavePipelineSpec.model_validate(raw | {"engine": "torch"})
    assert runtime_configs_from_spec(spec, pool="p")[0].num_kv_blocks == [FIXED_KV_BLOCKS]


def test_sim_uses_the_derived_capacity_unless_given() -> None:
    def sim(*extra: str) -> dict:
        proc = subprocess.run(
            [sys.executable, "-m", "wavepp.cli", "sim", "--model", "minimax-m2.7"]
            + ["--stages", "4", "--concurrency", "4", "--requests", "8", "--json", *extra],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines = proc.stdout.strip().splitlines()
        assert len(lines) == 1, "with --json stdout holds the JSON only"
        return json.loads(lines[0])[0]

    derived = _blocks(
        "minimax-m2.7",
        num_stages=4,
        block_size=64,
        max_microbatch_tokens=LARGEST_MICROBATCH_TOKENS,
    )
    result = sim()
    assert result["kv_blocks_per_stage"] == derived
    assert result["kv_blocks_source"].startswith("derived: minimax-m2.7, 4 stages of 1 x H200")
    assert result["wave"]["failed"] == 0 and result["sync"]["failed"] == 0
    result = sim("--kv-blocks", "2048")
    assert result["kv_blocks_per_stage"] == [2048] * 4
    assert result["kv_blocks_source"] == "--kv-blocks"
