"""The stage side of one admission round, alone: CPU per request of ``handle_kv_batch``.

One stage's ``StageKVManager`` (pool sized for the run), 4096-token prompts in 64-token blocks,
``--rounds`` rounds of ``--batch`` requests: each round's probe-reserve batch, encoded as a
controller sends it; each round released a few rounds later in a release batch, as
``wavepp bench agreement`` does. Workloads as that benchmark's: ``short-suffix`` (8 prefixes of
3,904 tokens cached first, a new 192-token suffix each: 61 of 64 blocks hit) and ``mixed``
(nothing cached; half the prompts share a 2,048-token prefix). Only the handler calls are timed
(``time.process_time``, the garbage collector's generations frozen after set-up, as the stage
process does); encoding the batches and reading the replies are not.

    python benchmarks/kv_handler_micro.py
    python benchmarks/kv_handler_micro.py --batch 16,64 --rounds 40 --workload mixed

Run it with ``PYTHONPATH`` at another checkout to compare versions. This is a benchmark, not a
test: it prints microseconds per request per stage; it asserts nothing but the reservations'
success.
"""

from __future__ import annotations

import argparse
import gc
import time

import numpy as np

from wavepp.api.kv_batch import BatchOp, KVBatch, ReserveEntry, encode_batch
from wavepp.api.kv_reply import decode_reply
from wavepp.runtime.agreement.stage_handler import handle_kv_batch
from wavepp.runtime.kv import BlockPool, StageKVManager, hash_prompt_blocks

BLOCK_SIZE = 64
PROMPT_TOKENS = 4096
SUFFIX_TOKENS = 192
MODEL_ID = "micro"


def prompts(workload: str, num_requests: int) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, prefixes to cache first), as ``wavepp.bench.agreement``'s workloads."""
    rng = np.random.Generator(np.random.PCG64(1))
    if workload == "mixed":
        shared = rng.integers(0, 32000, PROMPT_TOKENS // 2).tolist()
        return [
            (shared if i % 2 else [])
            + rng.integers(0, 32000, PROMPT_TOKENS - (len(shared) if i % 2 else 0)).tolist()
            for i in range(num_requests)
        ], []
    prefixes = [rng.integers(0, 32000, PROMPT_TOKENS - SUFFIX_TOKENS).tolist() for _ in range(8)]
    return [
        prefixes[i % 8] + rng.integers(0, 32000, SUFFIX_TOKENS).tolist()
        for i in range(num_requests)
    ], prefixes


def measure(workload: str, batch: int, rounds: int, held_rounds: int = 8) -> dict[str, float]:
    """Microseconds of CPU per request per stage: probe-reserve, release (steady state: the
    round from ``held_rounds`` rounds ago is released after each round, as
    ``wavepp bench agreement`` releases what its replica no longer holds)."""
    all_prompts, prefixes = prompts(workload, batch * rounds)
    hashes = [hash_prompt_blocks(p, BLOCK_SIZE, MODEL_ID) for p in all_prompts]
    blocks_per_prompt = PROMPT_TOKENS // BLOCK_SIZE + 1
    manager = StageKVManager(
        BlockPool((batch * (held_rounds + 1) + len(prefixes)) * blocks_per_prompt + 64, BLOCK_SIZE)
    )
    for index, prefix in enumerate(prefixes):
        prefix_hashes = hash_prompt_blocks([*prefix, 0], BLOCK_SIZE, MODEL_ID)
        manager.probe_pin(f"warm-{index}", prefix_hashes, 30.0)
        manager.reserve(f"warm-{index}", len(prefix_hashes) + 1, 30.0)
        manager.mark_computed(f"warm-{index}", len(prefix_hashes) * BLOCK_SIZE, prefix_hashes)
        manager.release(f"warm-{index}")
    seq = 0
    spent = {"probe_reserve": 0.0, "release": 0.0}
    gc.freeze()
    try:
        for r in range(rounds + held_rounds):
            if r < rounds:
                ids = [f"r{r}-{i}" for i in range(batch)]
                entries = tuple(
                    ReserveEntry(i, tuple(h), blocks_per_prompt)
                    for i, h in zip(ids, hashes[r * batch :], strict=False)
                )
                seq += 1
                batch_bytes = encode_batch(
                    KVBatch(BatchOp.PROBE_RESERVE, entries, 10.0, "owner", seq)
                )
                started = time.process_time()
                reply = handle_kv_batch(manager, 0, batch_bytes)
                spent["probe_reserve"] += time.process_time() - started
                if not all(result.ok for result in decode_reply(reply).results):
                    raise RuntimeError("a reservation was refused: the pool is too small")
            if r >= held_rounds:
                seq += 1
                old = r - held_rounds
                release = encode_batch(
                    KVBatch(
                        BatchOp.RELEASE, tuple(f"r{old}-{i}" for i in range(batch)), 0.0,
                        "owner", seq,
                    )
                )  # fmt: skip
                started = time.process_time()
                handle_kv_batch(manager, 0, release)
                spent["release"] += time.process_time() - started
    finally:
        gc.unfreeze()
    return {op: seconds / (batch * rounds) * 1e6 for op, seconds in spent.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="short-suffix,mixed")
    parser.add_argument("--batch", default="16,64", help="requests per round, comma-separated")
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args(argv)
    for workload in args.workload.split(","):
        for batch in (int(b) for b in args.batch.split(",")):
            us = measure(workload, batch, args.rounds)
            print(
                f"{workload:12s} batch {batch:3d}: probe-reserve {us['probe_reserve']:6.1f} us  "
                f"release {us['release']:6.1f} us  (both "
                f"{us['probe_reserve'] + us['release']:6.1f}) per request per stage"
            )


if __name__ == "__main__":
    main()
