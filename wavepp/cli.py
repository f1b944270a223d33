"""``wavepp``: one console script; each subcommand adds its args, validates, runs.

Only the chosen subcommand's module is imported (``--help`` stays fast and imports no torch).
Errors in arguments name the flag and exit with status 2. ``--help`` shows every default once
(``wavepp.cmd.common.HelpFormatter``). A module may list in ``BARE_IS_USAGE`` the argument
tuples after its name that print its usage instead of running (``wavepp sim`` alone).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from wavepp import __version__
from wavepp.cmd.common import HelpFormatter, fail
from wavepp.launch.flags import FlagError

# subcommand -> (module, help). Each module has add_arguments(parser) and run(args) -> int.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "replay": ("wavepp.cmd.replay", "replay a Mooncake trace through a local pipeline"),
    "stage": ("wavepp.cmd.stage", "run one pipeline stage process (what each pod runs)"),
    "calibrate": ("wavepp.cmd.calibrate", "measure the torch engine and fit the cost model"),
    "operator": ("wavepp.operator.cli", "run the Kubernetes operator (kopf)"),
    "trace-view": ("wavepp.cmd.trace_view", "summarise a span file; draw the per-stage timeline"),
    "up": ("wavepp.cmd.up", "run the whole service here: nats, stages, admission, gateway"),
    "validate": ("wavepp.cmd.validate", "check a WavePipeline spec file; start nothing"),
    "nats-auth": ("wavepp.cmd.nats_auth", "make the NATS trust root (the chart's auth Secret)"),
    "admission": ("wavepp.cmd.admission", "run one replica's admission controller (a pod)"),
    "gateway": ("wavepp.cmd.gateway", "run the prefill gateway: HTTP and NATS API (a pod)"),
    "bench": ("wavepp.cmd.bench", "benchmarks: wave vs sync grid, admission cadence, plots"),
    "sim": ("wavepp.cmd.sim", "discrete-event simulator (virtual clock) of wave vs sync"),
    "api-key": ("wavepp.cmd.api_key", "new API key for a tenant: print it, store its hash"),
}


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="wavepp",
        description="WavePP: pipeline-parallel LLM prefill under prefix reuse.",
    )
    parser.add_argument("--version", action="version", version=f"wavepp {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(
            name,
            help=help_text,
            description=help_text,
            formatter_class=HelpFormatter,
        )
        if name == chosen:
            module = importlib.import_module(module_name)
            module.add_arguments(p)
            p.set_defaults(_run=module.run, _parser=p, _module=module)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    rest = tuple(argv[argv.index(args.command) + 1 :])
    if rest in getattr(args._module, "BARE_IS_USAGE", ()):
        usage_of = args._parser
        for word in rest:  # the nested subcommand's own parser (``bench grid``)
            subs = [a for a in usage_of._actions if isinstance(a, argparse._SubParsersAction)]
            usage_of = subs[0].choices[word] if subs else usage_of
        usage_of.print_usage(sys.stderr)
        print(
            f"wavepp {' '.join((args.command, *rest))}: give its inputs (see --help); "
            "nothing was run",
            file=sys.stderr,
        )
        return 2
    try:
        return int(args._run(args) or 0)
    except FlagError as exc:  # a command's refusal of a flag: one line naming it, exit 2
        return fail(args.command, exc.flag, str(exc))


if __name__ == "__main__":
    sys.exit(main())
