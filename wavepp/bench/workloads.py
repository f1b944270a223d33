"""Benchmark workloads: the Mooncake trace, and a generator with controlled prefix reuse.

Pure logic: no I/O except reading a trace file in ``mooncake_workload``.

Controlled reuse (``shared_prefix_workload``): ``num_prefixes`` shared prefixes (system prompts,
documents) of ``num_prefix_tokens`` each; every request is one prefix (round-robin) followed by a
unique suffix of ``num_suffix_tokens``::

    request i:  [ prefix[i % num_prefixes] (shared) | suffix_i (unique) ]
                 num_prefix_tokens                    num_suffix_tokens

Reuse is *defined by the measured token hit ratio*, not by the knobs: ``ideal_hit_ratio`` replays
the prompts through an unbounded cache in order (block-granular, whole blocks only, at least one
token computed per request) and counts the cached tokens; a run's measured ratio is
``cached_tokens / prompt_tokens`` from the replay summary. The presets ``REUSE_PRESETS`` give
"low" (ideal ~0.2, below 0.4) and "high" (ideal ~0.85, at least 0.6).

A workload may carry warm-up prompts (one per shared prefix): a server under steady reuse already
holds its popular prefixes, so the benchmark runs them first, outside the measured window.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from wavepp.bench.trace import TokenMapper, load_trace


@dataclass(frozen=True)
class ReusePreset:
    """Knobs of ``shared_prefix_workload`` for one reuse level (token counts)."""

    num_prefix_tokens: int
    num_suffix_tokens: int
    num_prefixes: int


# "low" and "high": prompt length 4096 tokens, only the shared fraction differs. "agentic" and
# "chat": where admission cadence binds (long shared prefixes, short new suffixes): an agent's
# 32k-token context (tools, history) at 95 % reuse, and 8k-token chat turns at 97 %, each new
# token costing little next to the attention over the cached context.
REUSE_PRESETS: dict[str, ReusePreset] = {
    "low": ReusePreset(num_prefix_tokens=1024, num_suffix_tokens=3072, num_prefixes=8),
    "high": ReusePreset(num_prefix_tokens=3584, num_suffix_tokens=512, num_prefixes=8),
    "agentic": ReusePreset(num_prefix_tokens=31232, num_suffix_tokens=1536, num_prefixes=8),
    "chat": ReusePreset(num_prefix_tokens=7936, num_suffix_tokens=256, num_prefixes=32),
}


@dataclass
class Workload:
    """Prompts to replay, in order.

    Attributes:
        name: what it is ("shared-prefix high", "mooncake 200").
        prompts: token ids per request.
        warmup: prompts run before the measured window (not counted).
        request_ids: one per prompt (unique).
    """

    name: str
    prompts: list[list[int]]
    warmup: list[list[int]] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.request_ids:
            self.request_ids = [f"req-{i}" for i in range(len(self.prompts))]
        if len(self.request_ids) != len(self.prompts):
            raise ValueError(
                f"request_ids has {len(self.request_ids)} entries; prompts has {len(self.prompts)}"
            )

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def _random_tokens(rng: np.random.Generator, num_tokens: int, vocab_size: int) -> list[int]:
    return rng.integers(0, vocab_size, num_tokens).tolist()


def shared_prefix_workload(
    num_requests: int,
    *,
    num_prefix_tokens: int,
    num_suffix_tokens: int,
    num_prefixes: int,
    vocab_size: int = 32000,
    seed: int = 0,
    warm: bool = True,
    name: str = "",
) -> Workload:
    """Shared prefixes plus unique suffixes (module docstring).

    Args:
        num_requests: measured requests (>= 1).
        num_prefix_tokens: tokens of each shared prefix (>= 0).
        num_suffix_tokens: tokens of each request's unique suffix (>= 1).
        num_prefixes: distinct shared prefixes, used round-robin (>= 1).
        vocab_size: token ids drawn from [0, vocab_size) (>= 2).
        seed: seeds every token (same seed, same workload).
        warm: add one warm-up prompt per prefix (the prefix plus one token).
        name: label; default names the knobs.

    Returns:
        The workload; ``len(prompts) == num_requests``, each of num_prefix + num_suffix tokens.

    Raises:
        ValueError: a count outside its range (the message names it).
    """
    for label, value, low in (
        ("num_requests", num_requests, 1),
        ("num_prefix_tokens", num_prefix_tokens, 0),
        ("num_suffix_tokens", num_suffix_tokens, 1),
        ("num_prefixes", num_prefixes, 1),
        ("vocab_size", vocab_size, 2),
    ):
        if value < low:
            raise ValueError(f"{label}={value}: must be >= {low}")
    rng = np.random.Generator(np.random.PCG64([seed, 0x5EED]))
    prefixes = [_random_tokens(rng, num_prefix_tokens, vocab_size) for _ in range(num_prefixes)]
    prompts = [
        prefixes[i % num_prefixes] + _random_tokens(rng, num_suffix_tokens, vocab_size)
        for i in range(num_requests)
    ]
    warmup = [p + _random_tokens(rng, 1, vocab_size) for p in prefixes] if warm else []
    return Workload(
        name=name
        or f"shared-prefix {num_prefixes}x{num_prefix_tokens} + unique {num_suffix_tokens}",
        prompts=prompts,
        warmup=warmup if num_prefix_tokens else [],
        request_ids=[f"sp-{seed}-{i}" for i in range(num_requests)],
    )


def preset_workload(
    reuse: str,
    num_requests: int,
    *,
    vocab_size: int = 32000,
    seed: int = 0,
    prompt_tokens: int = 0,
) -> Workload:
    """``shared_prefix_workload`` with the knobs of ``REUSE_PRESETS[reuse]``; ``prompt_tokens``
    > 0 scales the prefix and suffix lengths by ``prompt_tokens / 4096`` (the "low" and "high"
    prompt length; rounded down, the suffix at least 1 token), 0 keeps them.

    Raises:
        ValueError: unknown reuse level.
    """
    if reuse not in REUSE_PRESETS:
        raise ValueError(f"reuse={reuse!r}: choose one of {sorted(REUSE_PRESETS)}")
    p = REUSE_PRESETS[reuse]
    factor = prompt_tokens / 4096 if prompt_tokens else 1.0
    prefix = int(p.num_prefix_tokens * factor)
    suffix = max(1, int(p.num_suffix_tokens * factor))
    return shared_prefix_workload(
        num_requests,
        num_prefix_tokens=prefix,
        num_suffix_tokens=suffix,
        num_prefixes=p.num_prefixes,
        vocab_size=vocab_size,
        seed=seed,
        name=f"{reuse} reuse: {p.num_prefixes} prefixes x {prefix} + unique {suffix} tokens",
    )


def mooncake_workload(
    path: str | Path,
    limit: int | None,
    *,
    tokens_per_block: int = 512,
    vocab_size: int = 32000,
    seed: int = 0,
) -> Workload:
    """The first ``limit`` valid requests of a Mooncake trace (None: all of them; no warm-up: the
    trace's own reuse).

    Raises:
        FileNotFoundError: no such trace.
        ValueError: limit < 1 or a bad tokens_per_block.
    """
    records, _invalid = load_trace(path, limit)
    mapper = TokenMapper(tokens_per_block, vocab_size, seed=seed)
    return Workload(
        name=f"mooncake {Path(path).name} " + (f"first {limit}" if limit else "all"),
        prompts=[mapper.prompt(r) for r in records],
        request_ids=[f"trace-{r.line_no}" for r in records],
    )


def ideal_cached_tokens(
    prompts: Sequence[Sequence[int]], block_size: int, warmup: Sequence[Sequence[int]] = ()
) -> list[int]:
    """Cached tokens of each prompt replayed in order through an unbounded prefix cache.

    Block-granular (whole blocks only, like the runtime) and capped one token short of each
    prompt (at least one token is computed). Warm-up prompts fill the cache first. Prefix
    identity is the token sequence itself (as the chained block hash), each block keyed by
    Python's 64-bit hash of its tokens under its parent's key (a whole trace's blocks then
    take megabytes, not a copy of every distinct block; a collision, odds about
    n^2 / 2^64 for n distinct blocks, would count a miss as a hit).

    Args:
        prompts: token ids per request.
        block_size: tokens per block (>= 1).
        warmup: prompts cached before the first one.

    Returns:
        One count per prompt, tokens, each in [0, len(prompt)).

    Raises:
        ValueError: block_size < 1.
    """
    if block_size < 1:
        raise ValueError(f"block_size={block_size}: must be >= 1")
    ids: dict[tuple[int, int], int] = {}  # (parent id, hash of the block's tokens) -> id
    cached: set[int] = set()

    def blocks(prompt: Sequence[int]) -> list[int]:
        parent, keys = -1, []
        for start in range(0, len(prompt) - block_size + 1, block_size):
            block = hash(tuple(prompt[start : start + block_size]))
            parent = ids.setdefault((parent, block), len(ids))
            keys.append(parent)
        return keys

    for prompt in warmup:
        cached.update(blocks(prompt))
    result = []
    for prompt in prompts:
        keys = blocks(prompt)
        num_hit = 0
        for key in keys:
            if key not in cached:
                break
            num_hit += 1
        num_hit = min(num_hit, max(0, (len(prompt) - 1) // block_size))
        result.append(num_hit * block_size)
        cached.update(keys)
    return result


def ideal_hit_ratio(
    prompts: Sequence[Sequence[int]], block_size: int, warmup: Sequence[Sequence[int]] = ()
) -> float:
    """Token hit ratio of ``prompts`` replayed in order through an unbounded prefix cache
    (``ideal_cached_tokens`` over the prompt tokens).

    Returns:
        cached tokens / prompt tokens in [0, 1); 0.0 for no tokens.

    Raises:
        ValueError: block_size < 1.
    """
    num_total = sum(len(p) for p in prompts)
    if not num_total:
        if block_size < 1:
            raise ValueError(f"block_size={block_size}: must be >= 1")
        return 0.0
    return sum(ideal_cached_tokens(prompts, block_size, warmup)) / num_total
