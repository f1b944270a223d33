"""The base of the spec models: :class:`WireModel` (camelCase wire); :class:`SpecError` (defined
in ``errors``) re-exported."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class WireModel(BaseModel):
    """Base of the spec and status models: camelCase on the wire, snake_case in Python, both
    accepted on input; unknown fields, infinities and NaN refused."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
        extra="forbid",
        allow_inf_nan=False,
    )
