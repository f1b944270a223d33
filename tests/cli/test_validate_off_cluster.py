"""``wavepp validate`` off the cluster. A checkpoint on a PVC that is
not mounted here is not an error (its checks are skipped, in one line); a checkpoint spec the
operator refuses (no ``model.config.numLayers``) gets a labelled Kubernetes warning; a missing
key file names its field path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from wavepp import cli

REPO = Path(__file__).resolve().parents[2]


def _validate(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str], str]:
    rc = cli.main(["validate", str(path)])
    captured = capsys.readouterr()
    return rc, captured.err.strip().splitlines(), captured.out.strip()


def _gpu_example(tmp_path: Path, mount: Path) -> Path:
    """examples/wavepipeline-gpu.yaml with its PVC mounted at ``mount`` (the example's /models
    may exist on some machine; the test must not depend on that)."""
    body = yaml.safe_load((REPO / "examples" / "wavepipeline-gpu.yaml").read_text())
    body["spec"]["model"]["pvc"]["mountPath"] = str(mount)
    out = tmp_path / "gpu.yaml"
    out.write_text(yaml.safe_dump(body))
    return out


def test_a_pvc_not_mounted_here_skips_the_checkpoint_checks_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A PVC checkpoint not mounted here is a one-line note and exit 0, not ``spec.model.path:
    '/models' is not a directory here`` and exit 2 (the spec names a PVC, not a path)."""
    absent = tmp_path / "models"
    rc, err, out = _validate(_gpu_example(tmp_path, absent), capsys)
    assert rc == 0, err
    assert len(err) == 1 and "note: spec.model.pvc.mountPath" in err[0], err
    assert "skipped" in err[0] and str(absent) in err[0]
    assert "ok (2 replica(s) x 4 torch stages of small-llama, 2 tenant(s)" in out, out
    # the pods compute where their resources are, not where validate runs (a pod's command on
    # a CPU host meets "sees no CUDA device")
    assert "stage pods request 1 GPU(s) each (gpusPerStage; 0 runs them on CPUs)" in out, out


def test_everything_else_is_still_checked_with_an_absent_pvc(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _gpu_example(tmp_path, tmp_path / "models")
    body = yaml.safe_load(path.read_text())
    body["spec"]["layerPartition"] = [2, 2, 2, 1]  # small-llama has 8 layers
    path.write_text(yaml.safe_dump(body))
    rc, err, _ = _validate(path, capsys)
    assert rc == 2 and len(err) == 1 and "spec.layerPartition" in err[0], err
    body["spec"]["layerPartition"] = [2, 2, 2, 2]
    body["spec"]["model"] = {"name": "my-ckpt", "pvc": {"mountPath": str(tmp_path / "m")}}
    body["spec"]["model"]["pvc"]["claimName"] = "w"
    path.write_text(yaml.safe_dump(body))
    rc, err, _ = _validate(path, capsys)  # the operator's pods need the layer count
    assert rc == 2 and len(err) == 1 and "spec.model.config.numLayers" in err[0], err


def test_an_explicit_model_path_that_is_absent_stays_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "spec.json"
    model = {"name": "m", "path": str(tmp_path / "absent"), "config": {"numLayers": 4}}
    path.write_text(json.dumps({"model": model, "stages": 2}))
    rc, err, _ = _validate(path, capsys)
    assert rc == 2 and len(err) == 1 and "spec.model.path:" in err[0], err
    assert "not a directory here" in err[0]


def test_a_missing_key_file_names_its_field_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The error names the field path with its index (``spec.tenants[1].apiKeysFile``), not
    only ``apiKeysFile: tenant 'b': key file ...``."""
    assert cli.main(["api-key", "--append", str(tmp_path / "keys" / "a.keys")]) == 0
    capsys.readouterr()
    spec = {
        "model": {"name": "tiny-llama"},
        "stages": 2,
        "tenants": [
            {"name": "a", "apiKeysFile": "keys/a.keys"},
            {"name": "b", "apiKeysFile": "keys/b.keys"},
        ],
    }
    path = tmp_path / "up.yaml"
    path.write_text(yaml.safe_dump(spec))
    rc, err, _ = _validate(path, capsys)
    assert rc == 2 and len(err) == 1, err
    assert f"{path}: spec.tenants[1].apiKeysFile: tenant 'b': key file " in err[0], err
    assert "b.keys" in err[0]
