"""Where a token's K and V live in vLLM's paged cache, and the copy into it; torch only.

WavePP hands over one layer's KV token-major: [2 (K, V), num_tokens, num_kv_heads, head_dim]
(``wavepp.api.kv_handoff``), independent of either side's block size. vLLM's CPU attention
backend (``CPU_ATTN``, layout LBHNC) keeps each layer's cache as a tensor of shape
[num_blocks, num_kv_heads, block_size, 2 * head_dim] whose memory, per (block, head), is the
block's K rows [block_size, head_dim] followed by its V rows (the backend views it as
[num_blocks, num_kv_heads, 2 * block_size, head_dim] and splits dim 2 in halves). Token t of
a request sits in vLLM block ``block_ids[t // block_size]`` at row ``t % block_size``.

The copy converts explicitly: dtype (to the cache's), block size (via the slot of each token),
head layout (token-major to head-major); heads and head_dim must match (else ValueError).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["cpu_cache_kv_view", "slots_of", "write_cpu_cache"]


def cpu_cache_kv_view(cache: torch.Tensor) -> torch.Tensor:
    """``cache`` [num_blocks, num_kv_heads, block_size, 2 * head_dim] as
    [num_blocks, num_kv_heads, 2 (K, V), block_size, head_dim] (a view).

    Raises:
        ValueError: ``cache`` is not 4-D with an even last dimension, or not contiguous.
    """
    if cache.dim() != 4 or cache.shape[3] % 2 or not cache.is_contiguous():
        raise ValueError(
            f"cache of shape {tuple(cache.shape)}: vLLM's CPU backend cache is a contiguous "
            "[num_blocks, num_kv_heads, block_size, 2 * head_dim]"
        )
    b, h, n, c2 = cache.shape
    return cache.view(b, h, 2, n, c2 // 2)


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


def write_cpu_cache(
    cache: torch.Tensor,
    kv: torch.Tensor,
    block_ids: Sequence[int],
    start: int,
    count: int,
) -> None:
    """Write tokens ``[start, start + count)`` of ``kv`` [2, num_tokens, num_kv_heads, head_dim]
    into a CPU-backend layer cache (module docstring) at the request's ``block_ids``.

    Raises:
        ValueError: head count or head_dim differ, ``kv`` holds fewer than ``start + count``
            tokens, or the blocks cannot hold them.
    """
    view = cpu_cache_kv_view(cache)
    _, heads, _, block_size, head_dim = view.shape
    if kv.dim() != 4 or kv.shape[0] != 2 or tuple(kv.shape[2:]) != (heads, head_dim):
        raise ValueError(
            f"kv of shape {tuple(kv.shape)}; this cache needs [2, tokens, {heads}, {head_dim}]"
        )
    if start + count > kv.shape[1]:
        raise ValueError(f"kv holds {kv.shape[1]} tokens; tokens up to {start + count} asked")
    if count <= 0:
        return
    slots = slots_of(block_ids, block_size, start, count)
    src = kv[:, start : start + count].to(cache.dtype)  # [2, T, H, C]
    blk, row = slots // block_size, slots % block_size
    # view[blk, :, which, row] is [T, H, C] for each of K (which=0) and V (which=1)
    view[blk, :, 0, row] = src[0]
    view[blk, :, 1, row] = src[1]
