"""Mooncake trace loading and the hash-id -> token mapping that reproduces its prefix reuse.

Format (data/traces/README.md in the repository): one JSON object per line,
``{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [int, ...]}``
with 512 tokens per hash id and ``len(hash_ids) == ceil(input_length / 512)``.

Token mapping: each hash id becomes a fixed sequence of ``tokens_per_block`` token ids drawn from
``numpy.random.Generator(PCG64([seed, hash_id]))``, so equal ids give equal tokens and the trace's
prefix reuse is reproduced exactly. With ``tokens_per_block`` K < 512 a prompt is scaled down by
K/512: every full trace block gives K tokens, the last (partial) block gives
``ceil(rest * K / 512)`` tokens (at least 1)::

    hash_ids:  [ h0 ][ h1 ] ... [ h_{n-2} ][ h_{n-1} (partial: rest of input_length) ]
    tokens:    [ K  ][ K  ] ... [    K    ][ ceil(rest*K/512) ]
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TRACE_TOKENS_PER_BLOCK = 512


@dataclass(frozen=True)
class TraceRecord:
    line_no: int
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True)
class TraceError:
    line_no: int
    field: str
    message: str

    def __str__(self) -> str:
        return f"line {self.line_no}: field {self.field!r}: {self.message}"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_trace_line(line: str, line_no: int) -> TraceRecord | TraceError:
    """Validate one trace line. Returns a record, or an error naming the line and the field."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        return TraceError(line_no, "<line>", f"not valid JSON: {exc.msg} at column {exc.colno}")
    if not isinstance(obj, dict):
        return TraceError(line_no, "<line>", f"expected a JSON object, got {type(obj).__name__}")
    for name in ("timestamp", "input_length", "hash_ids"):
        if name not in obj:
            return TraceError(line_no, name, "missing")
    timestamp = obj["timestamp"]
    # NOTE: json.loads accepts NaN and Infinity; int() of either raises, so refuse them here.
    is_number = _is_int(timestamp) or (isinstance(timestamp, float) and math.isfinite(timestamp))
    if not is_number or timestamp < 0:
        return TraceError(line_no, "timestamp", f"must be a number >= 0 (ms), got {timestamp!r}")
    input_length = obj["input_length"]
    if not _is_int(input_length) or input_length < 1:
        return TraceError(line_no, "input_length", f"must be an integer >= 1, got {input_length!r}")
    output_length = obj.get("output_length", 0)
    if not _is_int(output_length) or output_length < 0:
        return TraceError(
            line_no, "output_length", f"must be an integer >= 0, got {output_length!r}"
        )
    hash_ids = obj["hash_ids"]
    if not isinstance(hash_ids, list) or not all(_is_int(h) and h >= 0 for h in hash_ids):
        return TraceError(line_no, "hash_ids", "must be a list of integers >= 0")
    expected = math.ceil(input_length / TRACE_TOKENS_PER_BLOCK)
    if len(hash_ids) != expected:
        return TraceError(
            line_no,
            "hash_ids",
            f"has {len(hash_ids)} ids; input_length {input_length} needs "
            f"ceil({input_length}/{TRACE_TOKENS_PER_BLOCK}) = {expected}",
        )
    return TraceRecord(line_no, int(timestamp), input_length, output_length, tuple(hash_ids))


def iter_trace(path: str | Path, limit: int | None = None) -> Iterator[TraceRecord | TraceError]:
    """Yield records (or errors) for the first ``limit`` non-empty lines of a trace file.

    Raises:
        FileNotFoundError: the trace file does not exist.
        ValueError: ``limit`` < 1.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit={limit}: must be >= 1")
    count = 0
    with open(path, encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            yield parse_trace_line(line, line_no)
            count += 1
            if limit is not None and count >= limit:
                return


def load_trace(
    path: str | Path, limit: int | None = None
) -> tuple[list[TraceRecord], list[TraceError]]:
    records: list[TraceRecord] = []
    errors: list[TraceError] = []
    for item in iter_trace(path, limit):
        (errors if isinstance(item, TraceError) else records).append(item)  # type: ignore[arg-type]
    return records, errors


class TokenMapper:
    """Maps trace hash ids to fixed token sequences (see the module docstring).

    Args:
        tokens_per_block: tokens per trace block, 1..512 (512 is the trace's own).
        vocab_size: token ids are drawn from [0, vocab_size).
        seed: mixes into every block's generator.
    """

    def __init__(self, tokens_per_block: int, vocab_size: int, seed: int = 0) -> None:
        if not 1 <= tokens_per_block <= TRACE_TOKENS_PER_BLOCK:
            raise ValueError(
                f"tokens_per_block={tokens_per_block}: must be in [1, {TRACE_TOKENS_PER_BLOCK}]"
            )
        if vocab_size < 2:
            raise ValueError(f"vocab_size={vocab_size}: must be >= 2")
        self.tokens_per_block = tokens_per_block
        self.vocab_size = vocab_size
        self.seed = seed
        self._cache: dict[int, list[int]] = {}

    def block_tokens(self, hash_id: int) -> list[int]:
        tokens = self._cache.get(hash_id)
        if tokens is None:
            rng = np.random.Generator(np.random.PCG64([self.seed, hash_id]))
            tokens = rng.integers(0, self.vocab_size, self.tokens_per_block).tolist()
            self._cache[hash_id] = tokens
        return tokens

    def num_tokens(self, record: TraceRecord) -> int:
        k = self.tokens_per_block
        rest = record.input_length - (len(record.hash_ids) - 1) * TRACE_TOKENS_PER_BLOCK
        last = max(1, math.ceil(rest * k / TRACE_TOKENS_PER_BLOCK))
        return (len(record.hash_ids) - 1) * k + last

    def prompt(self, record: TraceRecord) -> list[int]:
        """The prompt's token ids; length ``num_tokens(record)``."""
        tokens: list[int] = []
        for hash_id in record.hash_ids:
            tokens.extend(self.block_tokens(hash_id))
        return tokens[: self.num_tokens(record)]
