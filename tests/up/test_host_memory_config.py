"""``cache.hostMemoryGiB`` (and ``--host-memory-gib`` on ``wavepp up`` and ``wavepp replay``)
becomes each stage's host tier in blocks and its load time per block, resolved in one place
(``launch.runtime_config`` -> ``launch.capacity.replica_capacity``) for presets, checkpoint
directories and emulated models; a bad amount is refused naming the field and the limit. No
process is started here."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from wavepp import cli
from wavepp.api.spec import MAX_HOST_MEMORY_GIB_PER_GPU, SpecError, check_spec
from wavepp.launch.capacity import host_tier_fields
from wavepp.launch.flags import FlagError
from wavepp.launch.replay import plan_replay
from wavepp.launch.runtime_config import runtime_configs_from_spec
from wavepp.launch.up import spec_mapping
from wavepp.runtime.planning.host_load import PCIE_GEN5_X16_BYTES_PER_S

TRACE = Path(__file__).resolve().parents[2] / "data" / "traces" / "conversation_trace.jsonl"
GIB = 2**30


def _configs(raw: dict) -> list:
    spec, issues = check_spec(raw, default_image="i", default_nats_url="nats://n:4222")
    assert spec is not None, issues
    return runtime_configs_from_spec(spec, pool="p")


def _issues(raw: dict) -> list[str]:
    spec, issues = check_spec(raw, default_image="i", default_nats_url="nats://n:4222")
    assert spec is None
    return [str(issue) for issue in issues]


CPU_TINY = {"model": {"name": "tiny-llama"}, "resources": {"gpusPerStage": 0}}


def test_a_preset_gets_host_blocks_from_its_kv_bytes_and_each_stages_layers() -> None:
    """tiny-llama on the CPU: float32, 2 KV heads x 32 dims, K and V: 512 bytes per token per
    layer; layers split 3 + 5, blocks of 16 tokens: 1 GiB holds 2^30 / (512 x 3 x 16) blocks on
    stage 0 and 2^30 / (512 x 5 x 16) on stage 1; loads at PCIe 5.0 x16."""
    (config,) = _configs(
        CPU_TINY | {"stages": 2, "layerPartition": [3, 5], "cache": {"hostMemoryGiB": 1}}
    )
    assert config.model.kv_bytes_per_token_per_layer() == 512
    assert config.num_host_kv_blocks == [GIB // (512 * 3 * 16), GIB // (512 * 5 * 16)]
    assert config.host_load_s_per_block == pytest.approx(
        [512 * 3 * 16 / PCIE_GEN5_X16_BYTES_PER_S, 512 * 5 * 16 / PCIE_GEN5_X16_BYTES_PER_S]
    )
    (off,) = _configs(CPU_TINY | {"stages": 2})
    assert off.num_host_kv_blocks == [0] and off.host_load_s_per_block == [0.0]


def test_a_checkpoint_directory_gets_host_blocks_from_its_config_json(tmp_path: Path) -> None:
    """The shape comes from config.json (no weights are read to size the tier): 6 layers of
    4 KV heads x 16 dims, split 2 + 4, float32 on the CPU, blocks of 8 tokens."""
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "vocab_size": 256,
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 6,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "head_dim": 16,
            }
        )
    )
    (config,) = _configs(
        {
            "model": {"name": "mine", "path": str(tmp_path), "config": {"numLayers": 6}},
            "stages": 2,
            "layerPartition": [2, 4],
            "resources": {"gpusPerStage": 0},
            "cache": {"hostMemoryGiB": 0.25, "blockSize": 8},
        }
    )
    per_layer = 2 * 4 * 16 * 4  # K and V x heads x dims x float32
    assert config.model.kv_bytes_per_token_per_layer() == per_layer
    assert config.num_host_kv_blocks == [
        GIB // 4 // (per_layer * 2 * 8),
        GIB // 4 // (per_layer * 4 * 8),
    ]


def test_an_emulated_h200_model_gets_the_simulators_host_tier() -> None:
    """The emulated engine's tier is sized as ``wavepp sim --host-memory-gib`` sizes it: the
    catalogue's KV bytes per token per GPU of GLM-5.2 at PP4."""
    (config,) = _configs(
        {
            "engine": "emulated",
            "model": {"name": "glm-5.2"},
            "stages": 4,
            "cache": {"hostMemoryGiB": 64, "blockSize": 512},
        }
    )
    fields, _ = host_tier_fields(
        "glm-5.2", 64, num_stages=4, block_size=512, max_microbatch_tokens=16384
    )
    assert config.num_host_kv_blocks == fields["num_host_kv_blocks"]
    assert config.host_load_s_per_block == fields["host_load_s_per_block"]
    assert min(config.num_host_kv_blocks) > 1000


@pytest.mark.parametrize(
    ("amount", "words"),
    [
        (MAX_HOST_MEMORY_GIB_PER_GPU + 1, f"less than or equal to {MAX_HOST_MEMORY_GIB_PER_GPU}"),
        (-1, "greater than or equal to 0"),
        ("lots", "valid number"),
    ],
)
def test_an_amount_out_of_range_is_refused_naming_the_field_and_the_limit(
    amount: object, words: str
) -> None:
    (issue,) = _issues(CPU_TINY | {"stages": 2, "cache": {"hostMemoryGiB": amount}})
    assert "spec.cache.hostMemoryGiB" in issue and words in issue, issue


def test_an_amount_that_holds_no_block_is_refused_with_the_least_that_would() -> None:
    spec, issues = check_spec(
        CPU_TINY | {"stages": 2, "layerPartition": [3, 5], "cache": {"hostMemoryGiB": 1e-9}},
        default_image="i",
        default_nats_url="nats://n:4222",
    )
    assert spec is not None, issues
    with pytest.raises(SpecError, match=r"holds no KV block of stage 1") as caught:
        runtime_configs_from_spec(spec, pool="p")
    assert caught.value.field == "cache.hostMemoryGiB"
    # the widest stage's block: 512 B x 5 layers x 16 tokens = 40960 B
    assert "give at least 3.81e-05 GiB" in str(caught.value)


def test_a_host_tier_with_tensor_parallelism_is_refused_by_the_spec_check() -> None:
    (issue,) = _issues(
        CPU_TINY | {"stages": 2, "tensorParallelSize": 2, "cache": {"hostMemoryGiB": 1}}
    )
    assert "spec.cache.hostMemoryGiB" in issue and "tensorParallelSize=2" in issue, issue


def _up_args(*argv: str) -> argparse.Namespace:
    return cli.build_parser(["up"]).parse_args(["up", *argv])


def test_up_flag_replaces_the_specs_host_memory_and_reaches_every_config(tmp_path: Path) -> None:
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(
        "model: {name: tiny-llama}\nstages: 2\nresources: {gpusPerStage: 0}\n"
        "cache: {hostMemoryGiB: 1, blockSize: 16}\n"
    )
    raw = spec_mapping(_up_args("--config", str(spec_file), "--host-memory-gib", "0.5"))
    assert raw["cache"] == {"hostMemoryGiB": 0.5, "blockSize": 16}
    (config,) = _configs(raw)
    assert config.num_host_kv_blocks == [GIB // 2 // (512 * 4 * 16)] * 2
    # 0 turns the spec's tier off
    (off,) = _configs(spec_mapping(_up_args("--config", str(spec_file), "--host-memory-gib", "0")))
    assert off.num_host_kv_blocks == [0]
    (issue,) = _issues(spec_mapping(_up_args("--host-memory-gib", "5000")))
    assert "spec.cache.hostMemoryGiB" in issue and "1024" in issue


def _replay_args(*argv: str) -> argparse.Namespace:
    return cli.build_parser(["replay"]).parse_args(["replay", str(TRACE), *argv])


def test_replay_flag_sizes_the_host_tier_and_refuses_a_bad_amount() -> None:
    plan = plan_replay(_replay_args("--stages", "2", "--host-memory-gib", "0.25"))
    # tiny-llama, the torch engine on the CPU: float32, 512 B per token per layer, 4 layers a stage
    assert plan.config.num_host_kv_blocks == [GIB // 4 // (512 * 4 * 16)] * 2
    assert plan.config.host_load_s_per_block[0] > 0
    assert "PCIe 5.0" in plan.capacity.host_source
    assert plan_replay(_replay_args("--stages", "2")).config.num_host_kv_blocks == [0]
    for bad, words in (("2048", r"must be in \[0, 1024\]"), ("1e-12", "holds no KV block")):
        with pytest.raises(FlagError, match=words) as caught:
            plan_replay(_replay_args("--stages", "2", "--host-memory-gib", bad))
        assert caught.value.flag == "--host-memory-gib"
