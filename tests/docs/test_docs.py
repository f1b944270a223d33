"""The curl commands of the README's tour and of docs/serving.md, and examples/up.yaml, run as
written."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from wavepp.api.spec import check_spec
from wavepp.launch.runtime_config import runtime_configs_from_spec

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("doc", ["README.md", "docs/serving.md"])
def test_documented_curl_runs_against_wavepp_up(up_service, doc: str) -> None:
    text = (REPO / doc).read_text()
    command = next(line for line in text.splitlines() if line.startswith("curl "))
    port = re.search(r":(\d+)$", up_service.endpoint).group(1)
    argv = [arg.replace("localhost:8000", f"localhost:{port}") for arg in shlex.split(command)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True).stdout
    answer = json.loads(out)
    assert answer["tenant"] == "default" and answer["num_prompt_tokens"] == 18
    assert isinstance(answer["first_token_id"], int)


def test_example_spec_is_valid_and_converts() -> None:
    raw = yaml.safe_load((REPO / "examples" / "up.yaml").read_text())
    spec, issues = check_spec(raw, default_image="local", default_nats_url="nats://x")
    assert issues == [] and spec is not None
    configs = runtime_configs_from_spec(spec, pool="default")
    assert [c.pipeline for c in configs] == ["default-r0", "default-r1"]
    assert {t.name: t.cache_salt for t in spec.tenants}["acme-batch"] == "acme"


def test_up_rejects_a_bad_spec_naming_the_field(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump({"model": {"name": "tiny-llama"}, "stages": 9}))
    proc = subprocess.run(
        [sys.executable, "-m", "wavepp.cli", "up", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "spec.stages" in proc.stderr and "--config" in proc.stderr


def test_readme_openai_snippet_runs_against_wavepp_up(
    up_service, capsys: pytest.CaptureFixture[str]
) -> None:
    readme = (REPO / "README.md").read_text()
    snippet = readme.split("```python\n", 1)[1].split("```", 1)[0]
    port = re.search(r":(\d+)$", up_service.endpoint).group(1)
    exec(snippet.replace("localhost:8000", f"localhost:{port}"), {})
    token_ids, cached = capsys.readouterr().out.rsplit("]", 1)
    assert len(json.loads(token_ids + "]")) == 1 and int(cached) >= 0
