"""The SGLang anchor: Kimi K3 prefill capacity of PP8 x TP1 against TEP8 on 8K-token prompts.

Capacity = the physical bound (``planning.bound.pipeline_bound``) of a closed loop at a large
concurrency on fresh 8K prompts (no reuse), for each layout's derived stage cost models
(``planning.parallel``): PP8 with micro-batches of up to 16,384 tokens (the runtime's cap),
TEP8 with the engine's 8,192-token chunks. Prints the inputs, the ratio, the TEP8 time per
token by term (compute, collectives, weights), and the values of the terms that would put the
ratio at 1.45 and 1.72: the expert-parallel load imbalance (``ep_imbalance``), and the
all-reduce bus bandwidth. Kimi K3's weights do not fit 8 H200s (1.56 TB > 8 x 127 GB usable), so
this is the cost-model ratio; the blog's GB300s hold it (288 GB each).

    python benchmarks/layouts_anchor.py

A benchmark: it prints; it asserts nothing.
"""

from __future__ import annotations

from dataclasses import replace

from wavepp.runtime.planning.bound import RequestWork, pipeline_bound
from wavepp.runtime.planning.parallel import H200_NVLINK, parse_layout, replica_stage_cost_models

MODEL = "kimi-k3"
PROMPT = 8192
CONCURRENCY = 64


def capacity(layout: str, **kwargs: object) -> float:
    parsed = parse_layout(layout)
    chunk = 8192 if parsed.num_stages == 1 else 16384
    models = replica_stage_cost_models(MODEL, parsed, microbatch_tokens=8192, **kwargs)  # type: ignore[arg-type]
    requests = [RequestWork(PROMPT, 0)] * (4 * CONCURRENCY)
    bound = pipeline_bound(models, requests, concurrency=CONCURRENCY, max_microbatch_tokens=chunk)
    return bound.tokens_per_s


def solve(target: float, f, lo: float, hi: float) -> float | None:  # type: ignore[no-untyped-def]
    """x in [lo, hi] with f(x) = target by bisection (f monotone), None if out of range."""
    f_lo, f_hi = f(lo), f(hi)
    if not min(f_lo, f_hi) <= target <= max(f_lo, f_hi):
        return None
    for _ in range(60):
        mid = (lo + hi) / 2
        if (f(mid) < target) == (f_lo < target):
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def main() -> None:
    pp = capacity("pp8")
    tep = capacity("tep8")
    print(
        f"{MODEL}, fresh {PROMPT}-token prompts, C = {CONCURRENCY}, H200 roofline, {H200_NVLINK.name}"
    )
    print(f"PP8 x TP1 capacity {pp:.0f} tok/s; TEP8 {tep:.0f} tok/s; ratio {pp / tep:.3f}")
    [tep_model] = replica_stage_cost_models(MODEL, parse_layout("tep8"))
    no_comm = replace(
        H200_NVLINK, allreduce_bus_bytes_per_s=1e30, alltoall_bus_bytes_per_s=1e30, latency_s=0.0
    )
    [tep_free] = replica_stage_cost_models(MODEL, parse_layout("tep8"), link=no_comm)
    print(
        f"TEP8 per token: b = {tep_model.b * 1e6:.2f} us, of which collectives "
        f"{(tep_model.b - tep_free.b) * 1e6:.2f} us; c = {tep_model.c * 1e3:.1f} ms per "
        f"micro-batch, of which collective latency {(tep_model.c - tep_free.c) * 1e3:.1f} ms"
    )
    print(f"ratio with free collectives: {pp / capacity('tep8', link=no_comm):.3f}")
    for target in (1.45, 1.72):
        imbalance = solve(target, lambda x: pp / capacity("tep8", ep_imbalance=x), 1.0, 4.0)
        busbw = solve(
            target,
            lambda x: (
                pp / capacity("tep8", link=replace(H200_NVLINK, allreduce_bus_bytes_per_s=x * 1e9))
            ),
            20.0,
            475.0,
        )
        print(
            f"ratio {target}: EP load imbalance (busiest rank / mean) "
            f"{'n/a' if imbalance is None else f'{imbalance:.2f}'}, or all-reduce busbw "
            f"{'n/a' if busbw is None else f'{busbw:.0f} GB/s'} (model: 475)"
        )


if __name__ == "__main__":
    main()
