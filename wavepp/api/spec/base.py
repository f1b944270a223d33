"""The base of the spec models: :class:`SpecError` and :class:`WireModel` (camelCase wire)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class SpecError(ValueError):
    """A spec value that cannot work, with the field that holds it.

    Attributes:
        field: dotted camelCase path below ``spec`` (``layerPartition``, ``model.config.numLayers``).
        message: what is wrong and how to fix it.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"spec.{field}: {message}")
        self.field = field
        self.message = message


class WireModel(BaseModel):
    """Base of the spec and status models: camelCase on the wire, snake_case in Python, both
    accepted on input; unknown fields refused."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
        extra="forbid",
    )
