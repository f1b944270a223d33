"""One owner for the engine's dense projections ``x W^T``: the weight, held as its kernel reads it.

On a CPU, a float32 weight is reordered once, at load, into oneDNN's blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, tuned for :data:`PACK_HINT_ROWS` rows) and every
call runs oneDNN's matrix product on it (``torch.ops.mkldnn._linear_pointwise``): the path
PyTorch's inductor takes for a frozen CPU linear layer of dynamic row count, and what vLLM's
CPU build does for its dense layers (a weight pre-packed for oneDNN), without re-packing the
weight on each call as ``F.linear`` does. Any row count works with one packed weight.

Everywhere else ``F.linear``: CUDA, dtypes other than float32 and bfloat16, a bfloat16 weight
the CPU's oneDNN cannot pack (it needs AVX-512 BF16 or AVX-NE-CONVERT), a torch without
oneDNN, or ``pack=False``. Both paths compute the same product; they differ by float32
rounding (the summation order), not by more.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Rows (tokens) oneDNN's weight layout is tuned for: one 512-token chunk; the layout serves any
# row count, the hint only picks the blocking.
PACK_HINT_ROWS = 512
_PACKABLE = (torch.float32, torch.bfloat16)


def _pack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed copy of ``weight`` [N, K], or None where oneDNN cannot take it."""
    if (
        weight.device.type != "cpu"
        or weight.dtype not in _PACKABLE
        or weight.dim() != 2
        or not torch.backends.mkldnn.is_available()
        or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    ):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_HINT_ROWS)
    except RuntimeError:  # e.g. bfloat16 on a CPU without the ISA oneDNN's bf16 path needs
        return None


class PackedLinear:
    """``y = x W^T`` for a weight ``W`` [out_features, in_features] (no bias).

    ``pack=True`` (the default) packs ``W`` for oneDNN where the module docstring says it
    can, and then keeps only the packed copy (the same bytes as ``W``); otherwise, or where
    it cannot, ``W`` is kept as given and calls are ``F.linear``. :attr:`packed` says which.
    """

    def __init__(self, weight: torch.Tensor, *, pack: bool = True) -> None:
        """Args:
            weight: [out_features, in_features], on the engine's device and dtype.
            pack: allow the packed CPU path.

        Raises:
            ValueError: ``weight`` is not 2-D.
        """
        if weight.dim() != 2:
            raise ValueError(f"a linear weight is 2-D [out, in]; got shape {tuple(weight.shape)}")
        self.in_features = int(weight.shape[1])
        self.dtype = weight.dtype
        self.device = weight.device
        self._packed = _pack(weight) if pack else None
        self._weight = None if self._packed is not None else weight

    @property
    def packed(self) -> bool:
        """True when calls run oneDNN on the packed weight."""
        return self._packed is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """[..., in_features] -> [..., out_features] in ``x``'s dtype (the weight's).

        Raises:
            ValueError: ``x``'s last dimension is not ``in_features``.
        """
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"input of shape {tuple(x.shape)}; this linear layer takes [..., "
                f"{self.in_features}]"
            )
        if self._packed is None:
            assert self._weight is not None
            return F.linear(x, self._weight)
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, None, "none", [], "")
