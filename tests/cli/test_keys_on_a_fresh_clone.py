"""On a fresh clone: the README's key commands and `wavepp validate` on
a spec whose key files are missing."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from wavepp import cli
from wavepp.gateway.auth import AuthError


def test_api_key_creates_the_key_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`wavepp api-key --append examples/keys/default.keys` creates the missing folder (git
    ignores examples/keys/, so a fresh clone lacks it)."""
    path = tmp_path / "keys" / "default.keys"
    assert cli.main(["api-key", "--append", str(path)]) == 0
    key = capsys.readouterr().out.strip()
    assert len(key) >= 32 and path.exists() and key not in path.read_text()


def test_validate_reads_the_key_files_as_up_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """validate refuses a spec whose apiKeysFile does not exist, as up does (not ok)."""
    spec = {
        "model": {"name": "tiny-llama"},
        "stages": 2,
        "tenants": [{"name": "a", "apiKeysFile": "keys/a.keys"}],
    }
    config = tmp_path / "pipeline.yaml"
    config.write_text(yaml.safe_dump(spec))
    assert cli.main(["validate", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "apiKeysFile" in err[0] and "a.keys" in err[0], err
    assert cli.main(["api-key", "--append", str(tmp_path / "keys" / "a.keys")]) == 0
    capsys.readouterr()
    assert cli.main(["validate", str(config)]) == 0


def test_auth_errors_have_the_documented_shape() -> None:
    body = AuthError(401, "missing", "no API key").to_json()["error"]
    assert body["param"] == body["field"] == "authorization" and body["type"]
