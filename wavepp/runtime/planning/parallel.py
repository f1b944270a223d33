"""Replica layouts (PP S, TP t, TEP t, EP t, PP S x TP t) and their derived per-stage cost models.

A replica of G GPUs runs the model in S pipeline stages (the balanced layer split,
``wavepp.api.layer_split``), each stage on a group of t GPUs (G = S * t) that divides its layers
in one of three ways:

- ``tp``  Megatron tensor parallelism: attention heads and every GEMM's N split t ways (MoE: each
  expert's intermediate width f split t ways, all experts on every rank).
- ``tep`` attention tensor-parallel (as ``tp``), routed experts expert-parallel: E/t whole experts
  per rank, every rank holding all tokens after the attention all-reduce (SGLang/TensorRT-LLM
  "TEP"; dense MLP layers stay tensor-parallel).
- ``ep``  data-parallel attention (each rank runs attention for its own requests; its weights are
  replicated) and expert-parallel experts reached by a dispatch and a combine all-to-all (SGLang
  ``--enable-dp-attention`` with DeepEP); dense MLP layers run data-parallel too.

Cost of a stage (planner.CostModel t(L, x) = c + g*L + b*x + a*(2*L*x + x^2); the t = 1 terms are
``catalogue``'s, which this module reproduces exactly at t = 1), per layer of the stage, with
F = achieved FLOP/s (``GPUSpec.flops_per_s``), W = achieved HBM bytes/s, d = hidden size::

    c += weight bytes per GPU / W                          (tp, tep: all / t; ep: attention
                                                            whole + the rest / t)
         + n_coll * latency                                (t > 1)
    b += (attention FLOPs * loss_attn + other FLOPs + MLP FLOPs * loss_mlp) / t / F
         + collective seconds per token
    a += pair FLOPs / t / (2 F)
    g += KV bytes per token / k_split / W + context FLOPs / t / F
         (k_split = min(t, KV heads) for tp/tep: an MLA latent is read whole on every rank;
          k_split = t for ep: every rank reads only its own requests' KV)

and once per stage c += ``GPUSpec.overhead_s``, and the lm_head weight read (/ t) on the last.

Collectives, bf16 activations (2 bytes per element), nccl-tests' bus-bandwidth convention
(NVIDIA/nccl-tests ``doc/PERFORMANCE.md``: all-reduce busbw = algbw * 2(n-1)/n, all-to-all
busbw = algbw * (n-1)/n, algbw = bytes per rank / time)::

    all-reduce of x tokens:  2*d*x * 2(t-1)/t / B_ar  seconds  (+ latency)
    tp, tep: two per layer (after the attention output projection, after the MLP / MoE), as in
             Megatron-LM's tensor-parallel transformer layer (Shoeybi et al. 2019,
             arXiv:1909.08053, section 3: "two all-reduce operations in the forward pass"); TEP's
             second one sums the ranks' partial expert outputs, since every rank holds all
             tokens.
    ep:      dispatch (fp8, 1 byte per element, DeepEP's dispatch format) and combine (bf16)
             all-to-all per MoE layer; each rank sends its x/t tokens' k expert copies, of which
             (t-1)/t leave the rank under uniform routing:
             (x/t) * k * d * (1 + 2) * (t-1)/t / B_a2a  seconds (+ 2 latencies).

Collectives are added to compute, not overlapped (SGLang's two-batch overlap and TensorRT-LLM's
all-reduce fusion are off by default); pessimistic for tp/tep/ep by at most the collective time.

Small-shape GEMM efficiency (``gemm_efficiency``): splitting N t ways (tp), or E t ways (tep,
ep), or the tokens t ways (ep's data-parallel attention) leaves each rank fewer output tiles,
so the last wave of thread blocks runs partly empty. Tile and wave quantization as NVIDIA's
"Matrix Multiplication Background User's Guide" (docs.nvidia.com/deeplearning/performance)
states them: a GEMM of M x N outputs runs ceil(M/T)*ceil(N/T) tiles of T x T in
ceil(tiles/SMs) waves, efficiency = M*N / (waves * SMs * T^2). The MFU of the roofline
(``GPUSpec.mfu``) is what the unsplit shape achieves; a split layer's FLOPs are divided by the
ratio loss = eff(split shape) / eff(unsplit shape) (<= 1 in practice; exactly 1 at t = 1).
Assumed: T = 128 (CUTLASS's Hopper 128x128 tile), 132 SMs (H100/H200 SXM, NVIDIA H100 Tensor
Core GPU Architecture whitepaper), M = the engine's micro-batch tokens (``microbatch_tokens``),
MoE as one grouped GEMM over the rank's experts with M*k/E tokens each (uniform routing).

Interconnect (``H200_NVLINK``): NVLink 4, 900 GB/s bidirectional per H200 (450 GB/s per
direction); all-reduce bus bandwidth 475 GB/s (NVLink SHARP, NCCL's default on NVSwitch
systems), all-to-all 370 GB/s, 25 us per collective. ``H200_NVLINK_RING``: the same fabric
with the ring all-reduce (NCCL_ALGO=Ring, no NVLink SHARP), 370 GB/s. The source of each
figure (system descriptions, nccl-tests and NCCL reports) is in docs/bench/layouts.md. One
NVLink domain holds 8 GPUs (HGX H200); groups larger than that are refused (no inter-node
tensor parallelism is modelled).

Expert-parallel load imbalance (``ep_imbalance``, the busiest rank's routed tokens over the
mean; ``EP_IMBALANCES`` holds the published figures by name): multiplies a tep/ep layer's MoE
compute, since the busiest rank decides the layer's time.

KV capacity (``replica_kv_blocks``): ``planning.memory`` with t GPUs per stage (weights / t; an
MLA latent replicated on every tp/tep rank, GQA heads split over min(t, K)); ep keeps each
request's whole KV on one rank and the attention weights whole on every rank, so its capacity
is t times what one rank has left after those.

Pure: no I/O, no torch.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from wavepp.api.layer_split import split_layers
from wavepp.runtime.planning.cost_model import CostModel
from wavepp.runtime.planning.memory import derived_stage_memory
from wavepp.runtime.planning.published import get_model
from wavepp.runtime.planning.shapes import MODELS_MD, GPUSpec, LayerCost, ModelShape

ACTIVATION_BYTES = 2.0  # bf16 activations on the wire


DISPATCH_BYTES = 1.0  # fp8 dispatch (DeepEP), bf16 combine


TILE = 128


H200_SMS = 132


@dataclass(frozen=True)
class Interconnect:
    """The collectives' fabric inside one stage's GPU group (module docstring for the figures).

    Attributes:
        name: in words, for sources.
        allreduce_bus_bytes_per_s: nccl-tests all-reduce bus bandwidth, bytes/s.
        alltoall_bus_bytes_per_s: nccl-tests all-to-all bus bandwidth, bytes/s; None where no
            measurement is sourced (only an ``ep`` group's MoE dispatch and combine use it, and
            an ``ep`` group on such a fabric is refused).
        latency_s: fixed cost of one collective, seconds.
        max_group_size: GPUs one domain connects; a larger group is refused.

    Raises:
        ValueError: a bandwidth is not positive and finite (the all-to-all's may be None), the
            latency negative, or the domain smaller than 1.
    """

    name: str
    allreduce_bus_bytes_per_s: float
    alltoall_bus_bytes_per_s: float | None
    latency_s: float
    max_group_size: int

    def __post_init__(self) -> None:
        for field in ("allreduce_bus_bytes_per_s", "alltoall_bus_bytes_per_s"):
            value = getattr(self, field)
            if value is None and field == "alltoall_bus_bytes_per_s":
                continue
            if value is None or not math.isfinite(value) or value <= 0:
                raise ValueError(f"Interconnect.{field}={value!r}: must be finite and > 0")
        if not math.isfinite(self.latency_s) or self.latency_s < 0:
            raise ValueError(f"Interconnect.latency_s={self.latency_s!r}: must be >= 0")
        if self.max_group_size < 1:
            raise ValueError(f"Interconnect.max_group_size={self.max_group_size}: must be >= 1")


H200_NVLINK = Interconnect(
    "H200 NVLink 4 via NVSwitch (8 GPUs)",
    allreduce_bus_bytes_per_s=475e9,
    alltoall_bus_bytes_per_s=370e9,
    latency_s=25e-6,
    max_group_size=8,
)


H200_NVLINK_RING = Interconnect(
    "H200 NVLink 4 via NVSwitch (8 GPUs), ring all-reduce",
    allreduce_bus_bytes_per_s=370e9,
    alltoall_bus_bytes_per_s=370e9,
    latency_s=25e-6,
    max_group_size=8,
)


@dataclass(frozen=True)
class EPImbalance:
    """A published expert-parallel load imbalance (``replica_stage_cost_models``'
    ``ep_imbalance``).

    Attributes:
        name: the key in ``EP_IMBALANCES``.
        busiest_over_mean: the busiest rank's routed tokens over the mean, >= 1 (a source
            quoting (max - mean) / mean gives 1 + that).
        source: where the figure comes from and what it measured (model, EP size, phase).

    Raises:
        ValueError: busiest_over_mean not finite or below 1.
    """

    name: str
    busiest_over_mean: float
    source: str

    def __post_init__(self) -> None:
        if not math.isfinite(self.busiest_over_mean) or self.busiest_over_mean < 1:
            raise ValueError(
                f"EPImbalance.busiest_over_mean={self.busiest_over_mean!r}: must be finite and >= 1"
            )


_TRTLLM_BLOG4 = (
    "NVIDIA TensorRT-LLM tech blog 4, 'Scaling Expert Parallelism in TensorRT-LLM (Part 1)', "
    "Table 1: DeepSeek-R1 on 32 GB200, machine-translation dataset, decode, per-layer "
    "per-iteration imbalance ratio (max - mean) / mean by rank, averaged"
)


EP_IMBALANCES: dict[str, EPImbalance] = {
    entry.name: entry
    for entry in (
        EPImbalance("uniform", 1.0, "assumed: every rank routes the mean (uniform routing)"),
        EPImbalance(
            "trtllm-ep32-eplb",
            1.109,
            f"{_TRTLLM_BLOG4}: 0.109 with EPLB (9 expert slots per rank, EP 32)",
        ),
        EPImbalance(
            "trtllm-ep32-no-eplb",
            2.564,
            f"{_TRTLLM_BLOG4}: 1.564 without EPLB (8 experts per rank, EP 32)",
        ),
    )
}
"""Published figures by name. Both measured figures are EP 32 in decode; the imbalance grows
with the EP size (the same blog; SGLang's large-scale EP post, 2025-05-05), so at EP 8 they
bound the busiest rank from above, with and without EPLB."""


def gemm_efficiency(
    m: float, n: float, *, groups: float = 1, num_sms: int = H200_SMS, tile: int = TILE
) -> float:
    """Tile- and wave-quantization efficiency of a (grouped) GEMM (module docstring).

    Args:
        m: rows (tokens) per group, > 0.
        n: output columns per group, > 0.
        groups: GEMMs launched together (experts of a grouped GEMM), >= 1.
        num_sms: streaming multiprocessors, one tile each per wave.
        tile: square output tile edge.

    Returns:
        Useful outputs / (waves * num_sms * tile^2), in (0, 1].

    Raises:
        ValueError: m, n not > 0 or groups < 1.
    """
    if m <= 0 or n <= 0 or groups < 1:
        raise ValueError(f"gemm_efficiency(m={m}, n={n}, groups={groups}): need m, n > 0, >= 1")
    groups_n = math.ceil(groups)
    tiles = groups_n * math.ceil(m / tile) * math.ceil(n / tile)
    waves = math.ceil(tiles / num_sms)
    return groups_n * m * n / (waves * num_sms * tile * tile)


@dataclass(frozen=True)
class Layout:
    """A replica's parallel layout: S stages of t GPUs each, divided as ``group``.

    Attributes:
        num_stages: S, pipeline stages (>= 1).
        group: how each stage's t GPUs divide its layers: "tp", "tep" or "ep".
        group_size: t, GPUs per stage (>= 1).
        mode: the scheduler: "wave" (WavePP) or "sync" (the synchronous baseline; the one
            scheduler of a single-stage tp/tep/ep engine with chunked prefill).
        label: the layout as written (``parse_layout``'s input).
    """

    num_stages: int
    group: str
    group_size: int
    mode: str
    label: str

    @property
    def num_gpus(self) -> int:
        """G = S * t."""
        return self.num_stages * self.group_size

    def describe(self) -> str:
        """E.g. "PP 4 x TP 2, wave" or "TEP 8 (one scheduler, chunked prefill)"."""
        if self.label.startswith("pp"):
            group = f" x {self.group.upper()} {self.group_size}" if self.group_size > 1 else ""
            return f"PP {self.num_stages}{group}, {self.mode}"
        return f"{self.group.upper()} {self.group_size} (one scheduler, chunked prefill)"


_PP = re.compile(r"^pp(\d+)(?:x(tp|tep|ep)(\d+))?(?:-(wave|sync))?$")


_GROUP = re.compile(r"^(tp|tep|ep)(\d+)$")


def parse_layout(text: str, *, max_group_size: int = H200_NVLINK.max_group_size) -> Layout:
    """Parse one layout: ``pp{S}[x{tp|tep|ep}{t}][-wave|-sync]`` (a pipeline; mode default
    wave) or ``{tp|tep|ep}{t}`` (one stage, the synchronous scheduler with chunked prefill).

    Raises:
        ValueError: unknown syntax, S < 1, or t outside [1, max_group_size] (one NVLink
            domain) or not a power of two; the message names the layout and the limit.
    """
    spec = text.strip().lower()
    pp = _PP.match(spec)
    group = _GROUP.match(spec)
    if pp:
        num_stages = int(pp.group(1))
        kind = pp.group(2) or "tp"
        size = int(pp.group(3) or 1)
        mode = pp.group(4) or "wave"
    elif group:
        num_stages, kind, size, mode = 1, group.group(1), int(group.group(2)), "sync"
    else:
        raise ValueError(
            f"layout {text!r}: expected pp<S>[x<tp|tep|ep><t>][-wave|-sync] (e.g. pp8-wave, "
            "pp4xtp2-sync) or <tp|tep|ep><t> (e.g. tp8, tep8)"
        )
    if num_stages < 1:
        raise ValueError(f"layout {text!r}: stages S={num_stages} must be >= 1")
    if not 1 <= size <= max_group_size:
        raise ValueError(
            f"layout {text!r}: group size t={size} must be in [1, {max_group_size}] (GPUs of "
            "one NVLink domain; tensor/expert parallelism across nodes is not modelled)"
        )
    if size & (size - 1):
        raise ValueError(f"layout {text!r}: group size t={size} must be a power of two")
    return Layout(num_stages, kind, size, mode, spec)


def parse_layouts(text: str, *, max_group_size: int = H200_NVLINK.max_group_size) -> list[Layout]:
    """Comma-separated layouts (``parse_layout`` each), in order, without repeats.

    Raises:
        ValueError: empty list, a bad layout, or one written twice.
    """
    entries = [part for part in (p.strip() for p in text.split(",")) if part]
    if not entries:
        raise ValueError(f"{text!r}: give at least one layout, e.g. pp8-wave,tp8")
    layouts = [parse_layout(entry, max_group_size=max_group_size) for entry in entries]
    labels = [layout.label for layout in layouts]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise ValueError(f"{text!r}: layouts {repeated} given more than once")
    return layouts


@dataclass(frozen=True)
class _Terms:
    c: float
    g: float
    b: float
    a: float


def _split_loss(m: float, n: int, t: int, *, split_tokens: bool) -> float:
    """The efficiency of an [m, n] GEMM split ``t`` ways over the unsplit one's: its ``m``
    tokens split (``split_tokens``), else its ``n`` (each rank ceil(n / t))."""
    if split_tokens:
        return gemm_efficiency(m / t, n) / gemm_efficiency(m, n)
    return gemm_efficiency(m, math.ceil(n / t)) / gemm_efficiency(m, n)


def _layer_terms(
    layer: LayerCost,
    gpu: GPUSpec,
    link: Interconnect,
    group: str,
    t: int,
    microbatch_tokens: int,
    ep_imbalance: float,
) -> _Terms:
    flops, bandwidth = gpu.flops_per_s, gpu.bytes_per_s
    linear = layer.linear_flops_per_token
    if t == 1:
        return _Terms(
            c=layer.weight_bytes / bandwidth,
            g=layer.kv_bytes_per_token / bandwidth + layer.context_flops_per_token / flops,
            b=(linear + layer.other_flops_per_token) / flops,
            a=layer.pair_flops / (2.0 * flops),
        )
    split = layer.split
    if split is None:
        raise ValueError(
            f"layer kind {layer.kind!r} carries no LayerSplit: only one GPU per stage can be "
            "priced for this model (use a model from catalogue.list_models())"
        )
    m = float(microbatch_tokens)
    attention = split.attention_flops_per_token
    mlp = linear - attention
    moe = split.moe
    # Small-shape loss per part: efficiency of the split shape / of the unsplit shape.
    loss_attention = _split_loss(m, split.attention_width, t, split_tokens=group == "ep")
    if moe is None:  # with ep the dense MLP is data-parallel: the tokens split
        loss_mlp = _split_loss(m, split.mlp_width, t, split_tokens=group == "ep")
    else:
        per_expert = m * moe.experts_per_token / moe.num_experts
        whole = gemm_efficiency(per_expert, split.mlp_width, groups=moe.num_experts)
        if group == "tp":
            shard = gemm_efficiency(
                per_expert, math.ceil(split.mlp_width / t), groups=moe.num_experts
            )
        else:
            shard = gemm_efficiency(per_expert, split.mlp_width, groups=moe.num_experts / t)
        loss_mlp = shard / whole
        if group != "tp":  # the busiest rank's experts decide the layer's time
            loss_mlp /= ep_imbalance
    compute_b = (attention / loss_attention + layer.other_flops_per_token + mlp / loss_mlp) / (
        t * flops
    )
    # Collectives.
    d = split.hidden_size
    if group == "ep":
        weight_bytes = (
            split.attention_weight_bytes + (layer.weight_bytes - split.attention_weight_bytes) / t
        )
        kv_split = t
        if moe is None:
            comm_b, latencies = 0.0, 0
        else:
            if link.alltoall_bus_bytes_per_s is None:
                raise ValueError(
                    f"layout ep{t} on {link.name}: Interconnect.alltoall_bus_bytes_per_s is None "
                    "(no all-to-all measurement for this fabric); the ep group needs one"
                )
            per_rank_bytes_per_token = (
                moe.experts_per_token * d * (DISPATCH_BYTES + ACTIVATION_BYTES)
            )
            comm_b = per_rank_bytes_per_token * (t - 1) / t / t / link.alltoall_bus_bytes_per_s
            latencies = 2
    else:
        weight_bytes = layer.weight_bytes / t
        kv_split = min(t, layer.num_kv_heads)
        comm_b = 2.0 * ACTIVATION_BYTES * d * 2.0 * (t - 1) / t / link.allreduce_bus_bytes_per_s
        latencies = 2
    return _Terms(
        c=weight_bytes / bandwidth + latencies * link.latency_s,
        g=layer.kv_bytes_per_token / kv_split / bandwidth
        + layer.context_flops_per_token / t / flops,
        b=compute_b + comm_b,
        a=layer.pair_flops / t / (2.0 * flops),
    )


def replica_stage_cost_models(
    model: str | ModelShape,
    layout: Layout,
    *,
    gpu: GPUSpec | None = None,
    link: Interconnect = H200_NVLINK,
    microbatch_tokens: int = 8192,
    ep_imbalance: float = 1.0,
) -> list[CostModel]:
    """One derived CostModel per stage of ``layout`` (formulas: module docstring).

    Args:
        model: a name from ``catalogue.list_models()`` or a ModelShape.
        layout: the replica's layout.
        gpu: roofline; None uses the model's default (H200).
        link: the fabric inside a stage's group.
        microbatch_tokens: M of the small-shape GEMM efficiency (the engine's micro-batch).
        ep_imbalance: expert-parallel load imbalance, the busiest rank's routed tokens over
            the mean (>= 1); multiplies tep/ep MoE compute. 1.0 (uniform routing, the
            default) is what every other term assumes; ``EP_IMBALANCES`` holds the published
            figures (none for the paper's models; docs/bench/layouts.md's anchor check runs
            them).

    Returns:
        S models in stage order. At t = 1 each equals ``catalogue.derived_stage_cost_models``'
        (coefficients; the source differs).

    Raises:
        ValueError: unknown model, S outside [1, num_layers], t above the link's domain,
            microbatch_tokens < 1, ep_imbalance < 1, a model without LayerSplit geometry
            at t > 1, or an ep group of a MoE model on a link without an all-to-all figure.
    """
    spec = get_model(model)
    gpu = spec.default_gpu if gpu is None else gpu
    if microbatch_tokens < 1:
        raise ValueError(f"microbatch_tokens={microbatch_tokens}: must be >= 1")
    if not math.isfinite(ep_imbalance) or ep_imbalance < 1:
        raise ValueError(f"ep_imbalance={ep_imbalance}: must be finite and >= 1")
    t = layout.group_size
    if t > link.max_group_size:
        raise ValueError(
            f"layout {layout.label!r}: t={t} exceeds {link.name}'s {link.max_group_size} GPUs"
        )
    models = []
    for first, last in split_layers(spec.num_layers, layout.num_stages):
        terms = [
            _layer_terms(layer, gpu, link, layout.group, t, microbatch_tokens, ep_imbalance)
            for layer in spec.layers[first:last]
        ]
        lm_head = spec.lm_head_weight_bytes / t if last == spec.num_layers else 0.0
        models.append(
            CostModel(
                c=sum(term.c for term in terms) + lm_head / gpu.bytes_per_s + gpu.overhead_s,
                g=sum(term.g for term in terms),
                b=sum(term.b for term in terms),
                a=sum(term.a for term in terms),
                label="derived",
                source=(
                    f"derived: {spec.name} layers [{first},{last}) of {spec.num_layers}, "
                    f"{layout.describe()} @ {gpu.name} x {layout.num_gpus} "
                    f"({gpu.peak_flops / 1e12:g} TFLOP/s x MFU {gpu.mfu:g}, "
                    f"{gpu.hbm_bytes_per_s / 1e12:g} TB/s x MBU {gpu.mbu:g}; {link.name}); "
                    f"{MODELS_MD}; wavepp.runtime.planning.parallel"
                ),
            )
        )
    return models


def replica_kv_blocks(
    model: str | ModelShape,
    layout: Layout,
    *,
    block_size: int,
    max_microbatch_tokens: int,
    gpu: GPUSpec | None = None,
) -> list[int]:
    """KV capacity per stage of ``layout`` in blocks (module docstring: ``planning.memory`` at
    t GPUs per stage; ep's t ranks each hold their own requests' KV).

    Raises:
        ValueError: as ``memory.derived_stage_memory`` (the weights leave no KV block: the
            message names the model, stages, GPUs per stage and the memory needed).
    """
    stages = derived_stage_memory(
        model,
        num_stages=layout.num_stages,
        block_size=block_size,
        max_microbatch_tokens=max_microbatch_tokens,
        gpu=gpu,
        num_gpus_per_stage=layout.group_size,
    )
    if layout.group != "ep":
        return [stage.num_blocks for stage in stages]
    # ep: each rank holds the attention weights whole (memory divided them by t) and the whole
    # per-token KV of its own requests (memory split GQA heads); t ranks, t pools.
    spec = get_model(model)
    t = layout.group_size
    blocks = []
    for stage in stages:
        layers = spec.layers[stage.layers[0] : stage.layers[1]]
        extra = sum(layer.split.attention_weight_bytes for layer in layers if layer.split)
        free = stage.kv_bytes - extra * (1 - 1 / t)
        kv_per_token = sum(layer.kv_bytes_per_token for layer in layers)
        per_rank = math.floor(free / (kv_per_token * block_size)) if free > 0 else 0
        if per_rank < 1:
            raise ValueError(
                f"{spec.name} on {layout.num_stages} stages of {t} GPUs ({layout.label}): stage "
                f"{stage.rank} leaves {free / 1e9:.3g} GB per rank for KV after weights with "
                "the attention replicated on every rank; no KV block fits"
            )
        blocks.append(per_rank * t)
    return blocks
