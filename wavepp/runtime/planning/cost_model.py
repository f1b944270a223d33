"""The prefill cost model t(L, x) and its least-squares fit.

Cost model, per stage, for a chunk of x new tokens over L cached context tokens (docs/design.md
'Cost model')::

    t(L, x) = c + g*L + b*x + a*(2*L*x + x^2)      seconds

c is paid once per micro-batch per stage (weight reads, launches); the other terms once per chunk.
a*(2*L*x + x^2) is the causal attention term: the chunk has P = x*L + x*(x+1)/2 (query, key)
pairs, and 2*P = 2*L*x + x^2 + x, so a is half the cost of one pair (the +x is folded into b).
Pure: no I/O, no torch.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

_COEFFICIENTS = ("c", "g", "b", "a")


_LABELS = ("measured", "derived")


_MAX_ROOT_FIXUPS = 64


@dataclass(frozen=True)
class CostModel:
    """Per-stage prefill cost t(L, x) = c + g*L + b*x + a*(2*L*x + x^2) seconds.

    Source: docs/design.md 'Cost model'. L = cached context tokens before the chunk, x = new tokens.

    Attributes:
        c: fixed cost per micro-batch per stage, seconds (weight reads, kernel launches).
        g: cost per context token per chunk, s/token (reading the cached KV of L tokens).
        b: cost per new token, s/token (linear layers: projections, MLP/MoE).
        a: attention cost, s/token^2 (half of one causal (query, key) pair).
        label: "measured" (fitted from timings, `fit_cost_model`) or "derived" (FLOPs and bytes
            at a stated roofline, `wavepp.runtime.planning.catalogue`).
        source: where the numbers come from, e.g. "wavepp calibrate 2026-11-30, CPU" or
            "derived: glm-5.2 layers [0,20) @ H200 ...".

    Raises:
        ValueError: a coefficient is negative or not finite, or label is unknown.
    """

    c: float
    g: float
    b: float
    a: float
    label: str = "measured"
    source: str = ""

    def __post_init__(self) -> None:
        for name in _COEFFICIENTS:
            value = getattr(self, name)
            if isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise ValueError(
                    f"CostModel.{name}={value!r}: coefficients must be finite and >= 0"
                )
        if self.label not in _LABELS:
            raise ValueError(f"CostModel.label={self.label!r}: must be one of {_LABELS}")

    def chunk_cost_s(self, num_context_tokens: int, num_new_tokens: int) -> float:
        """Cost of one chunk without the per-micro-batch overhead c.

        Args:
            num_context_tokens: L, tokens already cached before the chunk (>= 0).
            num_new_tokens: x, tokens computed by the chunk (>= 0).

        Returns:
            g*L + b*x + a*(2*L*x + x^2), seconds.

        Raises:
            ValueError: a token count is negative.
        """
        check_non_negative("num_context_tokens", num_context_tokens)
        check_non_negative("num_new_tokens", num_new_tokens)
        context, new = float(num_context_tokens), float(num_new_tokens)
        return self.g * context + self.b * new + self.a * (2.0 * context * new + new * new)

    def microbatch_cost_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        """Cost of one micro-batch on this stage: c + sum of the chunk costs.

        Args:
            chunks: (L, x) pairs, one per chunk: context tokens and new tokens.

        Returns:
            Seconds; 0.0 for an empty micro-batch (nothing runs, so c is not paid).

        Raises:
            ValueError: a token count is negative.
        """
        if not chunks:
            return 0.0
        return self.c + sum(self.chunk_cost_s(ctx, new) for ctx, new in chunks)

    def max_new_tokens_within(
        self,
        num_context_tokens: int,
        budget_s: float,
        *,
        num_tokens_cap: int | None = None,
    ) -> int:
        """Largest x >= 0 with chunk_cost_s(L, x) <= budget_s.

        Solves a*x^2 + (b + 2*a*L)*x + (g*L - budget_s) <= 0 for its positive root (the
        cancellation-free form -2C / (B + sqrt(B^2 - 4AC)), valid for a = 0 too), floors it, and
        corrects by +-1 against chunk_cost_s itself, so the answer is exact for the float costs
        this class computes.

        Args:
            num_context_tokens: L (>= 0).
            budget_s: seconds available for the chunk (without c); may be negative.
            num_tokens_cap: if given, the answer is at most this many tokens (>= 0).

        Returns:
            x in tokens; 0 when even g*L exceeds the budget.

        Raises:
            ValueError: L or the cap is negative, budget_s is NaN, or the answer is unbounded
                (a = b = 0 and no cap).
        """
        check_non_negative("num_context_tokens", num_context_tokens)
        if math.isnan(budget_s):
            raise ValueError("budget_s=nan: must be a number of seconds")
        if num_tokens_cap is not None:
            check_non_negative("num_tokens_cap", num_tokens_cap)
        if self.chunk_cost_s(num_context_tokens, 0) > budget_s:
            return 0
        quad = self.a
        lin = self.b + 2.0 * self.a * num_context_tokens
        const = self.g * num_context_tokens - budget_s  # <= 0 here
        if quad == 0.0 and lin == 0.0:
            if num_tokens_cap is None:
                raise ValueError(
                    "max_new_tokens_within: a = b = 0, so any number of tokens fits; "
                    "pass num_tokens_cap"
                )
            return num_tokens_cap
        if math.isinf(budget_s):
            if num_tokens_cap is None:
                raise ValueError("budget_s=inf: unbounded; pass num_tokens_cap")
            return num_tokens_cap
        denominator = lin + math.sqrt(lin * lin - 4.0 * quad * const)
        root = 0.0 if const == 0.0 else -2.0 * const / denominator
        num_tokens = int(math.floor(root))
        if num_tokens_cap is not None:
            num_tokens = min(num_tokens, num_tokens_cap)
        # The root is within a token or two of the answer; the bounded loops fix float rounding.
        for _ in range(_MAX_ROOT_FIXUPS):
            if num_tokens == 0 or self.chunk_cost_s(num_context_tokens, num_tokens) <= budget_s:
                break
            num_tokens -= 1
        for _ in range(_MAX_ROOT_FIXUPS):
            if num_tokens_cap is not None and num_tokens >= num_tokens_cap:
                break
            if self.chunk_cost_s(num_context_tokens, num_tokens + 1) > budget_s:
                break
            num_tokens += 1
        return num_tokens

    def scaled(self, factor: float) -> CostModel:
        """This model with every coefficient multiplied by factor (a slower or faster device).

        Args:
            factor: multiplier, > 0 and finite.

        Returns:
            A new CostModel; label kept, source annotated with the factor.

        Raises:
            ValueError: factor is not a positive finite number.
        """
        if not math.isfinite(factor) or factor <= 0:
            raise ValueError(f"factor={factor!r}: must be finite and > 0")
        source = f"{self.source} (scaled x{factor:g})" if self.source else f"scaled x{factor:g}"
        return replace(
            self,
            c=self.c * factor,
            g=self.g * factor,
            b=self.b * factor,
            a=self.a * factor,
            source=source,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict: keys c, g, b, a (floats), label, source (strings)."""
        return {
            "c": self.c,
            "g": self.g,
            "b": self.b,
            "a": self.a,
            "label": self.label,
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CostModel:
        """Inverse of to_dict.

        Raises:
            ValueError: a coefficient key is missing, a key is unknown, or a value is invalid.
        """
        known = set(_COEFFICIENTS) | {"label", "source"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"CostModel.from_dict: unknown keys {unknown}; known: {sorted(known)}")
        missing = [name for name in _COEFFICIENTS if name not in data]
        if missing:
            raise ValueError(f"CostModel.from_dict: missing coefficients {missing}")
        return cls(
            c=float(data["c"]),
            g=float(data["g"]),
            b=float(data["b"]),
            a=float(data["a"]),
            label=str(data.get("label", "measured")),
            source=str(data.get("source", "")),
        )


def fit_cost_model(
    samples: Sequence[tuple[int, int, float]],
    *,
    label: str = "measured",
    source: str = "",
) -> tuple[CostModel, float]:
    """Fit c, g, b, a >= 0 to measured stage timings.

    Minimises the sum of squared *relative* residuals, sum(((t(L, x) - t_meas) / t_meas)^2), so
    short and long chunks weigh alike (timing noise is roughly proportional to the time). The
    non-negative least squares problem has only 4 columns, so it is solved exactly by trying
    every support set: numpy.linalg.lstsq on each subset of columns (columns scaled to unit norm
    for conditioning), keeping the best solution whose coefficients are all >= 0. The NNLS
    optimum is the unconstrained optimum on its own support, so this finds it.

    Args:
        samples: (L, x, seconds) triples: context tokens, new tokens, measured seconds of one
            micro-batch holding that single chunk on one stage. At least 4.
        label: label of the returned model.
        source: source string of the returned model.

    Returns:
        (model, relative RMS fit error), the error being sqrt(mean(((pred - meas) / meas)^2)),
        dimensionless (0.05 = 5 %).

    Raises:
        ValueError: fewer than 4 samples, a negative token count, or a time that is not a
            positive finite number.
    """
    if len(samples) < len(_COEFFICIENTS):
        raise ValueError(f"fit_cost_model: {len(samples)} samples; need at least 4")
    rows = []
    times = []
    for index, sample in enumerate(samples):
        if len(sample) != 3:
            raise ValueError(f"samples[{index}]={sample!r}: expected (L, x, seconds)")
        context, new, seconds = sample
        check_non_negative(f"samples[{index}] L", context)
        check_non_negative(f"samples[{index}] x", new)
        if not math.isfinite(seconds) or seconds <= 0:
            raise ValueError(f"samples[{index}] seconds={seconds!r}: must be finite and > 0")
        rows.append((1.0, float(context), float(new), 2.0 * context * new + float(new) ** 2))
        times.append(float(seconds))
    design = np.asarray(rows, dtype=np.float64)
    measured = np.asarray(times, dtype=np.float64)
    weighted = design / measured[:, None]  # relative residuals: rows divided by the target
    target = np.ones_like(measured)
    best_coef = np.zeros(len(_COEFFICIENTS))
    best_residual = float(target @ target)  # the empty support: all coefficients 0
    for size in range(1, len(_COEFFICIENTS) + 1):
        for support in itertools.combinations(range(len(_COEFFICIENTS)), size):
            columns = weighted[:, support]
            norms = np.linalg.norm(columns, axis=0)
            if np.any(norms == 0):
                continue  # a column of zeros (e.g. L = 0 everywhere) cannot be fitted
            scaled_coef, *_ = np.linalg.lstsq(columns / norms, target, rcond=None)
            coef_on_support = scaled_coef / norms
            if np.any(coef_on_support < 0):
                continue
            residual_vec = columns @ coef_on_support - target
            residual = float(residual_vec @ residual_vec)
            if residual < best_residual:
                best_residual = residual
                best_coef = np.zeros(len(_COEFFICIENTS))
                best_coef[list(support)] = coef_on_support
    model = CostModel(
        c=float(best_coef[0]),
        g=float(best_coef[1]),
        b=float(best_coef[2]),
        a=float(best_coef[3]),
        label=label,
        source=source,
    )
    relative = (design @ best_coef - measured) / measured
    return model, float(np.sqrt(np.mean(relative**2)))


def check_non_negative(name: str, value: int) -> None:
    if value < 0:
        raise ValueError(f"{name}={value}: must be >= 0")
