"""Loading and checking a spec: from a file (``wavepp up --config``) or a raw object (the
operator), every problem named by its field path (:class:`SpecIssue`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from wavepp.api.spec.errors import SpecError
from wavepp.api.spec.models import KIND, WavePipelineSpec


class SpecIssue(BaseModel):
    """One problem found in a spec: ``field`` is the full path (``spec.stages``)."""

    model_config = ConfigDict(frozen=True)

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class SpecFileError(ValueError):
    """A spec file that cannot be used; ``str()`` is one line naming the file, the field (or the
    line and column of a YAML error) and what is wrong."""


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _yaml_error(exc: Exception) -> str:
    """One line for a YAML error: where (line, column) and the problem, not PyYAML's excerpt."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or exc
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return _one_line(f"{where}{problem}")


MAX_SPEC_FILE_BYTES = 1 << 20
MAX_SPEC_VALUES = 100_000


def _count_values(data: object, limit: int) -> int:
    """Values in ``data`` as a reader walks it (aliases counted each time they appear), counting
    stops just past ``limit``. Iterative: no recursion limit, and a YAML alias bomb (a few
    hundred bytes expanding to 10**8 values) is refused after ``limit`` steps."""
    count, stack = 0, [data]
    while stack and count <= limit:
        value = stack.pop()
        count += 1
        if isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return count


def read_spec_mapping(path: str | Path) -> dict[str, Any]:
    """The raw ``spec`` mapping of a YAML or JSON file (a bare spec or a whole WavePipeline).

    YAML is read with ``safe_load``: tags such as ``!!python/object`` are refused, never run.

    Raises:
        SpecFileError: unreadable file, a YAML/JSON syntax error or an unsafe tag (with line
            and column), or no mapping; one line.
    """
    import yaml

    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecFileError(f"{path}: cannot read: {_one_line(exc)}") from None
    if len(text) > MAX_SPEC_FILE_BYTES:
        raise SpecFileError(
            f"{path}: {len(text)} characters; a spec file holds at most {MAX_SPEC_FILE_BYTES}"
        )
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SpecFileError(f"{path}: not valid YAML/JSON: {_yaml_error(exc)}") from None
    except RecursionError:
        raise SpecFileError(f"{path}: nested too deeply to be a spec") from None
    num_values = _count_values(data, MAX_SPEC_VALUES)
    if num_values > MAX_SPEC_VALUES:
        raise SpecFileError(
            f"{path}: more than {MAX_SPEC_VALUES} values once YAML aliases are expanded; a spec "
            "holds far fewer (an alias bomb?)"
        )
    if isinstance(data, dict) and data.get("kind") == KIND:
        data = data.get("spec")
    if not isinstance(data, dict):
        raise SpecFileError(
            f"{path}: expected a mapping (a spec or a {KIND}), got {_one_line(repr(data)):.80}"
        )
    return data


def load_spec_file(path: str | Path) -> WavePipelineSpec:
    """Read and validate a spec from YAML or JSON: a bare spec, or a whole WavePipeline object.

    Args:
        path: file with either the ``spec`` mapping itself or ``{kind: WavePipeline, spec: ...}``
            (so ``examples/wavepipeline.yaml`` works as ``wavepp up --config``).

    Returns:
        The validated (not yet resolved) spec.

    Raises:
        SpecFileError: (a ValueError) unreadable file, YAML syntax error, unsafe tag, not a
            mapping, or an invalid spec (wrong type, non-finite number, past a bound); one
            line naming the file and every bad field (``spec.engineOptions.timeScale: ...``).
    """
    raw = read_spec_mapping(path)
    issues = spec_issues(raw)
    if issues:
        raise SpecFileError(f"{path}: " + "; ".join(str(i) for i in issues))
    return WavePipelineSpec.model_validate(raw)


def _field_path(loc: tuple[int | str, ...]) -> str:
    path = "spec"
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}"
    return path


def _non_finite(value: object, loc: tuple[int | str, ...] = ()) -> list[SpecIssue]:
    """Issues for every infinity or NaN anywhere in ``value`` (free-form fields included)."""
    if isinstance(value, float) and not math.isfinite(value):
        return [SpecIssue(field=_field_path(loc), message=f"{value}: must be a finite number")]
    if isinstance(value, Mapping):
        return [i for k, v in value.items() for i in _non_finite(v, (*loc, str(k)))]
    if isinstance(value, list):
        return [i for n, v in enumerate(value) for i in _non_finite(v, (*loc, n))]
    return []


def validation_issues(exc: ValidationError) -> list[SpecIssue]:
    """One :class:`SpecIssue` per pydantic error: the field path and the message, one line
    each, without pydantic's input dumps and links."""
    issues = []
    for err in exc.errors():
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, SpecError):
            issues.append(SpecIssue(field=f"spec.{cause.field}", message=_one_line(cause.message)))
        else:
            issues.append(SpecIssue(field=_field_path(err["loc"]), message=_one_line(err["msg"])))
    return issues


def spec_issues(raw: Mapping[str, Any]) -> list[SpecIssue]:
    """Every problem of a raw spec mapping (types, bounds, non-finite numbers, cross-field
    checks); empty when ``WavePipelineSpec.model_validate(raw)`` succeeds."""
    issues = _non_finite(dict(raw))
    if issues:
        return issues
    try:
        WavePipelineSpec.model_validate(dict(raw))
    except ValidationError as exc:
        return validation_issues(exc)
    return []


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
    issues = spec_issues(dict(raw or {}))
    if issues:
        return None, issues
    spec = WavePipelineSpec.model_validate(dict(raw or {}))
    try:
        resolved = spec.resolved(
            default_image=default_image,
            default_nats_url=default_nats_url,
            default_otlp_endpoint=default_otlp_endpoint,
        )
    except SpecError as exc:
        return None, [SpecIssue(field=f"spec.{exc.field}", message=_one_line(exc.message))]
    return resolved, []
