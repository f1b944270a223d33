"""The settings ``wavepp bench agreement`` measures, from its flags (:func:`plan_agreement`;
every refusal a :class:`FlagError` naming the flag): the product of its comma lists (stages,
concurrency, batch limits, replicas, rounds in flight, rates, workloads), each an
``AgreementSetting`` with the stage layout the flags name.
"""

from __future__ import annotations

import argparse

from wavepp.bench.agreement import WORKLOADS, AgreementSetting
from wavepp.launch.flags import FlagError, positive_ints


def plan_agreement(args: argparse.Namespace) -> list[AgreementSetting]:
    """Every setting to measure, in order (workload, replicas, stages, batch limit,
    concurrency, rate, rounds in flight; the last varies fastest). ``--concurrency`` defaults
    to 1 with ``--rate``, else 1,16,64.

    Raises:
        FlagError: both ``--rate`` and ``--concurrency``; a list that is not integers >= 1 (or
            rates > 0); an unknown workload; a count out of range; a layout flag that would be
            ignored (names the flag).
    """
    if args.rate is not None and args.in_flight is not None:
        raise FlagError("--rate", "not with --concurrency (open loop or closed loop, not both)")
    rates: list[float | None] = [None]
    if args.rate is not None:
        try:
            rates = [float(x) for x in args.rate.split(",") if x]
        except ValueError:
            rates = []
        if not rates or not all(0 < x < float("inf") for x in rates):
            raise FlagError("--rate", f"{args.rate!r}: need numbers > 0 (agreements/s per replica)")
    given = vars(args) | {
        "in_flight": (
            args.in_flight
            if args.in_flight is not None
            else ("1" if args.rate is not None else "1,16,64")
        )
    }
    flags = {"stages": "--stages", "in_flight": "--concurrency",
             "batch_limits": "--batch-limits", "replicas": "--replicas",
             "rounds_in_flight": "--rounds-in-flight"}  # fmt: skip
    lists = {flag: positive_ints(name, given[flag]) for flag, name in flags.items()}
    workloads = [w for w in args.workload.split(",") if w]
    for workload in workloads:
        if workload not in WORKLOADS:
            raise FlagError("--workload", f"{workload!r}: choose from {list(WORKLOADS)}")
    if args.requests < 1:
        raise FlagError("--requests", f"{args.requests}: must be >= 1")
    if not 1 <= args.suffix_tokens <= args.prompt_tokens:
        raise FlagError("--suffix-tokens", f"{args.suffix_tokens}: must be in [1, --prompt-tokens]")
    for name, flag, low in (
        ("stage_hosts", "--stage-hosts", 0),
        ("stages_in_process", "--stages-in-process", 0),
        ("held", "--held", 0),
    ):
        if (getattr(args, name) or 0) < low:
            raise FlagError(flag, f"{getattr(args, name)}: must be >= {low}")
    # a layout flag that would be ignored is refused (accepted but not honoured is a defect)
    if args.stage_hosts and args.stage_processes:
        raise FlagError("--stage-hosts", "not with --stage-processes (one process per stage)")
    if args.connection_per_stage and args.stage_processes:
        raise FlagError("--connection-per-stage", "not with --stage-processes (a connection each "
                     "already)")  # fmt: skip
    if args.stages_in_process is not None and not args.stage_hosts:
        raise FlagError("--stages-in-process", "needs --stage-hosts N >= 1 (without it every "
                     "stage runs in the controller's process)")  # fmt: skip
    return [
        AgreementSetting(
            s,
            k,
            b,
            r,
            w,
            args.stage_processes,
            stage_hosts=args.stage_hosts,
            stages_in_process=args.stages_in_process,
            held_requests=args.held,
            rate=rate,
            rounds_in_flight=m,
            connection_per_stage=args.connection_per_stage,
            prefix_refs=args.prefix_refs,
        )
        for w in workloads
        for r in lists["replicas"]
        for s in lists["stages"]
        for b in lists["batch_limits"]
        for k in lists["in_flight"]
        for rate in rates
        for m in lists["rounds_in_flight"]
    ]
