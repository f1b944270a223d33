"""Run in vLLM's environment (``.venv-vllm/bin/python tests/support/vllm_rope_probe.py``):
vLLM's GPT-J-style RoPE (``is_neox_style=False``, DeepSeek's) applied by its CPU kernel
(``forward_cpu``) and by its PyTorch implementation (``forward_native``) to the views vLLM's MLA
hands it, against RoPE computed here in float64. Prints one JSON line: the largest |error| of
each for the query (``q[..., nope:]`` of [tokens, heads, nope + rope]) and the roped key (a
[tokens, 1, rope] slice of the fused [tokens, q_lora + kv_lora + rope] projection output), and,
as a control, for a contiguous [tokens, rope] key. Imports torch and vLLM only."""

from __future__ import annotations

import json

import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.rotary_embedding import get_rope

TOKENS, HEADS, NOPE, ROPE, Q_LORA, KV_LORA = 24, 4, 32, 64, 64, 512


def reference(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """GPT-J RoPE (pairs 2i, 2i+1 rotated by position * 10000^(-2i/ROPE)) in float64."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, ROPE, 2, dtype=torch.float64) / ROPE))
    angle = positions.double()[:, None] * inv
    shape = (-1,) + (1,) * (x.dim() - 2) + (ROPE // 2,)
    cos, sin = angle.cos().view(shape), angle.sin().view(shape)
    x = x.double()
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, odd * cos + even * sin), -1).flatten(-2)


def main() -> None:
    torch.manual_seed(0)
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(
            ROPE,
            max_position=4096,
            rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
            is_neox_style=False,
            dtype=torch.float32,
        )
    positions = torch.arange(TOKENS)
    report = {}
    for impl in ("cpu_kernel", "native"):
        fused = torch.randn(TOKENS, Q_LORA + KV_LORA + ROPE)
        q = torch.randn(TOKENS, HEADS, NOPE + ROPE)
        q_pe, k_pe = q[..., NOPE:], fused[:, Q_LORA + KV_LORA :].unsqueeze(1)
        want_q, want_k = reference(q_pe, positions), reference(k_pe, positions)
        plain = torch.randn(TOKENS, ROPE)
        want_plain = reference(plain, positions)
        if impl == "cpu_kernel":  # in place
            rope.forward_cpu(positions, q_pe, k_pe)
            rope.forward_cpu(positions, torch.randn(TOKENS, HEADS * ROPE), plain)
            got_q, got_k, got_plain = q_pe, k_pe, plain
        else:
            got_q, got_k = rope.forward_native(positions, q_pe, k_pe)
            _, got_plain = rope.forward_native(positions, torch.randn(TOKENS, HEADS * ROPE), plain)
        report[impl] = {
            "query": float((got_q.double() - want_q).abs().max()),
            "roped_key": float((got_k.double() - want_k).abs().max()),
            "contiguous_key": float((got_plain.double() - want_plain).abs().max()),
        }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
