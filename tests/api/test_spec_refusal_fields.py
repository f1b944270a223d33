"""A spec the runtime refuses is one line naming the spec field it comes
from (``runtime_configs_from_spec`` -> ``RuntimeConfig``), not ``spec.engineOptions`` with a
pydantic dump; the emulated engine's TP refusal names the model, not a family it lacks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from wavepp import cli
from wavepp.api.spec import SpecError, check_spec
from wavepp.launch.runtime_config import (
    SPEC_FIELD_OF,
    runtime_config_spec_error,
    runtime_configs_from_spec,
)
from wavepp.runtime.config import RuntimeConfig


def _one_line(message: str) -> None:
    assert "\n" not in message and "errors.pydantic.dev" not in message, message
    assert "input_value" not in message and "validation error for" not in message, message


def test_kimi_linear_tp2_names_tensor_parallel_size(
    kimi: tuple[Path, object], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One line naming the spec field, not ``spec.engineOptions: 1 validation error for
    RuntimeConfig ...`` over several lines."""
    raw = {
        "model": {"name": "kimi", "path": str(kimi[0])},
        "stages": 1,
        "tensorParallelSize": 2,
        "resources": {"gpusPerStage": 0},
    }
    spec, issues = check_spec(
        {**raw, "model": {**raw["model"], "config": {"numLayers": 5}}},
        default_image="i",
        default_nats_url="nats://n:4222",
    )
    assert spec is not None, issues
    with pytest.raises(SpecError) as info:
        runtime_configs_from_spec(spec, pool="p")
    assert info.value.field == "tensorParallelSize", info.value
    assert "family 'kimi_linear'" in info.value.message
    _one_line(str(info.value))
    config = tmp_path / "kimi.json"
    config.write_text(json.dumps(raw))
    assert cli.main(["validate", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"wavepp validate: {config}: spec.tensorParallelSize: "), err
    _one_line(err)


def test_emulated_tp2_names_the_model() -> None:
    """``wavepp stage --config emu.yaml --tensor-parallel-size 2`` for glm-5.2 names the model,
    not a family it lacks (``... the emulated engine with family 'llama'``); the spec check
    refuses it earlier."""
    from wavepp.launch.flags import ArgError
    from wavepp.launch.replica import with_tensor_parallel

    config = RuntimeConfig(num_stages=2, engine="emulated", cost_model={})
    config = config.model_copy(
        update={"model": config.model.model_copy(update={"name": "glm-5.2"})}
    )
    with pytest.raises(ArgError) as info:
        with_tensor_parallel(config, 2)
    text = str(info.value)
    assert "emulated engine (model 'glm-5.2'" in text and "'llama'" not in text, text
    _one_line(text)


@pytest.mark.parametrize(
    ("fields", "spec_field"),
    [
        ({"lease_s": 0}, "engineOptions.leaseSeconds"),
        ({"max_blocks_per_owner": 0}, "engineOptions.maxBlocksPerOwner"),
        ({"num_kv_blocks": [1, 2, 3]}, "engineOptions.kvBlocks"),
        ({"torch_threads": 0}, "engineOptions.torchThreads"),
        ({"engine": "emulated"}, "engine"),
        ({"block_size": 64, "max_microbatch_tokens": 32}, "cache.blockSize"),
    ],
)
def test_each_refusal_maps_to_its_spec_field(fields: dict, spec_field: str) -> None:
    with pytest.raises(ValueError) as info:
        RuntimeConfig.model_validate({"num_stages": 2, **fields})
    error = runtime_config_spec_error(info.value)
    assert error.field == spec_field, error
    _one_line(str(error))


def test_the_map_names_real_fields() -> None:
    assert set(SPEC_FIELD_OF) <= set(RuntimeConfig.model_fields)
