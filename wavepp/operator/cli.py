"""``wavepp operator``: run the WavePipeline operator (kopf, cluster-wide), or print its CRD.

    wavepp operator [run] [--default-image IMG] [--default-nats-url URL] ...
    wavepp operator crd            # the CustomResourceDefinition YAML on stdout

Flags default to the environment (``WAVEPP_DEFAULT_IMAGE``, ``WAVEPP_DEFAULT_NATS_URL``,
``WAVEPP_DEFAULT_OTLP_ENDPOINT``, ``WAVEPP_NATS_ACCOUNT_SEED_FILE``, ``WAVEPP_INSECURE_NATS``),
which is how the Helm chart configures the operator. With the NATS account's seed, every
pipeline's components get their own NATS users (``operator.natscreds``).
"""

from __future__ import annotations

import argparse
import os
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``operator`` subcommand's flags (and its ``run`` / ``crd`` actions)."""
    parser.add_argument(
        "action",
        nargs="?",
        choices=["run", "crd"],
        default="run",
        help="run the operator, or print the CRD (default: run)",
    )
    parser.add_argument(
        "--default-image",
        default=os.environ.get("WAVEPP_DEFAULT_IMAGE"),
        help="image of pipelines that set no spec.image (env WAVEPP_DEFAULT_IMAGE)",
    )
    parser.add_argument(
        "--default-nats-url",
        default=os.environ.get("WAVEPP_DEFAULT_NATS_URL"),
        help="NATS URL of pipelines that set no spec.nats.url (env WAVEPP_DEFAULT_NATS_URL)",
    )
    parser.add_argument(
        "--default-otlp-endpoint",
        default=os.environ.get("WAVEPP_DEFAULT_OTLP_ENDPOINT"),
        help="OTLP endpoint when spec.telemetry has none (env WAVEPP_DEFAULT_OTLP_ENDPOINT)",
    )
    parser.add_argument(
        "--resync-s",
        type=float,
        default=10.0,
        help="seconds between reconciles of an idle pipeline",
    )
    parser.add_argument(
        "--liveness-port",
        type=int,
        default=8080,
        help="port of kopf's /healthz liveness endpoint; 0 disables",
    )
    parser.add_argument(
        "--nats-account-seed-file",
        default=os.environ.get("WAVEPP_NATS_ACCOUNT_SEED_FILE"),
        help="the NATS account's seed (the chart mounts it): each pipeline's components get "
        "their own credentials (env WAVEPP_NATS_ACCOUNT_SEED_FILE)",
    )
    parser.add_argument(
        "--insecure-nats",
        action="store_true",
        default=os.environ.get("WAVEPP_INSECURE_NATS") == "1",
        help="DEBUGGING ONLY: render no NATS credentials (env WAVEPP_INSECURE_NATS=1)",
    )
    parser.add_argument(
        "--namespace",
        action="append",
        default=None,
        help=(
            "watch only this namespace (repeatable; the chart's namespace-scoped install mode, "
            "with a Role there instead of a ClusterRole); default: every namespace"
        ),
    )
    parser.add_argument("--no-events", action="store_true", help="post no Kubernetes Events")
    parser.add_argument("--verbose", action="store_true", help="debug logging")


def run(args: argparse.Namespace) -> int:
    """Validate the flags, then run the operator until SIGTERM (or print the CRD)."""
    if args.action == "crd":
        from wavepp.operator.crdgen import render_crd

        sys.stdout.write(render_crd())
        return 0
    if not 0 < args.resync_s < float("inf"):
        print(f"wavepp operator: --resync-s {args.resync_s}: must be > 0, finite", file=sys.stderr)
        return 2
    if not 0 <= args.liveness_port <= 65535:
        print(f"wavepp operator: --liveness-port {args.liveness_port}: not a port", file=sys.stderr)
        return 2

    seed, warning = None, ""
    if args.insecure_nats:
        warning = (
            "--insecure-nats: pipelines get no NATS credentials; any pod that reaches NATS can "
            "read every prompt and publish on every subject"
        )
    elif args.nats_account_seed_file:
        try:
            seed = _read_account_seed(args.nats_account_seed_file)
        except (OSError, ValueError) as exc:
            print(f"wavepp operator: --nats-account-seed-file: {exc}", file=sys.stderr)
            return 2
    else:
        warning = (
            "no --nats-account-seed-file: pipelines get no NATS credentials unless their spec "
            "names nats.credentialsSecret (give the seed, or --insecure-nats to say this is meant)"
        )

    import logging

    import kopf

    import wavepp.operator.handlers  # noqa: F401 - registers the handlers
    from wavepp.operator.handlers import OperatorOptions, connection_info

    # Start-up check: credentials kopf would log in with (else kopf logs a traceback per retry
    # and never serves).
    try:
        info = connection_info(
            settings=kopf.OperatorSettings(), logger=logging.getLogger("wavepp.operator")
        )
    except Exception as exc:  # noqa: BLE001 - any failure to read the credentials
        info, reason = None, " ".join(f"{type(exc).__name__}: {exc}".split())
    else:
        reason = "no in-cluster service account and no kubeconfig"
    if info is None:
        print(f"wavepp operator: no Kubernetes credentials: {reason}", file=sys.stderr)
        return 2
    if warning:
        print(f"wavepp operator: WARNING: {warning}", file=sys.stderr, flush=True)
    kopf.configure(verbose=args.verbose)
    options = OperatorOptions(
        default_image=args.default_image,
        default_nats_url=args.default_nats_url,
        default_otlp_endpoint=args.default_otlp_endpoint,
        resync_s=args.resync_s,
        post_events=not args.no_events,
        nats_account_seed=seed,
    )
    liveness = f"http://0.0.0.0:{args.liveness_port}/healthz" if args.liveness_port else None
    kopf.run(
        clusterwide=not args.namespace,
        namespaces=args.namespace or (),
        standalone=True,
        liveness_endpoint=liveness,
        memo=kopf.Memo(options=options),
    )
    return 0


def _read_account_seed(path: str) -> str:
    """The account nkey seed in ``path`` (``SA...``).

    Raises:
        OSError: unreadable file.
        ValueError: the file holds no account seed.
    """
    import nkeys

    seed = open(path).read().strip()  # noqa: PTH123, SIM115 - small file, read once
    try:
        kind = nkeys.from_seed(seed.encode()).public_key.decode()[0]
    except Exception as exc:  # noqa: BLE001 - nkeys raises several kinds
        raise ValueError(f"{path}: not an nkey seed") from exc
    if kind != "A":
        raise ValueError(f"{path}: an nkey seed, but not an account's (public key {kind}...)")
    return seed
