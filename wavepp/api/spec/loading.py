"""Loading and checking a spec: from a file (``wavepp up --config``) or a raw object (the
operator), every problem named by its field path (:class:`SpecIssue`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from wavepp.api.spec.models import KIND, SpecError, WavePipelineSpec


class SpecIssue(BaseModel):
    """One problem found in a spec: ``field`` is the full path (``spec.stages``)."""

    model_config = ConfigDict(frozen=True)

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def load_spec_file(path: str | Path) -> WavePipelineSpec:
    """Read a spec from YAML or JSON: a bare spec, or a whole WavePipeline object.

    Args:
        path: file with either the ``spec`` mapping itself or ``{kind: WavePipeline, spec: ...}``
            (so ``examples/wavepipeline.yaml`` works as ``wavepp up --config``).

    Returns:
        The validated (not yet resolved) spec.

    Raises:
        ValueError: unreadable file, not a mapping, or an invalid spec (pydantic's
            ValidationError, a ValueError, names the fields).
    """
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"--config {path}: {exc}") from exc
    if isinstance(data, dict) and data.get("kind") == KIND:
        data = data.get("spec")
    if not isinstance(data, dict):
        raise ValueError(
            f"--config {path}: expected a mapping (a spec or a {KIND}), got {data!r:.80}"
        )
    return WavePipelineSpec.model_validate(data)


def _field_path(loc: tuple[int | str, ...]) -> str:
    path = "spec"
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}"
    return path


def check_spec(
    raw: Mapping[str, Any] | None,
    *,
    default_image: str | None = None,
    default_nats_url: str | None = None,
    default_otlp_endpoint: str | None = None,
) -> tuple[WavePipelineSpec | None, list[SpecIssue]]:
    """Validate and resolve a raw ``spec`` dict; never raises on bad input.

    Args:
        raw: the object's ``spec`` as read from the API (camelCase) or a config file.
        default_image, default_nats_url, default_otlp_endpoint: see
            :meth:`WavePipelineSpec.resolved`.

    Returns:
        ``(resolved spec, [])`` when valid, else ``(None, issues)``, each issue naming the field
        (``spec.layerPartition``) and what to change.
    """
    try:
        spec = WavePipelineSpec.model_validate(dict(raw or {}))
    except ValidationError as exc:
        issues = []
        for err in exc.errors():
            cause = (err.get("ctx") or {}).get("error")
            if isinstance(cause, SpecError):
                issues.append(SpecIssue(field=f"spec.{cause.field}", message=cause.message))
            else:
                issues.append(SpecIssue(field=_field_path(err["loc"]), message=err["msg"]))
        return None, issues
    try:
        resolved = spec.resolved(
            default_image=default_image,
            default_nats_url=default_nats_url,
            default_otlp_endpoint=default_otlp_endpoint,
        )
    except SpecError as exc:
        return None, [SpecIssue(field=f"spec.{exc.field}", message=exc.message)]
    return resolved, []
