"""``wavepp bench grid|agreement|plot``: the side-by-side benchmark, its microbenchmark, plots.

wavepp bench grid --concurrency 8,32       # models x concurrency x reuse, wave vs sync
wavepp bench agreement --stages 2,4,8         # agreements/s and latency over real NATS
wavepp bench plot docs/bench/h200/grid.csv    # PNG plots from a grid CSV
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from wavepp.cmd.common import HelpFormatter, fail, finite_float, fresh_out_dir, progress_bar

BARE_IS_USAGE = [("grid",)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    grid = sub.add_parser(
        "grid",
        help="wave vs sync over models x concurrency x reuse",
        description="wave vs sync over models x concurrency x reuse (hours at the defaults: "
        "give at least one flag)",
        formatter_class=HelpFormatter,
    )
    grid.add_argument("--models", default="glm-5.2,minimax-m2.7", help="derived cost models")
    grid.add_argument(
        "--concurrency", default="1,2,4,8,16,32,64,128,192,256", help="closed-loop C values"
    )
    grid.add_argument(
        "--reuse", default="low,high", help="low, high (generated), mooncake (needs --trace)"
    )
    grid.add_argument("--trace", default=None, help="Mooncake trace JSONL for reuse 'mooncake'")
    grid.add_argument("--trace-requests", type=int, default=200, help="first N trace requests")
    grid.add_argument(
        "--ablations",
        default="agreement-sync,chunking-static,local-prepare-off",
        help='wave with one mechanism reverted ("" for none)',
    )
    grid.add_argument("--ablation-concurrency", type=int, default=128, help="C of the ablations")
    grid.add_argument("--ablation-reuse", default="high", help="reuse of the ablations")
    grid.add_argument("--stages", type=int, default=4, help="pipeline stages S")
    grid.add_argument(
        "--time-scale",
        type=finite_float,
        default=1.0,
        help="emulated sleep multiplier: 1.0 = H200 time; below 1 stresses the control plane "
        "(its costs do not shrink) and is no measure of WavePP against the baseline",
    )
    grid.add_argument("--block-size", type=int, default=64, help="tokens per KV block")
    grid.add_argument(
        "--kv-blocks",
        type=int,
        default=None,
        help="KV blocks per stage (default: derived per stage from the model and H200 memory)",
    )
    grid.add_argument("--chunk-tokens", type=int, default=8192, help="micro-batch token budget")
    grid.add_argument(
        "--host-memory-gib",
        default="0",
        help="host KV tiers per GPU to run, GiB, comma-separated (a grid dimension; 0: none; "
        "blocks and load time from each model's KV bytes per token, wavepp.launch.capacity)",
    )
    grid.add_argument(
        "--min-requests", type=int, default=32, help="requests per setting: at least this"
    )
    grid.add_argument(
        "--requests-per-concurrency",
        type=finite_float,
        default=1.0,
        help="requests per setting: max(--min-requests, C x this)",
    )
    grid.add_argument(
        "--repeats", type=int, default=1, help="runs per setting (table: medians, ratio range)"
    )
    grid.add_argument(
        "--out",
        default=None,
        help="folder for grid.csv, grid.md and the plots (default: a fresh wavepp-grid-* "
        "folder under the system's temporary directory, named on stderr)",
    )
    grid.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    agr = sub.add_parser(
        "agreement",
        help="agreements/s and latency over real NATS",
        description="agreements/s and latency over real NATS",
        formatter_class=HelpFormatter,
    )
    agr.add_argument("--stages", default="2,4,8", help="stages S per replica")
    agr.add_argument("--requests", type=int, default=400, help="agreements per setting")
    agr.add_argument(
        "--concurrency",
        dest="in_flight",
        default=None,
        help="closed loop: agreements in flight at once per replica, comma-separated (default "
        "1,16,64; not with --rate)",
    )
    agr.add_argument(
        "--rate",
        default=None,
        help="open loop instead: requests arrive as a Poisson process of this many per second "
        "per replica (comma-separated), latency from each arrival (not with --concurrency)",
    )
    agr.add_argument(
        "--batch-limits", default="512", help="most requests per agreement round (1: unbatched)"
    )
    agr.add_argument(
        "--rounds-in-flight",
        default="1",
        help="agreement rounds under way at once per replica, comma-separated (the "
        "controller's max_rounds_in_flight; past it, arrivals wait and share the next round)",
    )
    agr.add_argument("--replicas", default="1", help="replicas R sharing one nats-server")
    agr.add_argument(
        "--workload",
        default="mixed",
        help="mixed (half share a prefix, nothing cached) or short-suffix (8 cached long "
        "prefixes, a short new suffix each); comma-separated for both",
    )
    agr.add_argument("--prompt-tokens", type=int, default=4096, help="tokens per prompt")
    agr.add_argument(
        "--suffix-tokens", type=int, default=192, help="new tokens per prompt (short-suffix)"
    )
    agr.add_argument("--block-size", type=int, default=64, help="tokens per KV block")
    agr.add_argument(
        "--prefix-refs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a round names a prefix the stages remember from an earlier round by reference "
        "(--no-prefix-refs: every hash sent)",
    )
    agr.add_argument(
        "--stage-processes",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="each stage KV server in a process of its own, as in production (default: all in "
        "the controller's process: on a few shared cores S extra processes cost more CPU than "
        "they take off the controller)",
    )
    agr.add_argument(
        "--stage-hosts",
        type=int,
        default=0,
        help="stage host processes sharing, round robin, the ranks not kept in this process "
        "(default 0: all in this process; not with --stage-processes)",
    )
    agr.add_argument(
        "--stages-in-process",
        type=int,
        default=None,
        help="needs --stage-hosts: ranks 0..K-1 stay in the controller's process (default S // "
        "2: on a 2-core machine half the stages beside the controller, half in one stage host)",
    )
    agr.add_argument(
        "--connection-per-stage",
        action="store_true",
        help="each stage KV server on a NATS connection of its own (default: one connection per "
        "process for the ranks it serves; not with --stage-processes, where each has one)",
    )
    agr.add_argument(
        "--held",
        type=int,
        default=256,
        help="admitted requests each replica holds before releasing the oldest (requests in "
        "prefill: the steady state's pins and reservations; releases are batched per round)",
    )
    agr.add_argument("--json", action="store_true", help="stdout: the rows as one JSON line only")
    plot = sub.add_parser(
        "plot",
        help="PNG plots from a grid CSV",
        description="PNG plots from a grid CSV",
        formatter_class=HelpFormatter,
    )
    plot.add_argument("csv", help="grid.csv of a bench grid run")
    plot.add_argument("--out", default=None, help="folder (default: beside the CSV)")


def run(args: argparse.Namespace) -> int:
    if args.bench_command == "grid":
        return _run_grid(args)
    if args.bench_command == "agreement":
        return _run_agreement(args)
    return _run_plot(args)


def _run_grid(args: argparse.Namespace) -> int:
    from rich.console import Console

    from wavepp.bench.grid import add_ratios, markdown_table, run_setting, write_csv
    from wavepp.launch.grid import plan_grid

    plan = plan_grid(args)
    spec, settings = plan.spec, plan.settings
    out = Path(args.out or fresh_out_dir("grid"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"wavepp bench grid: writing into {out}", file=sys.stderr)
    command = "wavepp bench " + " ".join(shlex.quote(a) for a in sys.argv[2:])
    err = Console(stderr=True)
    rows = []
    with progress_bar(err) as progress:
        task = progress.add_task("grid", total=len(settings))
        for setting in settings:
            progress.update(task, description=setting.label)
            rows.append(run_setting(spec, setting, *plan.config(setting)))
            add_ratios(rows)
            write_csv(rows, out / "grid.csv")  # partial results survive an interruption
            progress.advance(task)
    table = markdown_table(rows, spec, command)
    (out / "grid.md").write_text(table, encoding="utf-8")
    print(table)
    if not args.no_plots:
        from wavepp.bench.plots import plot_grid

        for path in plot_grid(rows, out):
            err.print(f"wrote {path}")
    return 0


def _run_agreement(args: argparse.Namespace) -> int:
    import asyncio

    from wavepp.bench.agreement import format_table, run_agreement_bench
    from wavepp.launch.agreement import plan_agreement

    settings = plan_agreement(args)
    results = asyncio.run(
        run_agreement_bench(
            settings,
            num_requests=args.requests,
            num_prompt_tokens=args.prompt_tokens,
            suffix_tokens=args.suffix_tokens,
            block_size=args.block_size,
        )
    )
    print(json.dumps(results) if args.json else format_table(results))
    return 0


def _run_plot(args: argparse.Namespace) -> int:
    from wavepp.bench.grid import read_csv
    from wavepp.bench.plots import plot_grid

    path = Path(args.csv)
    if not path.is_file():
        return fail("bench", "CSV", f"{args.csv}: no such file")
    for written in plot_grid(read_csv(path), Path(args.out) if args.out else path.parent):
        print(f"wrote {written}")
    return 0
