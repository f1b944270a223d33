"""The layout grid at H200 time: PP wave and sync against TP/TEP (and PP x TP/TEP) replicas of the
same GPUs, per setting, on the simulator (``wavepp sim --parallel``, one subprocess per setting).

    python benchmarks/layouts_grid.py --model kimi-k3 \\
        --parallel pp8xtp2-wave,pp8xtp2-sync,pp2xtp8-sync \\
        --concurrency 1,2,4,8,16,32,64 --reuse low,high --prompt-tokens 8192,32768 \\
        --requests-per-c 8 --min-requests 32 --out docs/bench/layouts_kimi-k3.csv \\
        -- --baseline-budget exact
    python benchmarks/layouts_grid.py --summarize docs/bench/layouts_kimi-k3.csv --wave pp8xtp2-wave

Each setting runs max(--min-requests, --requests-per-c x C) requests. The CSV holds one row per
layout and setting (``wavepp sim --json``'s keys); ``--summarize`` prints, per setting, the
throughput and TTFT p50 of every layout, which layout wins each, and the count of settings at
C >= 8 where the wave layout has the highest throughput. A benchmark: it measures and prints;
it asserts nothing.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import time
from pathlib import Path

FIELDS = (
    "model",
    "parallel",
    "gpus",
    "concurrency",
    "reuse",
    "prompt_tokens",
    "requests",
    "completed",
    "throughput_tokens_per_s",
    "bound_tokens_per_s",
    "efficiency",
    "ttft_p50_s",
    "ttft_p99_s",
    "cache_hit_ratio",
)


def run(args: argparse.Namespace) -> None:
    out = Path(args.out)
    done: set[tuple[str, int, str, int]] = set()
    if out.exists():
        with out.open() as f:
            for row in csv.DictReader(f):
                done.add(
                    (
                        row["parallel"],
                        int(row["concurrency"]),
                        row["reuse"],
                        int(row["prompt_tokens"]),
                    )
                )
    new_file = not out.exists()
    with out.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        if new_file:
            writer.writeheader()
        for prompt in (int(p) for p in args.prompt_tokens.split(",")):
            for reuse in args.reuse.split(","):
                for c in (int(x) for x in args.concurrency.split(",")):
                    labels = args.parallel.split(",")
                    if all((label, c, reuse, prompt) in done for label in labels):
                        continue
                    requests = max(args.min_requests, args.requests_per_c * c)
                    argv = [
                        sys.executable, "-m", "wavepp.cli", "sim", "--model", args.model,
                        "--parallel", args.parallel, "--concurrency", str(c), "--reuse", reuse,
                        "--prompt-tokens", str(prompt), "--requests", str(requests), "--json",
                        *args.extra,
                    ]  # fmt: skip
                    start = time.monotonic()
                    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
                    if proc.returncode != 0:
                        print(proc.stderr, file=sys.stderr)
                        raise SystemExit(proc.returncode)
                    for row in json.loads(proc.stdout.strip().splitlines()[-1]):
                        writer.writerow(row)
                    f.flush()
                    print(
                        f"{args.model} C={c} {reuse} {prompt}: {time.monotonic() - start:.0f} s",
                        file=sys.stderr,
                        flush=True,
                    )


def summarize(path: str, wave: str, min_c: int) -> None:
    with open(path) as f:
        rows = list(csv.DictReader(f))
    settings: dict[tuple[int, str, int], list[dict[str, str]]] = {}
    for row in rows:
        key = (int(row["prompt_tokens"]), row["reuse"], int(row["concurrency"]))
        settings.setdefault(key, []).append(row)
    labels = list(dict.fromkeys(row["parallel"] for row in rows))
    model = rows[0]["model"]
    print(
        f"{model}, {rows[0]['gpus']} H200. Cells: tok/s / TTFT p50 s.\n\n"
        "| prompt | reuse | C | "
        + " | ".join(labels)
        + " | best tok/s | best TTFT p50 |\n| ---: | --- | ---: | "
        + " | ".join("---" for _ in labels)
        + " | --- | --- |"
    )
    wins = total = 0
    for (prompt, reuse, c), group in sorted(settings.items()):
        by = {row["parallel"]: row for row in group}
        best_t = max(group, key=lambda r: float(r["throughput_tokens_per_s"]))["parallel"]
        best_l = min(group, key=lambda r: float(r["ttft_p50_s"]))["parallel"]
        cells = [
            f"{float(by[label]['throughput_tokens_per_s']):.0f} / "
            f"{float(by[label]['ttft_p50_s']):.2f}"
            if label in by
            else "-"
            for label in labels
        ]
        print(f"| {prompt} | {reuse} | {c} | " + " | ".join(cells) + f" | {best_t} | {best_l} |")
        if c >= min_c:
            total += 1
            wins += best_t == wave
    print(f"\nC >= {min_c}: {wave} has the highest throughput in {wins} of {total} settings.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="kimi-k3")
    parser.add_argument("--parallel", default="pp8xtp2-wave,pp8xtp2-sync,pp2xtp8-sync")
    parser.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    parser.add_argument("--reuse", default="low,high")
    parser.add_argument("--prompt-tokens", default="8192,32768")
    parser.add_argument("--requests-per-c", type=int, default=4)
    parser.add_argument("--min-requests", type=int, default=16)
    parser.add_argument("--out", default="layouts.csv")
    parser.add_argument("--summarize", default=None, help="print the tables of this CSV")
    parser.add_argument("--wave", default="pp8-wave", help="the wave layout (--summarize)")
    parser.add_argument("--min-c", type=int, default=8)
    parser.add_argument("extra", nargs="*", help="more `wavepp sim` flags after --")
    args = parser.parse_args()
    if args.summarize:
        summarize(args.summarize, args.wave, args.min_c)
    else:
        run(args)


if __name__ == "__main__":
    main()
