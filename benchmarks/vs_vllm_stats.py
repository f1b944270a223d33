"""The pure parts of ``benchmarks/vs_vllm.py``: its prompts, KV capacity, statistics, table and
JSON (no processes, no network; the file-reading ``trace_prompts`` aside, no I/O).

Throughput is prompt tokens (cached and new) of the answered requests per second of a run's wall
time; a server's figure at a concurrency is the median over its repeats, and ``ratio`` is
WavePP's median over vLLM's. TTFT is a request's latency (one output token). A first-token
mismatch is a prompt whose greedy first token is not the same in every run of one round (both
servers, the same prompts).
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from wavepp.bench.workloads import mooncake_workload

SERVERS = ("vllm", "wavepp")


def trace_prompts(
    path: str | Path, requests: int, *, tokens_per_block: int, vocab_size: int, seed: int
) -> list[list[int]]:
    """Token-id prompts of the first ``requests`` valid records of a Mooncake trace.

    Every trace block becomes ``tokens_per_block`` token ids in [0, vocab_size) drawn from
    (seed, hash id), so equal block ids give equal tokens and the trace's prefix reuse is kept
    (``wavepp.bench.trace``). Raises FileNotFoundError (no trace) or ValueError (requests < 1,
    tokens_per_block outside [1, 512], vocab_size < 2, or a trace with no valid record).
    """
    prompts = mooncake_workload(
        path, requests, tokens_per_block=tokens_per_block, vocab_size=vocab_size, seed=seed
    ).prompts
    if not prompts:
        raise ValueError(f"trace {path}: no valid record in its first {requests} lines")
    return prompts


def round_seed(concurrency_index: int, repeat: int, repeats: int) -> int:
    """The token seed of one (concurrency, repeat) round: distinct for every round, and never
    0 (the warm-up's seed)."""
    return 1 + concurrency_index * repeats + repeat


def kv_capacity_tokens(
    cache_bytes: int, *, layers_per_stage: int, kv_heads: int, head_dim: int, dtype_bytes: int
) -> int:
    """Tokens of KV a stage holds in ``cache_bytes``: one token costs K and V of every layer,
    ``2 x kv_heads x head_dim x dtype_bytes`` bytes each (1 GiB, 4 layers, 2 x 64, float32:
    262,144 tokens). Raises ValueError naming a value < 1."""
    for name, value in (
        ("cache_bytes", cache_bytes),
        ("layers_per_stage", layers_per_stage),
        ("kv_heads", kv_heads),
        ("head_dim", head_dim),
        ("dtype_bytes", dtype_bytes),
    ):
        if value < 1:
            raise ValueError(f"{name}={value}: must be >= 1")
    return cache_bytes // (2 * kv_heads * head_dim * dtype_bytes * layers_per_stage)


_BLOCKS_RE = re.compile(r'^vllm:cache_config_info\{[^}]*\bnum_gpu_blocks="(\d+)"', re.MULTILINE)


def vllm_num_blocks(metrics_text: str) -> int | None:
    """KV blocks per stage from vLLM's Prometheus text (``vllm:cache_config_info``'s
    ``num_gpu_blocks`` label); None when absent."""
    match = _BLOCKS_RE.search(metrics_text)
    return int(match.group(1)) if match else None


@dataclass
class RunResult:
    """One server's run of one round: ``first_tokens[i]`` / ``ttfts_s[i]`` belong to prompt i
    (None / NaN where it failed); ``cached_tokens`` None when the server reports none."""

    server: str
    concurrency: int
    repeat: int
    wall_s: float
    prompt_tokens: int
    cached_tokens: int | None
    ttfts_s: list[float]
    first_tokens: list[int | None]
    errors: int = 0
    first_error: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.prompt_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def cached_fraction(self) -> float | None:
        if self.cached_tokens is None or not self.prompt_tokens:
            return None
        return self.cached_tokens / self.prompt_tokens


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (numpy's linear interpolation) of the finite values; None if none."""
    finite = [v for v in values if np.isfinite(v)]
    return float(np.percentile(finite, q)) if finite else None


def first_token_mismatches(runs: Sequence[RunResult]) -> tuple[int, int]:
    """(mismatches, compared) over the prompts of runs of the same prompts: ``compared`` counts
    the prompts every run answered with a token, ``mismatches`` the prompts whose answered
    first tokens are not all equal (a failed answer is neither). Raises ValueError when the
    runs hold different numbers of prompts."""
    if not runs:
        return 0, 0
    sizes = {len(r.first_tokens) for r in runs}
    if len(sizes) != 1:
        raise ValueError(f"runs hold {sorted(sizes)} prompts; compare runs of the same prompts")
    mismatches = compared = 0
    for i in range(sizes.pop()):
        answered = [r.first_tokens[i] for r in runs if r.first_tokens[i] is not None]
        mismatches += len(set(answered)) > 1
        compared += len(answered) == len(runs)
    return mismatches, compared


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def server_summary(runs: Sequence[RunResult]) -> dict[str, Any]:
    """One server at one concurrency: per-run and median tokens/s, TTFT p50/p99 over every
    request of its runs, the cached fraction over all its runs (None when unreported) and the
    error count."""
    ttfts = [t for r in runs for t in r.ttfts_s]
    reported = [r for r in runs if r.cached_tokens is not None]
    prompt = sum(r.prompt_tokens for r in reported)
    cached = sum(r.cached_tokens or 0 for r in reported)
    first_error = next((r.first_error for r in runs if r.first_error), "")
    return {
        "tokens_per_s": [round(r.tokens_per_s, 1) for r in runs],
        "median_tokens_per_s": round(statistics.median(r.tokens_per_s for r in runs), 1),
        "ttft_p50_s": _round(percentile(ttfts, 50), 4),
        "ttft_p99_s": _round(percentile(ttfts, 99), 4),
        "cached_fraction": round(cached / prompt, 4) if reported and prompt else None,
        "errors": sum(r.errors for r in runs),
        **({"first_error": first_error} if first_error else {}),
    }


def summarize(runs: Sequence[RunResult]) -> list[dict[str, Any]]:
    """One row per concurrency (ascending): each server's ``server_summary``, ``ratio`` =
    WavePP's median tokens/s over vLLM's (None when vLLM's is 0), and the first-token
    mismatches and compared prompts (``first_token_mismatches``) summed over its rounds. Raises ValueError when a concurrency lacks a
    server's runs."""
    rows = []
    for c in sorted({r.concurrency for r in runs}):
        at_c = [r for r in runs if r.concurrency == c]
        row: dict[str, Any] = {"concurrency": c}
        for server in SERVERS:
            mine = [r for r in at_c if r.server == server]
            if not mine:
                raise ValueError(f"concurrency {c}: no {server} run")
            row[server] = server_summary(mine)
        base = row["vllm"]["median_tokens_per_s"]
        row["ratio"] = round(row["wavepp"]["median_tokens_per_s"] / base, 4) if base else None
        counts = [
            first_token_mismatches([r for r in at_c if r.repeat == rep])
            for rep in sorted({r.repeat for r in at_c})
        ]
        row["first_token_mismatches"] = sum(m for m, _ in counts)
        row["first_tokens_compared"] = sum(n for _, n in counts)
        rows.append(row)
    return rows


def report_json(
    rows: list[dict[str, Any]], setup: dict[str, Any], runs: Sequence[RunResult]
) -> dict[str, Any]:
    """The ``--json`` object: ``setup`` (checkpoint, prompts, start-up seconds, KV blocks),
    ``results`` (``summarize``'s rows) and ``runs`` (one entry per timed run, in run order)."""
    return {
        "benchmark": "vs_vllm",
        "setup": setup,
        "results": rows,
        "runs": [
            {
                "server": r.server,
                "concurrency": r.concurrency,
                "repeat": r.repeat,
                "tokens_per_s": round(r.tokens_per_s, 1),
                "wall_s": round(r.wall_s, 3),
                "prompt_tokens": r.prompt_tokens,
                "cached_fraction": _round(r.cached_fraction, 4),
                "errors": r.errors,
            }
            for r in runs
        ],
    }


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The human table: one line per concurrency."""
    head = (
        f"{'C':>4} | {'vLLM tok/s':>10} | {'WavePP tok/s':>12} | {'ratio':>6} | "
        f"{'TTFT p50/p99 s vLLM':>19} | {'WavePP':>13} | {'cached vLLM/WavePP':>18} | "
        f"{'mismatch':>13} | errors"
    )
    lines = [head, "-" * len(head)]
    for row in rows:
        v, w = row["vllm"], row["wavepp"]
        lines.append(
            f"{row['concurrency']:>4} | {v['median_tokens_per_s']:>10,.0f} | "
            f"{w['median_tokens_per_s']:>12,.0f} | {_fmt(row['ratio'], '.3f'):>6} | "
            f"{_fmt(v['ttft_p50_s'], '.3f'):>9}/{_fmt(v['ttft_p99_s'], '.3f'):<9} | "
            f"{_fmt(w['ttft_p50_s'], '.3f'):>6}/{_fmt(w['ttft_p99_s'], '.3f'):<6} | "
            f"{_fmt(v['cached_fraction'], '.3f'):>8} / {_fmt(w['cached_fraction'], '.3f'):<7} | "
            f"{row['first_token_mismatches']:>4} of {row['first_tokens_compared']:<5} | "
            f"{v['errors']} / {w['errors']}"
        )
    return lines


def parse_concurrency(text: str) -> list[int]:
    """``"8,32"`` -> [8, 32]. Raises ValueError naming the flag for a value < 1 or no value."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--concurrency {text!r}: give integers >= 1, comma-separated") from None
    if not values or min(values) < 1:
        raise ValueError(f"--concurrency {text!r}: give integers >= 1, comma-separated")
    return values
