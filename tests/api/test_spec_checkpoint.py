"""A WavePipeline spec serving a Hugging Face checkpoint: ``model.path`` (or the PVC's mount
path) -> ``RuntimeConfig.model_dir``, the shape from config.json (a disagreeing field refused by
name), the layers split by cost without ``layerPartition``, the gateway's tokenizer from the
directory; ``wavepp validate`` and ``wavepp up --model`` on it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from wavepp import cli
from wavepp.api.spec import SpecError, check_spec
from wavepp.gateway.validation import BadRequest, parse_completion_batch, parse_prefill
from wavepp.launch.gateway import gateway_config_from_spec
from wavepp.launch.runtime_config import runtime_configs_from_spec, with_checkpoint_layers

pytest.importorskip("transformers")
from wavepp.bench.checkpoints import save_random_checkpoint  # noqa: E402
from wavepp.runtime.stage.engine.balance import checkpoint_partition  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
from up_support import build_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 DeepSeek-V3 layers (a dense first layer, then MoE: unequal costs), vocabulary 256."""
    out = tmp_path_factory.mktemp("ckpt") / "tiny-dsv3"
    save_random_checkpoint("deepseek_v3", out, num_layers=4, vocab_size=256)
    return out


def _spec(model: dict, **extra: object):
    raw = {"model": model, "stages": 3, "resources": {"gpusPerStage": 0}, **extra}
    spec, issues = check_spec(
        with_checkpoint_layers(raw), default_image="i", default_nats_url="nats://n:4222"
    )
    assert spec is not None, issues
    return spec


def test_model_path_becomes_model_dir_with_the_checkpoints_shape_split_by_cost(ckpt: Path) -> None:
    spec = _spec({"name": "tiny-dsv3", "path": str(ckpt)})
    assert spec.model.config.num_layers == 4  # read from config.json before the spec check
    assert spec.layer_partition is None  # resolved leaves the split to the processes
    (config,) = runtime_configs_from_spec(spec, pool="p")
    assert (config.model_dir, config.weights) == (str(ckpt), None)
    assert config.model.architecture == "deepseek_v3"
    assert (config.model.num_layers, config.model.vocab_size) == (4, 256)
    assert config.model.name == "tiny-dsv3"  # the served name is the spec's
    # split by active parameters (dense layer 0 is costlier; lm_head on the last stage),
    # not by count ([2, 1, 1])
    assert config.partition == checkpoint_partition(ckpt, 3) == [1, 2, 1]
    # the gateway agrees with the stages and has no tokenizer (none in the directory)
    gateway = gateway_config_from_spec(spec, {"pipeline": "p"})
    assert (gateway.vocab_size, gateway.model_name, gateway.tokenizer) == (256, "tiny-dsv3", None)
    # ... so a text prompt stays a 422 naming the field, token ids are served
    for parse, body, field in (
        (parse_prefill, {"tenant": "default", "text": "w1 w2"}, "text"),
        (parse_completion_batch, {"prompt": "w1 w2"}, "prompt"),
    ):
        with pytest.raises(BadRequest) as info:
            parse(body, gateway.limits, None)
        assert (info.value.status, info.value.field) == (422, field)
        assert "tokenizer.json" in str(info.value)
    assert parse_prefill({"tenant": "default", "token_ids": [1, 255]}, gateway.limits).token_ids


def test_a_stated_partition_and_the_pvc_mount_path(ckpt: Path) -> None:
    pvc = {"claimName": "w", "mountPath": str(ckpt)}
    spec = _spec({"name": "tiny-dsv3", "pvc": pvc}, layerPartition=[2, 1, 1])
    (config,) = runtime_configs_from_spec(spec, pool="p")
    assert config.model_dir == str(ckpt)
    assert config.partition == [2, 1, 1]


def test_the_checkpoints_tokenizer_is_the_gateways(ckpt: Path, tmp_path: Path) -> None:
    with_tokenizer = tmp_path / "with-tokenizer"
    shutil.copytree(ckpt, with_tokenizer)
    build_tokenizer(with_tokenizer)
    spec = _spec({"name": "tiny-dsv3", "path": str(with_tokenizer)})
    gateway = gateway_config_from_spec(spec, {"pipeline": "p"})
    assert gateway.tokenizer == str(with_tokenizer)


@pytest.mark.parametrize(
    ("model", "field", "text"),
    [
        ({"config": {"hiddenSize": 128}}, "model.config.hiddenSize", "128 disagrees"),
        ({"config": {"numLayers": 6}}, "model.config.numLayers", "6 disagrees"),
        ({"config": {"vocabSize": 512}}, "model.config.vocabSize", "gives 256"),
        ({"config": {"ropeTheta": 1.0}}, "model.config.ropeTheta", "1.0 disagrees"),
        # a preset name brings its layer count (tiny-llama: 8)
        ({"name": "tiny-llama"}, "model.config.numLayers", "preset 'tiny-llama'"),
    ],
)
def test_a_shape_that_disagrees_with_config_json_is_refused_by_field(
    ckpt: Path, model: dict, field: str, text: str
) -> None:
    raw = {"model": {"name": "tiny-dsv3", "path": str(ckpt), **model}, "stages": 2}
    spec, issues = check_spec(
        with_checkpoint_layers(raw), default_image="i", default_nats_url="nats://n:4222"
    )
    assert spec is not None, issues
    with pytest.raises(SpecError) as info:
        runtime_configs_from_spec(spec, pool="p")
    assert info.value.field == field and text in info.value.message, info.value


def test_a_path_without_config_json_is_refused_naming_the_field(ckpt: Path, tmp_path: Path) -> None:
    """Decision: model.path is always a checkpoint directory; bare Llama safetensors shaped by
    the spec (the old ``weights``) are refused, so no process guesses differently."""
    bare = tmp_path / "bare"
    bare.mkdir()
    for file in ckpt.glob("*.safetensors"):
        shutil.copy(file, bare)
    for path, text in ((bare, "has no config.json"), (tmp_path / "absent", "not a directory")):
        raw = {"model": {"name": "m", "path": str(path), "config": {"numLayers": 4}}, "stages": 2}
        spec, issues = check_spec(raw, default_image="i", default_nats_url="nats://n:4222")
        assert spec is not None, issues
        with pytest.raises(SpecError, match=text) as info:
            runtime_configs_from_spec(spec, pool="p")
        assert info.value.field == "model.path"
        with pytest.raises(SpecError, match=text):  # wavepp up / validate, before the check
            with_checkpoint_layers({"model": {"name": "m", "path": str(path)}, "stages": 2})


def test_the_operator_needs_the_layer_count_and_seed_is_refused(ckpt: Path) -> None:
    """The operator cannot read the volume: a checkpoint spec without numLayers (and no preset
    name) is refused there with the reason; engineOptions.seed seeds nothing with a checkpoint."""
    raw = {"model": {"name": "tiny-dsv3", "pvc": {"claimName": "w"}}, "stages": 2}
    spec, issues = check_spec(raw, default_image="i", default_nats_url="nats://n:4222")
    assert spec is None
    assert issues[0].field == "spec.model.config.numLayers"
    assert "operator cannot read the volume" in issues[0].message
    raw = {"model": {"name": "m", "path": str(ckpt)}, "stages": 2, "engineOptions": {"seed": 1}}
    spec, issues = check_spec(raw, default_image="i", default_nats_url="nats://n:4222")
    assert spec is None and issues[0].field == "spec.engineOptions.seed"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "wavepp.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def test_validate_reads_the_checkpoint(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"model": {"name": "tiny-dsv3", "path": str(ckpt)}, "stages": 3}))
    assert cli.main(["validate", str(good)]) == 0
    out = capsys.readouterr().out
    print(out)
    assert f"checkpoint {ckpt}: deepseek_v3, layers per stage [1, 2, 1]" in out
    bad = tmp_path / "bad.json"
    model = {"name": "m", "path": str(ckpt), "config": {"numLayers": 4, "hiddenSize": 128}}
    bad.write_text(json.dumps({"model": model, "stages": 2}))
    assert cli.main(["validate", str(bad)]) == 2
    assert "spec.model.config.hiddenSize: 128 disagrees" in capsys.readouterr().err


def test_validate_warns_what_the_operator_refuses(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A checkpoint spec without model.config.numLayers, which the operator's pods refuse (they
    cannot read the volume), gets a labelled warning line and exit 0 (``wavepp up`` serves it;
    docs/operator.md), not a bare ok."""
    spec = tmp_path / "tp.json"
    for model in (
        {"name": "dsv3", "path": str(ckpt)},
        {"name": "dsv3", "pvc": {"claimName": "w", "mountPath": str(ckpt)}},  # mounted here
    ):
        spec.write_text(json.dumps({"model": model, "stages": 2}))
        assert cli.main(["validate", str(spec)]) == 0
        captured = capsys.readouterr()
        err = captured.err.strip().splitlines()
        assert len(err) == 1 and "warning (Kubernetes)" in err[0], err
        assert "spec.model.config.numLayers" in err[0] and "numLayers: 4" in err[0]
        assert f"checkpoint {ckpt}: deepseek_v3" in captured.out
    model = {"name": "dsv3", "path": str(ckpt), "config": {"numLayers": 4}}
    spec.write_text(json.dumps({"model": model, "stages": 2}))
    assert cli.main(["validate", str(spec)]) == 0
    assert capsys.readouterr().err == ""


def test_up_model_without_config_json_is_one_line_naming_the_flag(tmp_path: Path) -> None:
    proc = _cli("up", "--model", str(tmp_path), "--stages", "2", "--port", "0")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"wavepp up: --model: {tmp_path}: model_dir={str(tmp_path)!r} has no config.json"
    ]
