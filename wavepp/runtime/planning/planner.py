"""The chunk / micro-batch planner.

Pure logic: no I/O, no torch. The planner is the third step of admission (docs/design.md
'The problem'): cut admitted requests into chunks so that every micro-batch costs about the same on
the slowest stage, which keeps the pipeline full. Costs come from ``cost_model.CostModel``
(t(L, x) = c + g*L + b*x + a*(2*L*x + x^2), docs/design.md 'Cost model'); since the attention term
of a prompt does not depend on how it is cut, only c and g*L do, which is what the chunking
trades against filling the stages. What it reads and writes (``RequestProgress``, ``Chunk``) is
``wavepp.runtime.planning.progress``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from wavepp.runtime.planning.cost_model import CostModel, check_non_negative
from wavepp.runtime.planning.progress import Chunk, RequestProgress

BudgetAccounting = Literal["none", "estimated", "exact"]

# NOTE: a request's leftover that costs at most this fraction of the micro-batch budget rides
# along (the micro-batch overshoots its target) instead of travelling alone later as a sliver
# that pays the fixed cost c for little work (closed-loop target only; never past the token cap).
SLIVER_FRACTION = 0.15

DEFAULT_MAX_MICROBATCH_TOKENS = 16384


@dataclass
class _StageBudgets:
    """Per-stage seconds left in the micro-batch being filled (NOTE: one entry per cost model)."""

    models: tuple[CostModel, ...]
    left_s: list[float]

    def max_tokens(
        self, num_context_tokens: int, num_tokens_cap: int, num_repaid_context_tokens: int = 0
    ) -> int:
        """Most new tokens after ``num_context_tokens`` that fit every stage's budget, plus
        ``g * num_repaid_context_tokens`` (the context a cut makes the next chunk read again)."""
        return min(
            model.max_new_tokens_within(
                num_context_tokens,
                left + model.g * num_repaid_context_tokens,
                num_tokens_cap=num_tokens_cap,
            )
            for model, left in zip(self.models, self.left_s, strict=True)
        )

    def spend(self, num_context_tokens: int, num_new_tokens: int) -> None:
        for index, model in enumerate(self.models):
            self.left_s[index] -= model.chunk_cost_s(num_context_tokens, num_new_tokens)


class ChunkPlanner:
    """Cuts admitted requests into chunks and packs chunks into micro-batches.

    A prompt is sliced like this (B = block_size; | = block boundary)::

        position  0          L*·B                                         num_prompt_tokens
                  |== cached ==|---- chunk 0 ----|--- chunk 1 ---|-- 2 --|- 3 -|4|
                  (pinned, not  ^ context_offset of chunk 0 = L*·B      ends on a block
                   recomputed)    every chunk boundary is a multiple    boundary except the
                                  of B, except the prompt's end         prompt's end (is_last)

        dynamic: chunk i costs about the same; larger L -> fewer tokens (chunks shrink)
        static:  every chunk has chunk_tokens tokens (minus packing); cost grows with L

    Several requests share a micro-batch (packing): one micro-batch might hold the end of request
    A, all of B, and the start of C, in FIFO order.

    Rules of plan_microbatch (requests in FIFO order; each call plans one micro-batch):

    - Per request, chunks come in order: chunk_index = num_planned_chunks, context_offset =
      num_computed_tokens; both advance. Fully planned requests are skipped.
    - "static" (baseline, mirrors TensorRT-LLM's FIRST_COME_FIRST_SERVED context chunking,
      cpp/tensorrt_llm/batch_manager/microBatchScheduler.cpp): a budget of chunk_tokens new
      tokens per micro-batch; each request's chunk = min(remaining, budget left), rounded down
      to a multiple of block_size unless it finishes the prompt (TRT-LLM's chunk unit). A
      request that gets 0 tokens is skipped and later ones still get a chance (a short prompt
      end may still fit). Budget accounting (``RequestProgress.num_credited_tokens``): a first
      chunk is charged its new tokens plus the cached tokens the budget was not told of; one
      that does not fit whole gets k = the budget left, rounded down to a block, and is charged
      k; it computes min(k, new tokens), since TensorRT-LLM shifts the chunk's window past the
      cached prefix it finds afterwards (``LlmRequest::setPrepopulatedPromptLen``).
    - "dynamic" (WavePP): a cost budget. target = cost on the slowest stage of a micro-batch
      of chunk_tokens new tokens at L = 0 (target_cost_s). Chunks are added in FIFO order while
      the micro-batch's cost on every stage stays <= target; the chunk that would overshoot is
      cut to the most tokens that fit, rounded down to a block boundary unless it finishes the
      prompt, and the micro-batch closes. At a split target (closed loop, or the at-least-S
      rule: c + W/k) a chunk may also spend the g*L its cut makes the rest read again (W counts
      each request's context once), and a request that fills the micro-batch alone is cut one
      block further when that leaves its rest in fewer micro-batches: k micro-batches' worth
      comes out as k, not k + 1 (``_fewer_pieces``). Chunks late in a long prompt (large L)
      thus get fewer tokens and every micro-batch costs about the same.
    - Progress: the first chunk of a micro-batch always gets at least one block (or the rest
      of the prompt), even if c + g*L alone exceeds the target.
    - At least S in flight (dynamic by default; `fill_idle_stages`): with idle = num_stages -
      num_inflight > 0 and W = the cost of all remaining work without c, the target becomes
      min(target, c + W / k) so the remaining work spreads over the stages that would
      otherwise idle (the progress rule keeps it >= one block per micro-batch); k <= idle is
      the count that minimises (S - 1 + k) * (c + W / k), so a short request is not cut into
      micro-batches that each pay c when that would finish later (``_best_num_splits``). For "static"
      with fill_idle_stages=True the token budget becomes min(chunk_tokens, ceil(remaining
      tokens / idle) rounded up to a block).
    - Closed-loop target (``target_cost_s`` given, WavePP): the caller knows the work of every
      request in the system and passes c + W / S, so S equal micro-batches hold it all
      (docs/bench/bound.md). The target replaces the chunk_tokens cost and the at-least-S rule;
      a leftover costing at most SLIVER_FRACTION of the budget rides along rather than travel
      alone as a sliver.
    - At most max_microbatch_tokens new tokens (the engine's largest micro-batch) and at most
      max_chunks_per_microbatch chunks per micro-batch, whatever the policy.
    - Returns [] when no request has tokens left.

    "Slowest stage": the planner takes one CostModel (use the slowest stage's) or one per stage;
    with several, a chunk fits only if it fits every stage's budget.
    """

    def __init__(
        self,
        cost_model: CostModel | Sequence[CostModel],
        *,
        policy: Literal["dynamic", "static"],
        chunk_tokens: int = 8192,
        block_size: int = 16,
        max_chunks_per_microbatch: int = 256,
        fill_idle_stages: bool | None = None,
        max_microbatch_tokens: int = DEFAULT_MAX_MICROBATCH_TOKENS,
        budget_accounting: BudgetAccounting = "exact",
        one_chunk_inflight: bool = False,
    ) -> None:
        """Create a planner.

        Args:
            cost_model: the slowest stage's model, or one model per stage.
            policy: "dynamic" (WavePP cost budget) or "static" (fixed token budget, baseline).
            chunk_tokens: static: new tokens per micro-batch; dynamic: the target is the cost of
                this many new tokens at L = 0. A multiple of block_size.
            block_size: tokens per KV block; chunk boundaries fall on multiples of it.
            max_chunks_per_microbatch: cap on chunks (hence requests) in one micro-batch.
            fill_idle_stages: apply the at-least-S rule; default True for dynamic, False for
                static (TRT-LLM does not shrink chunks).
            max_microbatch_tokens: the engine's largest micro-batch, new tokens (>= block_size).
            budget_accounting: static only: what a request's first chunk is charged for its
                cached prefix before the budget knows of it (``BaselineConfig``): "exact" only
                its new tokens, "none" the whole remaining prompt, "estimated" the prompt less
                the prefix started live requests hold. Read by the caller that fills
                ``RequestProgress.num_credited_tokens`` (``SchedulerCore``).
            one_chunk_inflight: a request is not cut again while one of its chunks is in
                flight (TensorRT-LLM's micro-batch scheduler skips requests in execution);
                ``may_cut`` applies it.

        Raises:
            ValueError: on an unknown policy or budget accounting, non-positive sizes,
                chunk_tokens not a multiple of block_size, or budget_accounting other than
                "exact" with the dynamic policy (it charges costs, not tokens).
        """
        models = (cost_model,) if isinstance(cost_model, CostModel) else tuple(cost_model)
        if not models or not all(isinstance(model, CostModel) for model in models):
            raise ValueError(
                f"cost_model={cost_model!r}: must be a CostModel or a non-empty sequence of them"
            )
        if policy not in ("dynamic", "static"):
            raise ValueError(f"policy={policy!r}: must be 'dynamic' or 'static'")
        if budget_accounting not in ("none", "estimated", "exact"):
            raise ValueError(
                f"budget_accounting={budget_accounting!r}: must be 'none', 'estimated' or 'exact'"
            )
        if policy == "dynamic" and budget_accounting != "exact":
            raise ValueError(
                f"budget_accounting={budget_accounting!r}: the dynamic policy accounts exactly; "
                "only the static policy takes 'none' or 'estimated'"
            )
        if block_size < 1:
            raise ValueError(f"block_size={block_size}: must be >= 1")
        if chunk_tokens < block_size or chunk_tokens % block_size:
            raise ValueError(
                f"chunk_tokens={chunk_tokens}: must be a positive multiple of "
                f"block_size={block_size}"
            )
        if max_microbatch_tokens < block_size:
            raise ValueError(
                f"max_microbatch_tokens={max_microbatch_tokens}: must be >= block_size={block_size}"
            )
        if max_chunks_per_microbatch < 1:
            raise ValueError(f"max_chunks_per_microbatch={max_chunks_per_microbatch}: must be >= 1")
        self._models = models
        self.policy = policy
        self.chunk_tokens = chunk_tokens
        self.block_size = block_size
        self.max_chunks_per_microbatch = max_chunks_per_microbatch
        self.max_microbatch_tokens = max_microbatch_tokens
        self.fill_idle_stages = (
            policy == "dynamic" if fill_idle_stages is None else fill_idle_stages
        )
        self.budget_accounting: BudgetAccounting = budget_accounting
        self.one_chunk_inflight = one_chunk_inflight

    def may_cut(self, num_inflight_microbatches: int) -> bool:
        """Whether a request with ``num_inflight_microbatches`` micro-batches in flight may get
        another chunk now (always, unless ``one_chunk_inflight``)."""
        return not (self.one_chunk_inflight and num_inflight_microbatches)

    @property
    def cost_models(self) -> tuple[CostModel, ...]:
        """The stage cost models the planner budgets against."""
        return self._models

    def target_cost_s(self) -> float:
        """Cost on the slowest stage of one micro-batch of chunk_tokens new tokens at L = 0.

        The dynamic policy's per-micro-batch target (before the at-least-S rule); for static it
        is the cost of the first chunk of a fresh prompt, for reference.
        """
        return max(model.microbatch_cost_s([(0, self.chunk_tokens)]) for model in self._models)

    def microbatch_cost_s(self, chunks: Sequence[Chunk]) -> float:
        """Cost of a planned micro-batch on the slowest stage, seconds (0.0 if empty)."""
        pairs = [(chunk.context_offset, chunk.num_tokens) for chunk in chunks]
        return max(model.microbatch_cost_s(pairs) for model in self._models)

    def plan_microbatch(
        self,
        requests: Sequence[RequestProgress],
        *,
        num_stages: int,
        num_inflight: int,
        more_work_queued: bool = False,
        target_cost_s: float | None = None,
    ) -> list[Chunk]:
        """Plan the next micro-batch; see the class docstring for the rules.

        Mutates requests: each planned chunk advances its request's num_computed_tokens by
        num_tokens and num_planned_chunks by 1.

        Args:
            requests: admitted requests in FIFO order (fully planned ones are skipped).
            num_stages: S, pipeline stages (>= 1).
            num_inflight: micro-batches planned and not yet finished on the last stage (>= 0).
            more_work_queued: requests are on their way to admission (queued, agreeing): the
                idle stages will get that work, so the at-least-S rule does not cut the admitted
                work into small micro-batches to fill them (each would pay the fixed cost c, and
                in a closed loop the cut persists: requests finishing together come back
                together).
            target_cost_s: dynamic only: the closed-loop target, seconds on the slowest stage
                per micro-batch (c included); None: the chunk_tokens cost and the at-least-S
                rule.

        Returns:
            The micro-batch's chunks, in request FIFO order; [] when there is no work.

        Raises:
            ValueError: bad counts, duplicate request ids, or a request that is fully cached
                before its first chunk (its last token's logits would never be computed).
        """
        if num_stages < 1:
            raise ValueError(f"num_stages={num_stages}: must be >= 1")
        check_non_negative("num_inflight", num_inflight)
        seen: set[str] = set()
        for request in requests:
            if request.request_id in seen:
                raise ValueError(f"requests: duplicate request_id {request.request_id!r}")
            seen.add(request.request_id)
            if request.is_fully_planned and request.num_planned_chunks == 0:
                raise ValueError(
                    f"request {request.request_id!r}: num_computed_tokens="
                    f"{request.num_computed_tokens} = num_prompt_tokens before any chunk; "
                    "admit with at most num_prompt_tokens - 1 cached tokens so the last "
                    "token is computed"
                )
        pending = [request for request in requests if not request.is_fully_planned]
        if not pending:
            return []
        if target_cost_s is not None and not target_cost_s > 0:
            raise ValueError(f"target_cost_s={target_cost_s}: must be > 0 seconds")
        num_idle_stages = (
            num_stages - num_inflight
            if self.fill_idle_stages and not more_work_queued and target_cost_s is None
            else 0
        )
        if self.policy == "static":
            return self._plan_static(pending, num_idle_stages)
        return self._plan_dynamic(pending, num_idle_stages, num_stages, target_cost_s)

    # -- policies ---------------------------------------------------------------------------

    def _plan_static(self, pending: list[RequestProgress], num_idle_stages: int) -> list[Chunk]:
        budget_tokens = min(self.chunk_tokens, self.max_microbatch_tokens)
        if num_idle_stages > 0:
            total = sum(request.num_remaining_tokens for request in pending)
            share = _round_up(-(-total // num_idle_stages), self.block_size)
            budget_tokens = min(budget_tokens, share)
        chunks: list[Chunk] = []
        for request in pending:
            if len(chunks) >= self.max_chunks_per_microbatch or budget_tokens <= 0:
                break
            charged = request.num_charged_tokens
            if request.num_uncredited_tokens and charged > budget_tokens:
                # TRT-LLM FCFS cuts the chunk from the budget left (block units), charges all of
                # it, then shifts the window past the cached prefix: it computes min(k, new).
                charged = budget_tokens // self.block_size * self.block_size
                num_tokens = self._cut(request, min(request.num_remaining_tokens, charged))
            else:
                num_tokens = self._cut(request, min(request.num_remaining_tokens, budget_tokens))
                charged = num_tokens + request.num_uncredited_tokens
            if num_tokens == 0:
                if chunks:
                    continue  # TRT-LLM FCFS: chunk size 0, request not scheduled this time
                num_tokens = self._min_progress(request)
                charged = num_tokens
            chunks.append(self._advance(request, num_tokens))
            budget_tokens -= charged
        return chunks

    def _plan_dynamic(
        self,
        pending: list[RequestProgress],
        num_idle_stages: int,
        num_stages: int = 1,
        target_cost_s: float | None = None,
    ) -> list[Chunk]:
        target_s = self.target_cost_s() if target_cost_s is None else target_cost_s
        # A split target (closed loop, or the at-least-S rule) is c + W/k: k micro-batches that
        # hold the work W, which counts each request's context read g*L once. A cut makes the
        # rest re-pay g*L, so k pieces cost W + (k - 1) g*L and do not fit k budgets of
        # c + W/k: 512 tokens at L = 3,584 came out as 192 + 192 + 128 for k = 2, the
        # extra micro-batch paying c on every stage (tests/sim/test_sim.py). At a split target
        # a chunk may spend the g*L its cut re-pays beyond the budget (``_StageBudgets``).
        is_split_target = target_cost_s is not None
        unsplit_target_s = target_s
        if num_idle_stages > 0:
            shares = []
            for model in self._models:
                work_s = sum(
                    model.chunk_cost_s(request.num_computed_tokens, request.num_remaining_tokens)
                    for request in pending
                )
                num_splits = _best_num_splits(model.c, work_s, num_stages, num_idle_stages)
                # k = 1: no cut. (c + W) - c may round below W and cut a block off the end.
                shares.append(model.c + work_s / num_splits if num_splits > 1 else math.inf)
            is_split_target = max(shares) < target_s
            target_s = min(target_s, max(shares))
        budgets = _StageBudgets(self._models, [target_s - model.c for model in self._models])
        # At-least-S lowered the chunk_tokens target: what a split target adds (the re-paid
        # context, a cut one block further) stays within the unsplit target.
        ceiling = (
            _StageBudgets(self._models, [unsplit_target_s - model.c for model in self._models])
            if target_cost_s is None and is_split_target
            else None
        )
        sliver_s = SLIVER_FRACTION * max(target_s - model.c for model in self._models)
        tokens_left = self.max_microbatch_tokens
        chunks: list[Chunk] = []
        for request in pending:
            if len(chunks) >= self.max_chunks_per_microbatch or tokens_left <= 0:
                break
            remaining = request.num_remaining_tokens
            fit = min(budgets.max_tokens(request.num_computed_tokens, remaining), tokens_left)
            if is_split_target:
                fit = min(
                    budgets.max_tokens(
                        request.num_computed_tokens, remaining, request.num_prompt_tokens
                    ),
                    tokens_left,
                )
                if ceiling is not None:
                    fit = min(fit, ceiling.max_tokens(request.num_computed_tokens, remaining))
            num_tokens = remaining if fit >= remaining else self._cut(request, fit)
            if is_split_target and not chunks and 0 < num_tokens < remaining:
                most = tokens_left
                if ceiling is not None:
                    most = min(most, ceiling.max_tokens(request.num_computed_tokens, remaining))
                num_tokens = self._fewer_pieces(request, num_tokens, fit, most)
            is_full = num_tokens < remaining  # the chunk is cut: the micro-batch is full
            if (
                target_cost_s is not None
                and 0 < num_tokens < remaining <= tokens_left
                and self._cost_s(request.num_computed_tokens + num_tokens, remaining - num_tokens)
                <= sliver_s
            ):
                # NOTE: only the leftover of a request cut here rides along, once per
                # micro-batch; a request that got no tokens waits for the next one.
                num_tokens = remaining
            if num_tokens == 0:
                if chunks:
                    break
                num_tokens = self._min_progress(request)  # first chunk: tokens_left = cap >= B
            budgets.spend(request.num_computed_tokens, num_tokens)
            if ceiling is not None:
                ceiling.spend(request.num_computed_tokens, num_tokens)
            tokens_left -= num_tokens
            chunks.append(self._advance(request, num_tokens))
            if is_full:
                break
        return chunks

    # -- helpers ----------------------------------------------------------------------------

    def _cost_s(self, num_context_tokens: int, num_new_tokens: int) -> float:
        """One chunk's cost without c on the slowest stage, seconds."""
        return max(model.chunk_cost_s(num_context_tokens, num_new_tokens) for model in self._models)

    def request_work_s(self, num_cached_tokens: int, num_prompt_tokens: int) -> float:
        """A whole request's chunk work (one chunk, without c) on the slowest stage, seconds."""
        return self._cost_s(num_cached_tokens, num_prompt_tokens - num_cached_tokens)

    def remaining_work_s(self, requests: Sequence[RequestProgress]) -> float:
        """Chunk work not yet planned of ``requests`` (one chunk each, without c), seconds."""
        return sum(
            self._cost_s(r.num_computed_tokens, r.num_remaining_tokens)
            for r in requests
            if not r.is_fully_planned
        )

    @property
    def fixed_cost_s(self) -> float:
        """c on the slowest stage, seconds per micro-batch."""
        return max(model.c for model in self._models)

    def _cut(self, request: RequestProgress, num_tokens: int) -> int:
        """num_tokens, or fewer so the chunk ends on a block boundary unless it ends the prompt."""
        if num_tokens >= request.num_remaining_tokens:
            return request.num_remaining_tokens
        end = (request.num_computed_tokens + num_tokens) // self.block_size * self.block_size
        return max(0, end - request.num_computed_tokens)

    def _fewer_pieces(
        self, request: RequestProgress, num_tokens: int, fit: int, max_tokens: int
    ) -> int:
        """A split target's cut of a request that fills the micro-batch alone: ``num_tokens``
        (``fit`` rounded down to a block), or one block more when that leaves its rest in
        fewer micro-batches of ``fit`` tokens (e.g. 512 tokens, k = 3, fit 170: 128 x 4 ->
        192 + 192 + 128), never past ``max_tokens``. Each micro-batch saved saves c on every
        stage; the one block over the target costs less."""
        up = self._cut(request, num_tokens + self.block_size)
        if up > max_tokens or up == num_tokens:
            return num_tokens
        remaining = request.num_remaining_tokens
        size = max(fit, self.block_size)

        def pieces(num_left: int) -> int:
            return -(-num_left // size)

        # Only a piece the rounding added: the target meant about remaining / fit pieces (64
        # tokens at 16 per piece stay 4 x 16, not 32 + 16 + 16).
        if 1 + pieces(remaining - num_tokens) <= max(1, round(remaining / size)):
            return num_tokens
        return up if pieces(remaining - up) < pieces(remaining - num_tokens) else num_tokens

    def _min_progress(self, request: RequestProgress) -> int:
        """Tokens up to the next block boundary, or the rest of the prompt (>= 1)."""
        next_boundary = (request.num_computed_tokens // self.block_size + 1) * self.block_size
        return min(request.num_prompt_tokens, next_boundary) - request.num_computed_tokens

    @staticmethod
    def _advance(request: RequestProgress, num_tokens: int) -> Chunk:
        assert 0 < num_tokens <= request.num_remaining_tokens, (
            f"chunk of {num_tokens} tokens for {request.request_id!r} with "
            f"{request.num_remaining_tokens} remaining"
        )
        chunk = Chunk(
            request_id=request.request_id,
            chunk_index=request.num_planned_chunks,
            context_offset=request.num_computed_tokens,
            num_tokens=num_tokens,
            is_last=request.num_computed_tokens + num_tokens == request.num_prompt_tokens,
        )
        request.num_computed_tokens += num_tokens
        request.num_planned_chunks += 1
        return chunk


def _best_num_splits(fixed_s: float, work_s: float, num_stages: int, max_splits: int) -> int:
    """Micro-batches k in [1, max_splits] that finish W seconds of work soonest on S stages.

    Cutting W into k equal micro-batches that each pay the fixed cost c, an otherwise empty
    pipeline finishes after (S - 1 + k) * (c + W / k) seconds (fill and drain of a synchronous
    pipeline, GPipe: Huang et al. 2019, section 2.3). More micro-batches fill more stages but pay
    c more often: with c = 0 the answer is max_splits; with c large next to W, 1. Ties go to
    the larger k.
    """
    return min(
        range(1, max_splits + 1),
        key=lambda k: ((num_stages - 1 + k) * (fixed_s + work_s / k), -k),
    )


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class PlanningSwitches(Protocol):
    """The baseline's planning switches (``runtime.config.BaselineConfig``)."""

    budget_accounting: BudgetAccounting
    one_chunk_inflight: bool


class PlannerSettings(Protocol):
    """What ``planner_for`` reads of a replica's configuration (``runtime.config.RuntimeConfig``,
    which this pure room does not import)."""

    chunk_tokens: int
    block_size: int
    max_microbatch_tokens: int

    @property
    def resolved_chunk_policy(self) -> Literal["dynamic", "static"]: ...

    @property
    def resolved_baseline(self) -> PlanningSwitches: ...


def planner_for(
    config: PlannerSettings, cost_model: CostModel | Sequence[CostModel]
) -> ChunkPlanner:
    """The replica's chunk planner: policy, chunk size, block size and largest micro-batch from
    ``config``, and the baseline's planning switches as they apply
    (``RuntimeConfig.resolved_baseline``: budget accounting, one chunk in flight);
    ``cost_model`` is the slowest stage's (or one per stage)."""
    baseline = config.resolved_baseline
    return ChunkPlanner(
        cost_model,
        policy=config.resolved_chunk_policy,
        chunk_tokens=config.chunk_tokens,
        block_size=config.block_size,
        max_microbatch_tokens=config.max_microbatch_tokens,
        budget_accounting=baseline.budget_accounting,
        one_chunk_inflight=baseline.one_chunk_inflight,
    )
