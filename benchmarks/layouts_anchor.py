"""The SGLang anchor: Kimi K3 prefill capacity of PP8 x TP1 against TEP8 on 8K-token prompts.

Capacity = the physical bound (``planning.bound.pipeline_bound``) of a closed loop at a large
concurrency on fresh 8K prompts (no reuse), for each layout's derived stage cost models
(``planning.parallel``): PP8 with micro-batches of up to 16,384 tokens (the runtime's cap),
TEP8 with the engine's 8,192-token chunks. Kimi K3's weights do not fit 8 H200s (1.56 TB > 8 x
127 GB usable), so this is the cost-model ratio; the blog's GB300s hold it (288 GB each).

Prints, in order:

1. the ratio at the catalogue's inputs (H200 roofline, NVLink SHARP all-reduce, uniform
   routing) and the TEP8 time per token by term;
2. the ratio for every sourced input pair: the all-reduce fabric (``H200_NVLINK``, NVLink SHARP
   475 GB/s; ``H200_NVLINK_RING``, ring 370 GB/s) x the published expert-parallel load
   imbalances (``parallel.EP_IMBALANCES``), with the TEP8 all-reduce's message size;
3. a GB300 what-if: both layouts on a GB300 roofline and NVLink 5. Inputs: BF16 dense
   2.5 PFLOP/s and 8 TB/s HBM per GPU (the per-GPU table of Verda's "NVIDIA GB300 NVL72: GPU
   Architecture & Performance", verda.com/blog/gb300-nvl72-architecture), the H200's MFU 0.5
   and MBU 0.8 (assumed, as for every roofline here), all-reduce bus bandwidth 811 GB/s
   (NCCL micro-benchmark over multi-node NVLink on 2 hosts x 4 GB200, NVLink 5: lixueduan.com,
   "GB200 MNNVL 实测带宽提升 10 倍"), 25 us per collective (the H200's); the tile model keeps
   132 SMs. The same page measured 85 GB/s between the two hosts over InfiniBand: the
   what-if's last line is TEP8 with its all-reduce on that network (two hosts outside one
   NVLink domain);
4. the values of each term alone that would put the ratio at 1.45 and 1.72 (the anchor).

    python benchmarks/layouts_anchor.py

A benchmark: it prints; it asserts nothing. docs/bench/layouts.md holds its output.
"""

from __future__ import annotations

from dataclasses import replace

from wavepp.runtime.planning.bound import RequestWork, pipeline_bound
from wavepp.runtime.planning.parallel import (
    ACTIVATION_BYTES,
    EP_IMBALANCES,
    H200_NVLINK,
    H200_NVLINK_RING,
    Interconnect,
    parse_layout,
    replica_stage_cost_models,
)
from wavepp.runtime.planning.published import get_model
from wavepp.runtime.planning.shapes import GPUSpec

MODEL = "kimi-k3"
PROMPT = 8192
CONCURRENCY = 64
TEP_CHUNK = 8192

GB300 = GPUSpec("GB300", peak_flops=2.5e15, hbm_bytes_per_s=8e12, mfu=0.5, mbu=0.8)
GB300_NVLINK = Interconnect(
    "GB300 NVLink 5 (8 GPUs of one NVLink domain)",
    allreduce_bus_bytes_per_s=811e9,
    # PP8 x TP1 runs no collective and TEP8 only all-reduces (planning.parallel); no GB300
    # all-to-all measurement is sourced, so none is given (an ep layout here is refused).
    alltoall_bus_bytes_per_s=None,
    latency_s=25e-6,
    max_group_size=8,
)


def capacity(layout: str, **kwargs: object) -> float:
    parsed = parse_layout(layout)
    chunk = TEP_CHUNK if parsed.num_stages == 1 else 16384
    models = replica_stage_cost_models(MODEL, parsed, microbatch_tokens=TEP_CHUNK, **kwargs)  # type: ignore[arg-type]
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

    hidden = next(layer.split.hidden_size for layer in get_model(MODEL).layers if layer.split)
    message_mb = ACTIVATION_BYTES * hidden * TEP_CHUNK / 1e6
    print(
        f"\nsourced inputs (TEP8 all-reduce message per layer: {message_mb:.0f} MB = "
        f"{ACTIVATION_BYTES:g} B x d {hidden} x {TEP_CHUNK} tokens):"
    )
    print("| all-reduce | EP imbalance (busiest / mean) | TEP8 tok/s | PP8 / TEP8 |")
    print("| --- | --- | ---: | ---: |")
    for link, link_name in (
        (H200_NVLINK, "NVLink SHARP 475 GB/s"),
        (H200_NVLINK_RING, "ring 370 GB/s"),
    ):
        for entry in EP_IMBALANCES.values():
            tep_x = capacity("tep8", link=link, ep_imbalance=entry.busiest_over_mean)
            print(
                f"| {link_name} | {entry.name} {entry.busiest_over_mean:.3f} | {tep_x:.0f} | "
                f"{pp / tep_x:.3f} |"
            )

    pp_gb300 = capacity("pp8", gpu=GB300, link=GB300_NVLINK)
    tep_gb300 = capacity("tep8", gpu=GB300, link=GB300_NVLINK)
    print(
        f"\nGB300 what-if ({GB300_NVLINK.name}, all-reduce 811 GB/s): PP8 {pp_gb300:.0f} tok/s, "
        f"TEP8 {tep_gb300:.0f}, ratio {pp_gb300 / tep_gb300:.3f}"
    )
    for name in ("trtllm-ep32-eplb", "trtllm-ep32-no-eplb"):
        imbalance = EP_IMBALANCES[name].busiest_over_mean
        tep_x = capacity("tep8", gpu=GB300, link=GB300_NVLINK, ep_imbalance=imbalance)
        print(f"  with {name} {imbalance:.3f}: ratio {pp_gb300 / tep_x:.3f}")
    over_ib = replace(
        GB300_NVLINK, name="InfiniBand between the hosts", allreduce_bus_bytes_per_s=85e9
    )
    tep_ib = capacity("tep8", gpu=GB300, link=over_ib)
    print(f"  TEP8's all-reduce over InfiniBand (85 GB/s): ratio {pp_gb300 / tep_ib:.3f}")

    print("\neach term alone, at the catalogue's other inputs (H200):")
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
