"""``wavepp calibrate``: measure a torch stage on a grid of (L, x), fit t(L, x), print the error."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="tiny-llama",
        help="model preset or a Hugging Face checkpoint directory",
    )
    parser.add_argument("--layers", type=int, default=2, help="layers held by the measured stage")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per grid point")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--block-size", type=int, default=16, help="KV block size in tokens")
    parser.add_argument(
        "--out", default="", help="write the fitted CostModel JSON here (default: print only)"
    )


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console
    from rich.table import Table

    from wavepp.runtime.hf_config import load_model_dir
    from wavepp.runtime.model_config import get_preset
    from wavepp.runtime.planning import fit_cost_model
    from wavepp.runtime.stage.calibrate import default_grid, measure_stage_costs

    console = Console()
    model_dir = args.model if Path(args.model).is_dir() else None
    try:
        model = load_model_dir(model_dir) if model_dir else get_preset(args.model)
    except ValueError as exc:
        print(f"wavepp calibrate: --model: {exc}", file=sys.stderr)
        return 2
    if args.layers < 1:
        print(f"wavepp calibrate: --layers {args.layers}: must be >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    grid = default_grid()
    with console.status(f"measuring {len(grid)} chunk shapes on {args.device}"):
        try:
            samples = measure_stage_costs(
                model,
                num_layers=args.layers,
                grid=grid,
                repeats=args.repeats,
                device=args.device,
                block_size=args.block_size,
                model_dir=model_dir,
            )
        except ValueError as exc:
            print(f"wavepp calibrate: --model/--layers: {exc}", file=sys.stderr)
            return 2
    source = (
        f"wavepp calibrate {time.strftime('%Y-%m-%d')}: {args.model}, {args.layers} layers, "
        f"{args.device}, torch {torch.__version__}"
    )
    cost_model, rel_error = fit_cost_model(samples, label="measured", source=source)
    table = Table(title="stage cost t(L, x): measured vs fit")
    for col in ("L", "x", "measured ms", "fit ms", "error"):
        table.add_column(col, justify="right")
    for num_context, num_new, seconds in samples:
        fit = cost_model.microbatch_cost_s([(num_context, num_new)])
        table.add_row(
            str(num_context),
            str(num_new),
            f"{seconds * 1e3:.3f}",
            f"{fit * 1e3:.3f}",
            f"{(fit - seconds) / seconds:+.1%}",
        )
    console.print(table)
    console.print(
        f"c={cost_model.c:.3e} s  g={cost_model.g:.3e} s/token  b={cost_model.b:.3e} s/token  "
        f"a={cost_model.a:.3e} s/token^2   relative RMS fit error: {rel_error:.1%}"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(cost_model.to_dict(), indent=2) + "\n")
        console.print(f"wrote {args.out}")
    return 0
