"""``--model DIR`` and ``RuntimeConfig.model_dir`` (``launch.runtime_config.with_checkpoint``): the config derived from config.json, the
stage/admission flag, the tensor-parallel refusal, and a replay on an MoE + MLA checkpoint."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
from trace_data import TRACE

from wavepp.api.spec import WavePipelineSpec
from wavepp.cmd.stage import add_arguments
from wavepp.launch.flags import ArgError
from wavepp.launch.replica import runtime_config_from_args
from wavepp.launch.runtime_config import with_checkpoint
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.hf_config import load_model_dir, model_config_from_hf
from wavepp.runtime.model_config import balanced_partition
from wavepp.runtime.stage.build import build_engine
from wavepp.runtime.stage.calibrate import measure_stage_costs
from wavepp.runtime.stage.engine.balance import (
    HEAD_PROMPT_TOKENS,
    checkpoint_partition,
    layer_active_params,
)

pytest.importorskip("transformers")
from wavepp.bench.checkpoints import save_random_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dsv3_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dsv3")
    save_random_checkpoint("deepseek_v3", out, num_layers=4, vocab_size=512)
    return out


def test_model_config_from_config_json(dsv3_dir: Path) -> None:
    model = load_model_dir(dsv3_dir)
    assert model.architecture == "deepseek_v3"
    assert (model.num_layers, model.hidden_size, model.vocab_size) == (4, 64, 512)
    assert model.num_heads == 4 and model.head_dim == 16 + 8
    assert model.name.startswith(dsv3_dir.name + "-")


@pytest.mark.parametrize(
    ("patch", "match"),
    [
        ({"model_type": "qwen3_next"}, "model_type='qwen3_next' is not supported"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn'"),
        ({"vocab_size": None}, "'vocab_size' is missing"),
    ],
)
def test_unsupported_config_json_is_refused_by_field(dsv3_dir: Path, patch, match) -> None:
    cfg = json.loads((dsv3_dir / "config.json").read_text()) | patch
    with pytest.raises(ValueError, match=match):
        model_config_from_hf(cfg, name="x")


def test_runtime_config_with_model_dir_builds_checkpoint_stages(dsv3_dir: Path) -> None:
    config = with_checkpoint(RuntimeConfig(num_stages=2), str(dsv3_dir))
    assert config.model_dir == str(dsv3_dir.resolve())
    assert config.model.architecture == "deepseek_v3"
    config = RuntimeConfig.model_validate(config.model_dump() | {"partition": [3, 1]})
    engines = [build_engine(config, rank) for rank in range(2)]
    assert [(e.first_layer, e.last_layer) for e in engines] == [(0, 3), (3, 4)]
    assert all(e.bytes_read > 0 for e in engines)  # type: ignore[attr-defined]


def test_non_llama_without_model_dir_and_model_dir_on_emulated_are_refused(
    dsv3_dir: Path,
) -> None:
    model = load_model_dir(dsv3_dir)
    with pytest.raises(ValueError, match="needs model_dir"):
        RuntimeConfig(model=model, num_stages=2)
    with pytest.raises(ValueError, match="read by the torch engine only"):
        RuntimeConfig(num_stages=2, engine="emulated", cost_model={}, model_dir=str(dsv3_dir))


def test_tensor_parallel_is_refused_where_not_implemented(tmp_path: Path) -> None:
    """TP > 1 runs the torch engine's llama, minimax_m2, deepseek_v3 and glm_moe_dsa; the
    emulated engine and kimi_linear refuse it naming the family and the field."""
    assert RuntimeConfig(num_stages=2, tensor_parallel_size=2).tensor_parallel_size == 2
    with pytest.raises(ValueError, match="tensor_parallel_size=2 .*--tensor-parallel-size"):
        RuntimeConfig(num_stages=2, tensor_parallel_size=2, engine="emulated", cost_model={})
    save_random_checkpoint("kimi_linear", tmp_path, num_layers=2, vocab_size=64)
    with pytest.raises(ValueError, match="family 'kimi_linear'"):
        with_checkpoint(RuntimeConfig(num_stages=2, tensor_parallel_size=2), str(tmp_path))
    with pytest.raises(ValueError, match="num_heads=4 is not divisible"):
        RuntimeConfig(num_stages=2, tensor_parallel_size=3)
    # The spec refuses it at validation (wavepp.api.spec.checks), naming the field.
    with pytest.raises(ValueError, match="tensorParallelSize"):
        WavePipelineSpec.model_validate(
            {"model": {"name": "tiny-llama"}, "stages": 2, "tensorParallelSize": 2,
             "engine": "emulated"}
        )  # fmt: skip


def test_weights_and_model_dir_together_are_refused(dsv3_dir: Path) -> None:
    """model_dir (a checkpoint with its config.json) and weights (Llama safetensors shaped by
    the config's model) are exclusive: both set is refused, neither silently ignored."""
    with pytest.raises(ValueError, match="set one"):
        RuntimeConfig(num_stages=2, weights="/w", model_dir=str(dsv3_dir))
    with pytest.raises(ValueError, match="set one"):
        with_checkpoint(RuntimeConfig(num_stages=2, weights="/w"), str(dsv3_dir))


def test_stage_flag_model_overrides_the_runtime_config(dsv3_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "rc.json"
    path.write_text(RuntimeConfig(num_stages=2).model_dump_json())
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--runtime-config", str(path), "--nats-url", "nats://x:4222", "--dist-url", "tcp://x:1"]
    args = parser.parse_args([*base, "--model", str(dsv3_dir)])
    config = runtime_config_from_args(args, {})
    assert config.model_dir == str(dsv3_dir.resolve())
    assert config.model.architecture == "deepseek_v3"
    assert config.partition == checkpoint_partition(dsv3_dir, 2)  # split by active parameters
    args = parser.parse_args([*base, "--model", str(tmp_path / "absent")])
    with pytest.raises(ArgError, match="--model .*absent.*not a directory"):
        runtime_config_from_args(args, {})


@pytest.mark.slow
def test_replay_on_an_moe_mla_checkpoint_reuses_cached_prefixes(dsv3_dir: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable, "-m", "wavepp.cli", "replay", str(TRACE), "--limit", "8",
            "--stages", "2", "--engine", "torch", "--model", str(dsv3_dir),
            "--tokens-per-block", "16", "--concurrency", "2", "--json",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["completed"] == 8 and summary["failed"] == 0
    assert summary["cached_tokens"] > 0
    assert summary["model"].startswith(dsv3_dir.name)


def test_balanced_partition_minimises_the_costliest_stage() -> None:
    assert balanced_partition([1, 1, 1, 1, 1, 1], 3) == [2, 2, 2]
    # A heavy dense first layer and a heavy lm_head pull the split inward.
    assert balanced_partition([4, 1, 1, 1, 1, 1, 1, 1], 3, last_extra=3) == [1, 5, 2]
    # Stages may only begin where allowed (GLM-5: at a 'full' indexer layer).
    allowed = [True, True, False, True, True, False]
    assert balanced_partition([1] * 6, 3, allowed_starts=allowed) == [1, 2, 3]
    with pytest.raises(ValueError, match="no split of 6 layers"):
        balanced_partition([1] * 6, 6, allowed_starts=allowed)
    with pytest.raises(ValueError, match="num_stages=7"):
        balanced_partition([1] * 6, 7)


def test_checkpoint_split_balances_active_parameters(dsv3_dir: Path, tmp_path: Path) -> None:
    costs, arch = layer_active_params(dsv3_dir)
    assert arch.moe is not None and not arch.is_moe(0) and arch.is_moe(1)
    # An MoE layer counts top_k / num_experts of its routed experts, its shared expert, the
    # router and its bias; a dense layer its MLP.
    expert = 3 * 64 * 32
    assert costs[1] - costs[2] == 0 and costs[0] != costs[1]
    assert costs[0] - costs[1] == 3 * 64 * 128 - (2 * expert + expert + 8 * 64 + 8)
    glm = tmp_path / "glm"
    save_random_checkpoint("glm_moe_dsa", glm, num_layers=6, vocab_size=512)
    # indexer_types: layers 2 and 5 are 'shared', so no stage begins there.
    split = checkpoint_partition(glm, 4)
    starts = [sum(split[:i]) for i in range(4)]
    assert not {2, 5} & set(starts) and sum(split) == 6


def test_lm_head_is_charged_for_one_row_per_prompt_not_per_token(tmp_path: Path) -> None:
    """The head computes the last prompt token's logits only: a head that outweighs seven
    decoder layers per token (vocab 4,096 x hidden 64) still leaves 8 equal layers split evenly,
    where a per-token charge would put 7 layers on the first of 2 stages."""
    save_random_checkpoint("llama", tmp_path, num_layers=8, vocab_size=4096)
    costs, plan = layer_active_params(tmp_path)
    assert len(set(costs)) == 1 and plan.vocab_size * plan.hidden_size > 7 * costs[0]
    assert checkpoint_partition(tmp_path, 2) == [4, 4]
    assert checkpoint_partition(tmp_path, 4) == [2, 2, 2, 2]
    head = plan.vocab_size * plan.hidden_size / HEAD_PROMPT_TOKENS
    assert balanced_partition(costs, 2, last_extra=head) == [4, 4]


def test_calibrate_measures_a_checkpoint_stage(dsv3_dir: Path, tmp_path: Path) -> None:
    model = load_model_dir(dsv3_dir)
    grid = [(0, 8), (16, 8), (16, 24)]
    samples = measure_stage_costs(
        model, num_layers=2, grid=grid, repeats=1, block_size=8, model_dir=str(dsv3_dir)
    )
    assert [(l_, x) for l_, x, _ in samples] == grid and all(s > 0 for _, _, s in samples)
    with pytest.raises(ValueError, match="num_layers=4: the checkpoint has 4 layers"):
        measure_stage_costs(model, num_layers=4, grid=grid, model_dir=str(dsv3_dir))
    kimi = tmp_path / "kimi"
    save_random_checkpoint("kimi_linear", kimi, num_layers=3, vocab_size=512)
    with pytest.raises(ValueError, match="kimi_linear \\(hybrid\\) cannot be calibrated"):
        measure_stage_costs(load_model_dir(kimi), num_layers=1, grid=grid, model_dir=str(kimi))


def test_kv_bytes_per_token_follow_the_cache_not_gqa(dsv3_dir: Path, tmp_path: Path) -> None:
    """MLA caches kv_lora_rank + qk_rope_head_dim = 24 fp32 values per token and layer."""
    assert load_model_dir(dsv3_dir).kv_bytes_per_token_per_layer() == 24 * 4
    cfg = json.loads((dsv3_dir / "config.json").read_text())
    glm = cfg | {
        "model_type": "glm_moe_dsa",
        "index_head_dim": 16,
        "indexer_types": ["full", "full", "shared", "full"],
    }
    assert model_config_from_hf(glm, name="g").kv_values_per_token_per_layer == 24 + 16 * 3 / 4
    kimi = cfg | {
        "model_type": "kimi_linear",
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    }
    assert model_config_from_hf(kimi, name="k").kv_values_per_token_per_layer == 24 / 4


def test_replay_emulates_a_checkpoint_and_refuses_an_absurd_derived_capacity(
    dsv3_dir: Path,
) -> None:
    """--emulate DIR derives the cost model from config.json; a tiny model at H200 derives
    tens of millions of blocks per stage, which replay refuses (naming --kv-blocks) instead of
    hanging on building the pool."""
    proc = subprocess.run(
        [
            sys.executable, "-m", "wavepp.cli", "replay", str(TRACE), "--limit", "2",
            "--stages", "2", "--engine", "emulated", "--emulate", str(dsv3_dir),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 2
    assert (
        "--kv-blocks: unset, and its default derives" in proc.stderr
        and "give --kv-blocks" in proc.stderr
    )
    assert dsv3_dir.name in proc.stderr  # the derivation names the checkpoint's model
