""":class:`SpecError`: a spec value that cannot work, with the field that holds it."""

from __future__ import annotations


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
