"""WavePipelineSpec: defaults, resolution, and validation that names the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from operator_support import REPO

from wavepp.api.spec import (
    EMULATED_MODELS,
    MODEL_CONFIG_EXTRA,
    MODEL_PRESET_NUM_LAYERS,
    SpecError,
    WavePipelineSpec,
    check_spec,
    load_spec_file,
)

BASE: dict[str, Any] = {"model": {"name": "tiny-llama"}, "stages": 4}
DEFAULTS = {"default_image": "img:1", "default_nats_url": "nats://n:4222"}


def test_resolved_fills_layers_partition_and_defaults() -> None:
    spec, issues = check_spec(BASE | {"stages": 3}, **DEFAULTS)
    assert issues == [] and spec is not None
    assert spec.layer_partition == [3, 3, 2]  # 8 layers: the first 8 % 3 stages get one more
    assert spec.stage_layer_ranges() == [(0, 3), (3, 6), (6, 8)]
    assert spec.model.config is not None and spec.model.config.num_layers == 8
    assert (spec.image, spec.nats.url) == ("img:1", "nats://n:4222")
    assert spec.gpus_per_stage() == 1  # tensorParallelSize
    wire = spec.to_wire()
    assert wire["layerPartition"] == [3, 3, 2] and wire["stages"] == 3
    # The resolved wire form is itself a valid spec (what `wavepp up --config` reads back).
    assert WavePipelineSpec.model_validate(wire) == spec


def test_spec_values_win_over_operator_defaults() -> None:
    raw = BASE | {"image": "mine:2", "nats": {"url": "nats://own:4222"}}
    spec, _ = check_spec(raw, **DEFAULTS)
    assert spec is not None and (spec.image, spec.nats.url) == ("mine:2", "nats://own:4222")


def test_pvc_mount_becomes_the_model_path() -> None:
    raw = BASE | {"model": {"name": "tiny-llama", "pvc": {"claimName": "weights"}}}
    spec, _ = check_spec(raw, **DEFAULTS)
    assert spec is not None and spec.model.path == "/models"


@pytest.mark.parametrize(
    ("patch", "field", "text"),
    [
        ({"stages": 0}, "spec.stages", "greater than or equal to 1"),
        ({"stages": 9}, "spec.stages", "exceeds the model's 8 layers"),
        ({"layerPartition": [2, 2, 2, 1]}, "spec.layerPartition", "sums to 7"),
        ({"layerPartition": [4, 4]}, "spec.layerPartition", "2 entries for stages=4"),
        ({"layerPartition": [0, 4, 2, 2]}, "spec.layerPartition[0]", "greater than or equal"),
        ({"engine": "vllm"}, "spec.engine", "'torch' or 'emulated'"),
        ({"engine": "tensorrt_llm"}, "spec.engine", "'torch' or 'emulated'"),
        (
            {"engine": "emulated", "engineOptions": {"emulate": "gpt-9"}},
            "spec.engineOptions.emulate",
            "'gpt-9' has no cost model",
        ),
        ({"engineOptions": {"device": "cuda"}}, "spec.engineOptions.device", "gpusPerStage"),
        ({"engineOptions": {"timeScale": 2}}, "spec.engineOptions.timeScale", "'emulated'"),
        (
            {"tensorParallelSize": 2, "engine": "emulated"},
            "spec.tensorParallelSize",
            "torch engine only",
        ),
        (
            {"tensorParallelSize": 2, "resources": {"gpusPerStage": 4}},
            "spec.resources.gpusPerStage",
            "one GPU per tensor-parallel process",
        ),
        (
            {
                "model": {"name": "tiny-llama", "dtype": "bfloat16"},
                "resources": {"gpusPerStage": 0},
            },
            "spec.model.dtype",
            "needs a GPU",
        ),
        (
            {"engine": "emulated", "model": {"name": "tiny-llama", "path": "/w"}},
            "spec.model.path",
            "loads no weights",
        ),
        (
            {"model": {"name": "tiny-llama", "config": {"ropeScaling": 2}}},
            "spec.model.config.ropeScaling",
            "not a model setting",
        ),
        (
            {"restartBudget": {"maxRestarts": 3, "windowSeconds": 600}},
            "spec.restartBudget.windowSeconds",
            "re-form forever",
        ),
        (
            {"autoscaling": {"maxReplicas": 2, "metric": "wave_fill", "target": 1}},
            "spec.autoscaling.metric",
            "'cpu'",
        ),
        ({"model": {"name": "my-llama"}}, "spec.model.config.numLayers", "not a preset"),
        ({"tenants": [{"name": "a"}, {"name": "a"}]}, "spec.tenants", "duplicate"),
        (
            {"autoscaling": {"minReplicas": 3, "maxReplicas": 2, "target": 0.8}},
            "spec.autoscaling.minReplicas",
            "> maxReplicas=2",
        ),
        (
            {"tensorParallelSize": 4, "resources": {"gpusPerStage": 2}},
            "spec.resources.gpusPerStage",
            "tensorParallelSize=4",
        ),
        ({"replicas": -1}, "spec.replicas", "greater than or equal to 0"),
        ({"stagez": 4}, "spec.stagez", "Extra inputs"),
    ],
)
def test_invalid_specs_name_the_field(patch: dict[str, Any], field: str, text: str) -> None:
    spec, issues = check_spec(BASE | patch, **DEFAULTS)
    assert spec is None
    assert any(i.field == field and text in i.message for i in issues), issues


def test_layer_count_from_config_overrides_the_preset() -> None:
    raw = BASE | {"model": {"name": "tiny-llama", "config": {"numLayers": 12}}, "stages": 6}
    spec, issues = check_spec(raw, **DEFAULTS)
    assert issues == [] and spec is not None and spec.layer_partition == [2] * 6


@pytest.mark.parametrize("raw", [None, {}, {"stages": "four"}, {"model": "tiny"}])
def test_check_spec_reports_instead_of_raising(raw: Any) -> None:
    spec, issues = check_spec(raw, **DEFAULTS)
    assert spec is None and issues


def test_missing_operator_defaults_are_reported() -> None:
    _, issues = check_spec(BASE)
    assert [i.field for i in issues] == ["spec.image"]
    _, issues = check_spec(BASE, default_image="img")
    assert [i.field for i in issues] == ["spec.nats.url"]


def test_resolved_raises_spec_error_with_field() -> None:
    spec = WavePipelineSpec.model_validate(BASE)
    with pytest.raises(SpecError) as info:
        spec.resolved(default_nats_url="nats://x")
    assert info.value.field == "image"


def test_presets_agree_with_the_runtime() -> None:
    from wavepp.runtime.model_config import PRESETS

    for name, config in PRESETS.items():
        assert MODEL_PRESET_NUM_LAYERS[name] == config.num_layers


def test_emulated_models_agree_with_the_runtime() -> None:
    from wavepp.runtime.planning.catalogue import list_models

    assert sorted(EMULATED_MODELS) == sorted(list_models())


def test_model_config_extra_keys_are_model_config_fields() -> None:
    from pydantic.alias_generators import to_snake

    from wavepp.runtime.model_config import ModelConfig

    assert {to_snake(k) for k in MODEL_CONFIG_EXTRA} <= set(ModelConfig.model_fields)


def test_example_is_a_valid_spec() -> None:
    body = yaml.safe_load((REPO / "examples" / "wavepipeline.yaml").read_text())
    spec, issues = check_spec(body["spec"], **DEFAULTS)
    assert issues == [] and spec is not None
    assert spec.num_stages == 4 and spec.num_replicas == 2 and spec.gpus_per_stage() == 0


def test_load_spec_file_reads_objects_and_bare_specs(tmp_path: Path) -> None:
    spec = load_spec_file(REPO / "examples" / "wavepipeline.yaml")
    assert spec.num_stages == 4 and spec.model.name == "tiny-llama"
    bare = tmp_path / "spec.json"
    bare.write_text(json.dumps(spec.to_wire()))
    assert load_spec_file(bare) == spec
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {name: tiny-llama}\nstages: 9\n")
    with pytest.raises(ValueError, match="exceeds the model's 8 layers"):
        load_spec_file(bad)
    with pytest.raises(ValueError, match="expected a mapping"):
        bad.write_text("- 1\n")
        load_spec_file(bad)
