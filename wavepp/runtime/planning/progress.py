"""What the chunk planner reads and writes: a request's planning state and the chunks cut from it.

``RequestProgress`` is an admitted request as the planner sees it (prompt length, tokens already
computed or planned, chunks planned, the static budget's credit for its cached prefix);
``ChunkPlanner.plan_microbatch`` advances it. ``Chunk`` is one contiguous slice of a request's
uncached tokens in a planned micro-batch. The planner itself is ``wavepp.runtime.planning.planner``.
Pure: no I/O, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from wavepp.runtime.planning.cost_model import check_non_negative


@dataclass
class RequestProgress:
    """What the planner sees of an admitted request. Mutable: the planner advances it.

    Attributes:
        request_id: unique among the requests passed to one plan_microbatch call.
        num_prompt_tokens: prompt length, tokens (>= 1).
        num_computed_tokens: tokens whose KV exists on every stage or is already planned. Starts
            at the agreed cached length L* * block_size; plan_microbatch advances it by each
            planned chunk. NOTE: it counts *planned* tokens, not executed ones: the chunk that
            moves it is still in flight. Admission must leave at least one token uncached (the
            last token's logits are needed), as vLLM does when a whole prompt hits the cache.
        arrival_s: arrival time, seconds on the caller's clock (for TTFT; the planner keeps FIFO
            order of the sequence it is given and does not sort by this).
        num_planned_chunks: chunks planned so far; the next chunk's chunk_index.
        num_credited_tokens: static policy only: of the cached tokens (the
            num_computed_tokens at admission), how many the token budget knows of before the
            first chunk; the rest is charged as if it were computed (TensorRT-LLM fixes the
            budget before it finds the cached prefix; docs/bench/baseline.md). None: all.
    """

    request_id: str
    num_prompt_tokens: int
    num_computed_tokens: int
    arrival_s: float = 0.0
    num_planned_chunks: int = 0
    num_credited_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 1:
            raise ValueError(
                f"RequestProgress {self.request_id!r}: num_prompt_tokens="
                f"{self.num_prompt_tokens}; must be >= 1"
            )
        if not 0 <= self.num_computed_tokens <= self.num_prompt_tokens:
            raise ValueError(
                f"RequestProgress {self.request_id!r}: num_computed_tokens="
                f"{self.num_computed_tokens}; must be in [0, num_prompt_tokens="
                f"{self.num_prompt_tokens}]"
            )
        check_non_negative("num_planned_chunks", self.num_planned_chunks)
        if self.num_credited_tokens is not None:
            check_non_negative("num_credited_tokens", self.num_credited_tokens)

    @property
    def num_uncredited_tokens(self) -> int:
        """Cached tokens the static budget charges with the first chunk (0 after it)."""
        if self.num_credited_tokens is None or self.num_planned_chunks > 0:
            return 0
        return max(0, self.num_computed_tokens - self.num_credited_tokens)

    @property
    def num_charged_tokens(self) -> int:
        """What the static budget charges to plan the rest of the prompt in one chunk."""
        return self.num_remaining_tokens + self.num_uncredited_tokens

    @property
    def num_remaining_tokens(self) -> int:
        """Prompt tokens not yet planned."""
        return self.num_prompt_tokens - self.num_computed_tokens

    @property
    def is_fully_planned(self) -> bool:
        """True once every prompt token belongs to a planned chunk."""
        return self.num_computed_tokens >= self.num_prompt_tokens


@dataclass(frozen=True)
class Chunk:
    """A contiguous slice of one request's uncached tokens.

    Attributes:
        request_id: the request.
        chunk_index: 0, 1, 2, ... per request, in execution order.
        context_offset: first token position of the chunk (= L for this chunk).
        num_tokens: x, new tokens (>= 1).
        is_last: the chunk ends the prompt; its last token's logits are needed.
    """

    request_id: str
    chunk_index: int
    context_offset: int
    num_tokens: int
    is_last: bool
