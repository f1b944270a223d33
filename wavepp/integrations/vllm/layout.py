"""Where a handed-over token goes in vLLM's paged cache; torch only.

WavePP hands over one layer's KV token-major: [2 (K, V), num_tokens, num_kv_heads, head_dim]
(``wavepp.api.kv_handoff``), independent of either side's block size. On the vLLM side token t
of a request goes to slot ``block_ids[t // block_size] * block_size + t % block_size`` (vLLM's
block size); the connector hands K and V with those slots to the attention backend's own cache
writer (``do_kv_cache_update``, the one vLLM's forward uses), so the backend's in-block layout
(the CPU backend's ISA-specific packing, a GPU backend's NHD/HND) is never guessed here.
``kv_for_backend`` converts the rest explicitly: the token range, the dtype, the head shape.

An MLA layer arrives as [1, num_tokens, 1, kv_lora_rank + qk_rope_head_dim] (the normed latent,
then the roped key in the checkpoint's order: each row is what vLLM's MLA cache holds);
``latent_for_backend`` splits it into the two inputs of an MLA backend's ``do_kv_cache_update``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def slots_of(block_ids: Sequence[int], block_size: int, start: int, count: int) -> torch.Tensor:
    """Global slots (block * block_size + row) of tokens ``[start, start + count)``.

    Raises:
        ValueError: the blocks cannot hold token ``start + count - 1``.
    """
    if start + count > len(block_ids) * block_size:
        raise ValueError(
            f"tokens [{start}, {start + count}) need more than {len(block_ids)} blocks of "
            f"{block_size}"
        )
    t = torch.arange(start, start + count, dtype=torch.long)
    blocks = torch.as_tensor(list(block_ids), dtype=torch.long)
    return blocks[t // block_size] * block_size + t % block_size


def kv_for_backend(
    kv: torch.Tensor,
    start: int,
    count: int,
    *,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of tokens ``[start, start + count)`` of ``kv`` [2, num_tokens, H, C], each a
    contiguous [count, H, C] in ``dtype`` (what a backend's ``do_kv_cache_update`` takes).

    Raises:
        ValueError: ``kv`` is not [2, tokens, num_kv_heads, head_dim], or holds fewer than
            ``start + count`` tokens.
    """
    if kv.dim() != 4 or kv.shape[0] != 2 or tuple(kv.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"kv of shape {tuple(kv.shape)}; this cache needs [2, tokens, {num_kv_heads}, "
            f"{head_dim}]"
        )
    if start + count > kv.shape[1]:
        raise ValueError(f"kv holds {kv.shape[1]} tokens; tokens up to {start + count} asked")
    part = kv[:, start : start + count].to(dtype)
    return part[0].contiguous(), part[1].contiguous()


def latent_for_backend(
    latent: torch.Tensor,
    start: int,
    count: int,
    *,
    kv_lora_rank: int,
    rope_dim: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The normed latent [count, kv_lora_rank] and the roped key [count, 1, rope_dim] of tokens
    ``[start, start + count)`` of an MLA layer's ``latent`` [1, num_tokens, 1, kv_lora_rank +
    rope_dim], contiguous, in ``dtype`` (what an MLA backend's ``do_kv_cache_update`` takes).

    Raises:
        ValueError: ``latent`` is not [1, tokens, 1, kv_lora_rank + rope_dim], or holds fewer
            than ``start + count`` tokens.
    """
    width = kv_lora_rank + rope_dim
    if latent.dim() != 4 or latent.shape[0] != 1 or tuple(latent.shape[2:]) != (1, width):
        raise ValueError(
            f"latent of shape {tuple(latent.shape)}; this MLA cache needs [1, tokens, 1, "
            f"{width}] (kv_lora_rank {kv_lora_rank} + rope {rope_dim})"
        )
    if start + count > latent.shape[1]:
        raise ValueError(
            f"latent holds {latent.shape[1]} tokens; tokens up to {start + count} asked"
        )
    rows = latent[0, start : start + count, 0].to(dtype)
    return rows[:, :kv_lora_rank].contiguous(), rows[:, None, kv_lora_rank:].contiguous()
