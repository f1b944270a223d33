"""Kimi delta attention (KDA): Kimi-Linear's linear-attention layer, with its recurrent state
kept at block boundaries so that a cached prefix can be reused.

Per layer, for ``x`` = the input-normed activations [T, hidden] (H heads of width d)::

    u = [x Wq^T | x Wk^T | x Wv^T]                   [T, 3 H d], the short-conv input
    q, k, v = silu(causal depthwise conv_K(u))       over the previous K - 1 inputs too
    q, k = l2norm(q), l2norm(k);  q *= d^-0.5
    g = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias)   [T, H, d] per-channel log decay
    beta = sigmoid(x Wb^T)                              [T, H]
    per token:  S = S * exp(g_t)[:, :, None]             S: [H, d_k, d_v] float32
                S = S + k_t (beta_t (v_t - k_t^T S))     (delta rule)
                o_t = q_t^T S
    out = o_proj(RMSNorm(o) * sigmoid(g_b(g_a(x))))

The state after a prefix is (S, the last K - 1 conv inputs). It is stored after every
``state_interval_blocks``-th block of a request's block table (after block j when
(j + 1) % k == 0), keyed by that block's id, so it lives and dies with the block: writing new
tokens into a block drops the state stored under its id. A chunk starting at position L reads
its initial state from (in order): the request's own running state (a continuation chunk),
zeros (L = 0), or the state stored under block ``L / block_size - 1`` (a reused prefix; the
agreement makes L* a multiple of k blocks). Memory per stored state and layer:
H d_k d_v * 4 B + (K - 1) * 3 H d * elem.

The recurrence is evaluated token by token (the reference's ``recurrent_kimi_delta_attention``
form; the chunked form the reference uses for prefill is the same sum, reordered).
Sources: Kimi Linear report (KDA); HF ``modeling_kimi_linear.KimiLinearDeltaAttention``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from wavepp.runtime.families.layer_plan import KDAShape
from wavepp.runtime.stage.engine.layers.common import WeightGetter


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


class KDAAttention:
    """One KDA layer's weights, its stored states per block id and running states per request.

    A running state is dropped when its request's last chunk ran, or by ``drop`` when the stage
    released a request that never got there (withdrawn, failed, expired). At most
    ``max_running`` are kept in any case, the oldest dropped first (its request's next chunk,
    if any, is then refused by position).
    """

    max_running = 4096

    def __init__(self, shape: KDAShape, get: WeightGetter, prefix: str, interval: int) -> None:
        """Load the projections, short convolutions, decay and output gate weights.

        Args:
            shape: the layer's shape.
            get: the stage's weight getter.
            prefix: ``model.layers.{i}.self_attn.``.
            interval: store the state after every ``interval``-th block (>= 1).

        Raises:
            ValueError: a tensor is missing or has the wrong shape (from ``get``).
        """
        s = shape
        self.shape = s
        self.interval = interval
        d, dim = s.hidden_size, s.num_heads * s.head_dim
        self.qkv = torch.cat([get(prefix + f"{n}_proj.weight", (dim, d)) for n in "qkv"])
        self.conv = torch.cat(
            [get(prefix + f"{n}_conv1d.weight", (dim, 1, s.conv_kernel)) for n in "qkv"]
        )
        self.f_a = get(prefix + "f_a_proj.weight", (s.head_dim, d))
        self.f_b = get(prefix + "f_b_proj.weight", (dim, s.head_dim))
        self.dt_bias = get(prefix + "dt_bias", (dim,)).float()
        self.decay = get(prefix + "A_log", (1, 1, s.num_heads, 1)).float().exp().view(-1, 1)
        self.b_proj = get(prefix + "b_proj.weight", (s.num_heads, d))
        self.g_a = get(prefix + "g_a_proj.weight", (s.head_dim, d))
        self.g_b = get(prefix + "g_b_proj.weight", (dim, s.head_dim))
        self.o_norm = get(prefix + "o_norm.weight", (s.head_dim,))
        self.o = get(prefix + "o_proj.weight", (d, dim))
        # block id -> (S [H, d, d] float32, conv tail [K - 1, 3 H d])
        self.states: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # request id -> (position, S, conv tail): the state where its last chunk ended
        self.running: dict[str, tuple[int, torch.Tensor, torch.Tensor]] = {}
        self._device = self.qkv.device

    def allocate(self, num_slots: int, device: torch.device, dtype: torch.dtype) -> None:
        """Drop every stored and running state (a new cache holds no prefix)."""
        del num_slots, device, dtype
        self.states.clear()
        self.running.clear()

    def drop(self, request_ids: Sequence[str]) -> None:
        """Drop the running states of ``request_ids`` (ids without one are skipped); the
        states stored per block stay, they belong to the blocks."""
        for request_id in request_ids:
            self.running.pop(request_id, None)

    @property
    def cache_bytes(self) -> int:
        """Bytes of the states held now (stored per block and running per request)."""
        held = [(s, t) for s, t in self.states.values()]
        held += [(s, t) for _, s, t in self.running.values()]
        return sum(s.numel() * s.element_size() + t.numel() * t.element_size() for s, t in held)

    def _initial(self, chunk, block_size: int, dtype: torch.dtype):  # noqa: ANN001, ANN202
        s = self.shape
        start = chunk.context_offset
        run = self.running.get(chunk.request_id)
        if run is not None and run[0] == start:
            return run[1], run[2]
        if start == 0:
            zeros = torch.zeros((s.num_heads, s.head_dim, s.head_dim), device=self._device)
            tail = torch.zeros(
                (s.conv_kernel - 1, 3 * s.num_heads * s.head_dim), device=self._device, dtype=dtype
            )
            return zeros, tail
        num_blocks = start // block_size
        stored = None
        if start % block_size == 0 and num_blocks % self.interval == 0:
            stored = self.states.get(chunk.block_ids[num_blocks - 1])
        if stored is None:
            raise ValueError(
                f"request {chunk.request_id!r}: context_offset={start} has no recurrent state "
                f"on this stage (states are kept after every {self.interval}-th block of "
                f"{block_size} tokens; L* must be a multiple of {self.interval * block_size} "
                "tokens, and the chunk before it must have run here)"
            )
        return stored

    def forward(self, x: torch.Tensor, p) -> torch.Tensor:  # noqa: ANN001 (TorchPreparedBatch)
        """[T, hidden] normed activations -> [T, hidden] layer output (before residual)."""
        s = self.shape
        h, dh, kk = s.num_heads, s.head_dim, s.conv_kernel
        dim = h * dh
        num_tokens = x.shape[0]
        u = F.linear(x, self.qkv)  # [T, 3 dim]
        g = F.linear(F.linear(x, self.f_a), self.f_b).float() + self.dt_bias
        g = g.view(num_tokens, h, dh)
        g = -self.decay * torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))
        beta = torch.sigmoid(F.linear(x, self.b_proj)).float()  # [T, H]
        gate = F.linear(F.linear(x, self.g_a), self.g_b).view(num_tokens, h, dh)
        out = torch.empty((num_tokens, h, dh), device=x.device, dtype=torch.float32)
        bs = p.block_size
        for chunk, start in zip(p.chunks, p.row_starts, strict=True):
            n, first = chunk.num_tokens, chunk.context_offset
            cached = chunk.num_cached_tokens  # whole blocks cached here: never rewritten
            for j in range(max(first, cached) // bs, (first + n - 1) // bs + 1):
                self.states.pop(chunk.block_ids[j], None)  # rewritten: its state is stale
            state, tail = self._initial(chunk, bs, u.dtype)
            seq = torch.cat((tail, u[start : start + n]))  # [K - 1 + n, 3 dim]
            conv = F.conv1d(seq.t()[None], self.conv, groups=3 * dim)[0].t()
            q, k, v = F.silu(conv).float().split(dim, dim=-1)
            q = _l2norm(q.view(n, h, dh)) * dh**-0.5
            k = _l2norm(k.view(n, h, dh))
            v = v.view(n, h, dh)
            for t in range(n):
                row = start + t
                state = state * g[row].exp()[..., None]
                mem = (state * k[t][..., None]).sum(dim=-2)
                delta = (v[t] - mem) * beta[row][..., None]
                state = state + k[t][..., None] * delta[..., None, :]
                out[row] = (state * q[t][..., None]).sum(dim=-2)
                end = first + t + 1
                if end % bs == 0 and (end // bs) % self.interval == 0 and end > cached:
                    self.states[chunk.block_ids[end // bs - 1]] = (
                        state,
                        seq[t + 1 : t + kk].clone(),
                    )
            if chunk.is_last:
                self.running.pop(chunk.request_id, None)
            else:
                self.running.pop(chunk.request_id, None)  # re-insert: newest last
                self.running[chunk.request_id] = (first + n, state, seq[n:].clone())
                while len(self.running) > self.max_running:
                    self.running.pop(next(iter(self.running)))
        var = out.pow(2).mean(-1, keepdim=True)
        normed = out * torch.rsqrt(var + s.eps) * self.o_norm.float()
        y = (normed * torch.sigmoid(gate.float())).to(x.dtype)
        return F.linear(y.reshape(num_tokens, dim), self.o)
