"""How a model's decoder layers are split into pipeline stages: the one rule.

Stage r holds a contiguous range ``[first, last)``; the ranges cover ``[0, num_layers)`` in
stage order. Given explicit counts, stage r holds ``counts[r]`` layers. Otherwise the split is
balanced: every stage holds ``num_layers // S`` layers and the first ``num_layers % S`` stages
one more (the last stage already carries the final norm and ``lm_head``).

The spec (``WavePipelineSpec.stage_layer_ranges``, raising ``SpecError`` on ``error.field``), the
runtime (``RuntimeConfig``, the engines) and the planner's catalogue call :func:`split_layers`.
Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence


class LayerSplitError(ValueError):
    """A stage count or layer counts that cannot split the model.

    Attributes:
        field: the spec field at fault: ``"stages"`` or ``"layerPartition"``.
        message: what is wrong and how to fix it (also the exception's text).
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


def split_layers(
    num_layers: int, num_stages: int, counts: Sequence[int] | None = None
) -> list[tuple[int, int]]:
    """Split ``num_layers`` decoder layers into ``num_stages`` contiguous ranges.

    Args:
        num_layers: decoder layers of the model (>= num_stages).
        num_stages: stages S (>= 1).
        counts: optional layers per stage (length S, each >= 1, summing to ``num_layers``);
            None: the balanced split.

    Returns:
        ``[(first, last), ...]`` of length S; stage r holds layers ``[first, last)``.

    Raises:
        LayerSplitError: S < 1 or S > num_layers (field ``stages``), or ``counts`` of the wrong
            length, with a count < 1 or the wrong sum (field ``layerPartition``).
    """
    if num_stages < 1:
        raise LayerSplitError("stages", f"stages={num_stages} must be >= 1")
    if num_stages > num_layers:
        raise LayerSplitError(
            "stages",
            f"stages={num_stages} exceeds the model's {num_layers} layers; every stage needs "
            f"at least one layer: use stages <= {num_layers}",
        )
    if counts is None:
        base, extra = divmod(num_layers, num_stages)
        sizes = [base + (1 if r < extra else 0) for r in range(num_stages)]
    else:
        sizes = [int(c) for c in counts]
        if len(sizes) != num_stages:
            raise LayerSplitError(
                "layerPartition",
                f"{sizes} has {len(sizes)} entries for stages={num_stages}; give one count per "
                "stage",
            )
        if any(c < 1 for c in sizes):
            raise LayerSplitError("layerPartition", f"{sizes}: every stage needs >= 1 layer")
        if sum(sizes) != num_layers:
            raise LayerSplitError(
                "layerPartition",
                f"{sizes} sums to {sum(sizes)} layers; the model has {num_layers}",
            )
    ranges: list[tuple[int, int]] = []
    first = 0
    for size in sizes:
        ranges.append((first, first + size))
        first += size
    return ranges
