"""What the docs and examples say agrees with what the spec and the code
do (an example's header names its autoscaling metric; docs/operator.md does not list as
missing what the operator does)."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
import yaml

from wavepp.operator.observe import DrainReason

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def _spec(path: Path) -> dict:
    body = yaml.safe_load(path.read_text())
    return body.get("spec", body)


# the examples that autoscale (the others have no metric to name)
SCALED = [path for path in EXAMPLES if _spec(path).get("autoscaling")]
# The words an example's header uses for each autoscaling metric.
METRIC_WORDS = {"backlog": "backlog", "cpu": "CPU"}


def _header(path: Path) -> str:
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("# "))
    return " ".join(lines)


@pytest.mark.parametrize("path", SCALED, ids=lambda p: p.name)
def test_an_examples_header_names_its_autoscaling_metric(path: Path) -> None:
    """An example's header says it is scaled on the metric it sets (e.g. not "scaled on CPU
    utilisation" over ``metric: backlog``), and names no other metric."""
    metric = _spec(path)["autoscaling"].get("metric", "backlog")
    header = _header(path)
    assert "scaled" in header, f"{path.name}: the header does not say how the pool is scaled"
    assert METRIC_WORDS[metric] in header, header
    for other, word in METRIC_WORDS.items():
        if other != metric:
            assert word not in header, f"{path.name}: header says {word!r}, metric is {metric}"


def test_operator_doc_does_not_list_the_scale_down_drain_as_missing() -> None:
    """docs/operator.md says a scale-down drains its extra replicas, as the operator does, and
    does not also list that drain as not there yet."""
    assert "scale-down" in typing.get_args(DrainReason)  # the operator drains on scale-down
    text = " ".join((REPO / "docs" / "operator.md").read_text().split())
    assert "extra replicas drain and are then deleted" in text
    assert "not drained first" not in text
