"""The generated CRD: no drift from the models, a structural schema, examples validate."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from operator_support import REPO, kubernetes_validate

from wavepp.api.spec import check_spec
from wavepp.operator import crdgen

CRD = crdgen.build_crd()
VERSION = CRD["spec"]["versions"][0]
SCHEMA = VERSION["schema"]["openAPIV3Schema"]


def _custom_resources(path: Path) -> list[dict[str, Any]]:
    docs = yaml.safe_load_all(path.read_text())
    return [d for d in docs if isinstance(d, dict) and d.get("kind") == "WavePipeline"]


EXAMPLES = [p for p in sorted((REPO / "examples").glob("*.y*ml")) if _custom_resources(p)]


def test_checked_in_crds_match_the_models() -> None:
    """Fails when wavepp/api/spec/ changed and `python -m wavepp.operator.crdgen` was not run."""
    text = crdgen.render_crd()
    for path in crdgen.CRD_PATHS:
        assert path.read_text() == text, f"{path} is stale: run python -m wavepp.operator.crdgen"
    assert crdgen.main(["--check"]) == 0


def test_crd_passes_kubernetes_validate(tmp_path: Path) -> None:
    rc, output = kubernetes_validate([CRD], tmp_path)
    assert rc == 0, output


def _walk(node: Any, path: str = "") -> Any:
    if isinstance(node, dict):
        yield path, node
        for key, value in node.get("properties", {}).items():
            yield from _walk(value, f"{path}.{key}")
        if "items" in node:
            yield from _walk(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            yield from _walk(node["additionalProperties"], f"{path}{{}}")


def test_schema_is_structural() -> None:
    """The rules of a structural schema (apiextensions v1): typed nodes, no refs or unions."""
    for path, node in _walk(SCHEMA):
        assert "type" in node or node.get("x-kubernetes-int-or-string"), path
        for banned in ("$ref", "anyOf", "oneOf", "allOf", "title", "const", "$defs"):
            assert banned not in node, f"{path}: {banned}"
        if "properties" in node:
            assert "additionalProperties" not in node, path
        for bound in ("exclusiveMinimum", "exclusiveMaximum"):
            assert isinstance(node.get(bound, True), bool), path
        if "default" in node:
            jsonschema.Draft4Validator(_openapi_to_jsonschema(node)).validate(node["default"])


def test_subresources_and_printer_columns() -> None:
    assert VERSION["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    assert VERSION["subresources"]["status"] == {}
    columns = {c["name"]: c for c in VERSION["additionalPrinterColumns"]}
    assert list(columns) == ["Stages", "Ready", "Replicas", "Phase", "Age"]
    assert columns["Age"]["jsonPath"] == ".metadata.creationTimestamp"
    # Every column and scale path points at a field the schema declares, with the same type.
    paths = [(c["jsonPath"], c["type"]) for c in columns.values() if c["name"] != "Age"]
    paths += [(".spec.replicas", "integer"), (".status.replicas", "integer")]
    paths += [(".status.selector", "string")]
    for path, type_ in paths:
        node = SCHEMA
        for part in path.strip(".").split("."):
            node = node["properties"][part]
        assert node["type"] == type_, path


def _openapi_to_jsonschema(node: Any) -> Any:
    """OpenAPI v3.0 -> JSON Schema draft 4 (its base): ``nullable`` becomes a type list."""
    if isinstance(node, list):
        return [_openapi_to_jsonschema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _openapi_to_jsonschema(v) for k, v in node.items() if not k.startswith("x-")}
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
    if node.get("x-kubernetes-preserve-unknown-fields"):
        out.setdefault("additionalProperties", True)
    elif out.get("type") == "object" and "properties" in out:
        out["additionalProperties"] = False  # what the API server prunes, we reject
    return out


VALIDATOR = jsonschema.Draft4Validator(_openapi_to_jsonschema(SCHEMA))  # OpenAPI 3.0 base


def test_the_examples_are_found() -> None:
    assert {p.name for p in EXAMPLES} >= {"wavepipeline.yaml", "wavepipeline-gpu.yaml"}


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_pass_the_crd_schema_and_the_operator(path: Path) -> None:
    for doc in _custom_resources(path):
        errors = [e.message for e in VALIDATOR.iter_errors(doc)]
        assert errors == [], errors
        spec, issues = check_spec(doc["spec"], default_image="i", default_nats_url="nats://n")
        assert issues == [], issues


@pytest.mark.parametrize(
    ("patch", "text"),
    [
        ({"stages": 0}, "less than the minimum"),
        ({"engine": "vllm"}, "is not one of"),
        ({"layerPartition": [2, 0]}, "less than the minimum"),
        ({"model": {"dtype": "fp4"}}, "'name' is a required property"),
        ({"replicas": "two"}, "is not of type"),
    ],
)
def test_schema_rejects_what_it_can(patch: dict[str, Any], text: str) -> None:
    doc = yaml.safe_load((REPO / "examples" / "wavepipeline.yaml").read_text())
    doc = copy.deepcopy(doc)
    doc["spec"].update(patch)
    errors = [e.message for e in VALIDATOR.iter_errors(doc)]
    assert any(text in e for e in errors), errors


def test_cel_rules_cover_partition_length_and_autoscaling_bounds() -> None:
    spec = SCHEMA["properties"]["spec"]
    rules = {r["fieldPath"]: r["rule"] for r in spec["x-kubernetes-validations"]}
    assert "size(self.layerPartition) == self.stages" in rules[".layerPartition"]
    auto = spec["properties"]["autoscaling"]["x-kubernetes-validations"]
    assert [r["rule"] for r in auto] == ["self.minReplicas <= self.maxReplicas"]


def test_yaml_files_pass_yamllint() -> None:
    paths = [REPO / "examples", REPO / "crds", REPO / "charts" / "wavepp" / "crds"]
    paths += [REPO / "charts" / "wavepp" / "values.yaml", REPO / "charts" / "wavepp" / "Chart.yaml"]
    config = (
        "{extends: default, rules: {line-length: {max: 100}, document-start: disable, "
        "indentation: {indent-sequences: whatever}, comments: {min-spaces-from-content: 1}}}"
    )
    exe = Path(sys.executable).parent / "yamllint"
    result = subprocess.run(
        [str(exe), "-f", "parsable", "-d", config, *map(str, paths)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
