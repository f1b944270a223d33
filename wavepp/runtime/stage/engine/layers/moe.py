"""Feed-forward blocks: dense SwiGLU and mixture-of-experts (DeepSeek-V3/GLM-5, MiniMax-M2).

Dense: ``down(silu(gate(x)) * up(x))``.

MoE, for ``x`` = the post-attention-normed activations [T, hidden]::

    logits = x Wr^T (float32);  s = sigmoid(logits);  choice = s + e_score_correction_bias
    grouped (DeepSeek/GLM, n_group > 1): group score = sum of its top-2 choice scores; keep
        the top ``topk_group`` groups, mask the other experts' choice to -inf
    idx = top-k(choice);  w = s[idx]  (the unbiased score);  w /= sum(w) when norm_topk_prob
    w *= routed_scaling_factor (DeepSeek/GLM)
    out = sum_j w_j * expert_{idx_j}(x)  +  shared_experts(x)  (DeepSeek/GLM; MiniMax has none)

Tensor parallelism (T ranks): every FFN (dense, each routed expert, the shared experts) keeps
``intermediate / T`` rows of gate/up and columns of down; the router and its bias are
replicated, so every rank routes alike; one all-reduce sums a block's partial outputs.

Routing is per token, so a token's output does not depend on which chunk or micro-batch it is
in. Sources: DeepSeek-V3 report sec. 2.1.2; HF ``DeepseekV3TopkRouter``, ``DeepseekV3MoE``,
``MiniMaxM2TopKRouter``, ``MiniMaxM2SparseMoeBlock``; experts applied as grouped matrix
products over the (token, expert) pairs sorted by expert (vLLM's and HF's grouped-GEMM MoE
layout), equal to HF's eager ``*Experts.forward`` up to summation order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from wavepp.runtime.families.layer_plan import MoEShape
from wavepp.runtime.stage.engine.layers.common import WeightGetter
from wavepp.runtime.stage.engine.layers.linear import PackedLinear
from wavepp.runtime.stage.engine.tensor_parallel import SINGLE, TPGroup

# style -> (block prefix, (gate, up, down) expert names, score-correction bias name)
NAMING: dict[str, tuple[str, tuple[str, str, str], str]] = {
    "deepseek": ("mlp.", ("gate_proj", "up_proj", "down_proj"), "gate.e_score_correction_bias"),
    "minimax": ("block_sparse_moe.", ("w1", "w3", "w2"), "e_score_correction_bias"),
    "kimi": ("block_sparse_moe.", ("w1", "w3", "w2"), "gate.e_score_correction_bias"),
}


class DenseMLP:
    """SwiGLU MLP: ``{prefix}gate_proj``, ``up_proj``, ``down_proj`` (gate/up fused); with TP,
    this rank's ``intermediate / T`` share, its output all-reduced unless ``reduce`` is False
    (the shared experts, summed with the routed experts' partial output first). ``pack``: the
    projections may take ``PackedLinear``'s packed CPU path."""

    def __init__(
        self,
        hidden_size: int,
        intermediate: int,
        get: WeightGetter,
        prefix: str,
        tp: TPGroup = SINGLE,
        *,
        reduce: bool = True,
        pack: bool = True,
    ) -> None:
        tp.shard(intermediate, f"{prefix}intermediate_size")
        self.tp = tp
        self.reduce = reduce
        self.gate_up = PackedLinear(
            torch.cat(
                [
                    get(prefix + "gate_proj.weight", (intermediate, hidden_size), 0),
                    get(prefix + "up_proj.weight", (intermediate, hidden_size), 0),
                ]
            ),
            pack=pack,
        )
        self.down = PackedLinear(
            get(prefix + "down_proj.weight", (hidden_size, intermediate), 1), pack=pack
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, hidden]."""
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        out = self.down(F.silu(gate) * up)
        return self.tp.all_reduce(out) if self.reduce else out


class SparseMoE:
    """Router, routed experts and shared experts of one MoE layer."""

    def __init__(
        self,
        shape: MoEShape,
        get: WeightGetter,
        layer_prefix: str,
        tp: TPGroup = SINGLE,
        *,
        pack: bool = True,
    ) -> None:
        """Load the router, its score-correction bias, every expert and the shared experts
        (this TP rank's share of each expert's intermediate dimension).

        Args:
            shape: the block's shape.
            get: the stage's weight getter.
            layer_prefix: ``model.layers.{i}.``.
            tp: this process's TP group.
            pack: the shared experts' projections may take ``PackedLinear``'s packed CPU
                path (the routed experts run as grouped products, unpacked).

        Raises:
            ValueError: a tensor is missing or has the wrong shape (from ``get``), or an
                intermediate width does not divide by the TP size.
        """
        s = shape
        self.shape = s
        self.tp = tp
        tp.shard(s.expert_intermediate, "moe_intermediate_size")
        d, f, e = s.hidden_size, s.expert_intermediate, s.num_experts
        block, names, bias = NAMING[s.style]
        p = layer_prefix + block
        self.router = get(p + "gate.weight", (e, d)).float()
        self.bias = get(p + bias, (e,)).float()
        gate_up, down = [], []
        for j in range(e):
            q = f"{p}experts.{j}."
            gate_up.append(
                torch.cat(
                    [
                        get(q + names[0] + ".weight", (f, d), 0),
                        get(q + names[1] + ".weight", (f, d), 0),
                    ]
                )
            )
            down.append(get(q + names[2] + ".weight", (d, f), 1))
        self.gate_up = torch.stack(gate_up)  # [E, 2f/T, d]
        self.down = torch.stack(down)  # [E, d, f/T]
        self.shared = (
            DenseMLP(
                d, s.shared_intermediate, get, p + "shared_experts.", tp, reduce=False, pack=pack
            )
            if s.shared_intermediate > 0
            else None
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k expert ids [n, k] (int64) and their weights [n, k] (float32) per token."""
        s = self.shape
        scores = F.linear(x.to(torch.float32), self.router).sigmoid()
        choice = scores + self.bias
        if s.n_group > 1:
            group_scores = (
                choice.view(-1, s.n_group, s.num_experts // s.n_group).topk(2, dim=-1)[0].sum(-1)
            )
            group_idx = torch.topk(group_scores, k=s.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
            keep = (
                group_mask.unsqueeze(-1)
                .expand(-1, s.n_group, s.num_experts // s.n_group)
                .reshape(-1, s.num_experts)
            )
            choice = choice.masked_fill(~keep.bool(), float("-inf"))
        idx = torch.topk(choice, k=s.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, idx)
        if s.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return idx, weights * s.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, hidden]: routed experts' weighted sum plus the shared experts.

        The n * k (token, expert) pairs are sorted by expert, so each expert's tokens are one
        contiguous group, and each projection runs as one grouped matrix product over all
        experts (:func:`grouped_linear`); ``index_add_`` sums every token's k outputs."""
        idx, weights = self.route(x)
        k = idx.shape[1]
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = order // k
        ends = torch.bincount(flat, minlength=self.shape.num_experts).cumsum(0)
        gate, up = grouped_linear(x.index_select(0, token), self.gate_up, ends).chunk(2, dim=-1)
        y = grouped_linear(F.silu(gate) * up, self.down, ends)
        y = y * weights.reshape(-1)[order, None]
        out = torch.zeros_like(x).index_add_(0, token, y.to(x.dtype))
        if self.shared is not None:
            out = out + self.shared.forward(x)
        return self.tp.all_reduce(out)


def _grouped_mm_fits(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``torch.nn.functional.grouped_mm`` takes these operands: float32 on CPU or
    bfloat16 on CUDA, rows and weight matrices 16-byte aligned."""
    if (rows.device.type, rows.dtype) not in (("cpu", torch.float32), ("cuda", torch.bfloat16)):
        return False
    elem = rows.element_size()
    return all((dim * elem) % 16 == 0 for dim in (weight.shape[1], weight.shape[2])) and all(
        t.data_ptr() % 16 == 0 for t in (rows, weight)
    )


def grouped_linear(rows: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Per group g, ``rows[ends[g-1]:ends[g]] @ weight[g].T``, concatenated.

    Args:
        rows: [m, in] rows sorted by group.
        weight: [G, out, in] one matrix per group.
        ends: [G] int64 cumulative row counts (``ends[-1] == m``; equal neighbours: an
            empty group).

    Returns:
        [m, out] in ``rows``' dtype: one ``torch.nn.functional.grouped_mm`` call where its
        kernels take the operands (:func:`_grouped_mm_fits`), else one matmul per non-empty
        group.
    """
    if rows.shape[0] == 0:
        return rows.new_zeros((0, weight.shape[1]))
    rows = rows.contiguous()
    if _grouped_mm_fits(rows, weight):
        return F.grouped_mm(rows, weight.transpose(1, 2), offs=ends.to(torch.int32))
    out = rows.new_empty((rows.shape[0], weight.shape[1]))
    bounds = [0, *ends.tolist()]
    for g in range(weight.shape[0]):
        lo, hi = bounds[g], bounds[g + 1]
        if hi > lo:
            out[lo:hi] = F.linear(rows[lo:hi], weight[g])
    return out
