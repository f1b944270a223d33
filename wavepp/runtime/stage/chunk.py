"""``ChunkSpec``: one chunk of a micro-batch as a stage's engine sees it (no torch, no I/O).

The stage core builds these from a plan and the stage's block tables; engines consume them.
It lives outside ``engine/`` so that the stage core (and the simulator) import no torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChunkSpec:
    """One chunk of one request inside a micro-batch.

    Attributes:
        request_id: the request this chunk belongs to (unique within a micro-batch).
        context_offset: L, tokens of this request already in this stage's KV cache
            (positions ``[0, L)``), from earlier chunks or a reused prefix.
        num_tokens: x >= 1, new tokens at positions ``[L, L + x)``.
        block_ids: this stage's block table for the request, covering at least ``L + x``
            tokens (``ceil((L + x) / block_size)`` blocks); extra trailing blocks are ignored.
        token_ids: the x new token ids; needed by the first stage only (None elsewhere is fine).
        is_last: last chunk of the prompt: the last stage returns this request's logits.
        num_cached_tokens: positions ``[0, num_cached_tokens)`` (whole blocks) sit in this
            stage's cached blocks already, shared with other requests: the stage's own prefix
            hit, which may exceed the agreed L* (the agreement reserves after each stage's own
            hit). A chunk computes such positions (the next stage may not hold them) but writes
            none of their KV or recurrent state: a cached block is never written. 0: none.
    """

    request_id: str
    context_offset: int
    num_tokens: int
    block_ids: tuple[int, ...]
    token_ids: tuple[int, ...] | None = None
    is_last: bool = False
    num_cached_tokens: int = 0

    @property
    def context_end(self) -> int:
        """L + x: tokens of the request in the cache once this chunk has run."""
        return self.context_offset + self.num_tokens
