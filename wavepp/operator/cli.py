"""``wavepp operator``: run the WavePipeline operator (kopf, cluster-wide), or print its CRD.

    wavepp operator [run] [--default-image IMG] [--default-nats-url URL] ...
    wavepp operator crd            # the CustomResourceDefinition YAML on stdout

Flags default to the environment (``WAVEPP_DEFAULT_IMAGE``, ``WAVEPP_DEFAULT_NATS_URL``,
``WAVEPP_DEFAULT_OTLP_ENDPOINT``), which is how the Helm chart configures the operator.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``operator`` subcommand's flags (and its ``run`` / ``crd`` actions)."""
    parser.add_argument(
        "action", nargs="?", choices=["run", "crd"], default="run", help="run (default) or crd"
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
        help="seconds between reconciles of an idle pipeline (default 10)",
    )
    parser.add_argument(
        "--liveness-port",
        type=int,
        default=8080,
        help="port of kopf's /healthz liveness endpoint; 0 disables (default 8080)",
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


def add_operator_command(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``operator`` on an argparse subparsers object; returns the new parser."""
    parser = subparsers.add_parser(
        "operator", help="run the Kubernetes operator (kopf)", description=__doc__
    )
    add_arguments(parser)
    parser.set_defaults(_run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Validate the flags, then run the operator until SIGTERM (or print the CRD)."""
    if args.action == "crd":
        from wavepp.operator.crdgen import render_crd

        sys.stdout.write(render_crd())
        return 0
    if args.resync_s <= 0:
        print(f"wavepp operator: --resync-s {args.resync_s}: must be > 0", file=sys.stderr)
        return 2
    if not 0 <= args.liveness_port <= 65535:
        print(f"wavepp operator: --liveness-port {args.liveness_port}: not a port", file=sys.stderr)
        return 2

    import kopf

    import wavepp.operator.handlers  # noqa: F401 - registers the handlers
    from wavepp.operator.handlers import OperatorOptions

    kopf.configure(verbose=args.verbose)
    options = OperatorOptions(
        default_image=args.default_image,
        default_nats_url=args.default_nats_url,
        default_otlp_endpoint=args.default_otlp_endpoint,
        resync_s=args.resync_s,
        post_events=not args.no_events,
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
