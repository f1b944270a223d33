"""``wavepp nats-auth``: make the NATS trust root a cluster's WavePP runs on.

    wavepp nats-auth secret --name wavepp-nats-auth [--namespace NS] > secret.yaml
    wavepp nats-auth files DIR    # auth.conf and account.seed, mode 0600, for an own NATS

The Secret (what the Helm chart mounts) holds ``auth.conf``, a nats-server include in operator
mode that trusts only the fresh WavePP account (``wavepp.api.natsauth``), and ``account.seed``,
with which the operator signs each pipeline component's user. Keep it secret: whoever has the
seed can mint any user of the account. ``--jetstream-max-bytes N`` caps the account's
JetStream disk use at N bytes (enforced by the server; the gateway exports use and limit).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "action", choices=["secret", "files"], help="print a Secret, or write files"
    )
    parser.add_argument("dir", nargs="?", default="", help="(files) the folder to write")
    parser.add_argument("--name", default="wavepp-nats-auth", help="(secret) the Secret's name")
    parser.add_argument("--namespace", default="", help="(secret) its namespace")
    parser.add_argument(
        "--jetstream-max-bytes",
        type=int,
        default=0,
        help="the account's JetStream disk limit in bytes (0: none beyond the server's); the "
        "gateway exports it beside the store's use (wavepp_gateway_jetstream_store_*)",
    )


def run(args: argparse.Namespace) -> int:
    from wavepp.api.natsauth import TrustRoot

    if args.jetstream_max_bytes < 0:
        print(
            f"wavepp nats-auth: --jetstream-max-bytes: {args.jetstream_max_bytes}: must be >= 0",
            file=sys.stderr,
        )
        return 2
    trust = TrustRoot.new(max_store_bytes=args.jetstream_max_bytes or None)
    files = {"auth.conf": trust.auth_config(), "account.seed": trust.account_seed + "\n"}
    if args.action == "files":
        if not args.dir:
            print("wavepp nats-auth: files: give the folder to write", file=sys.stderr)
            return 2
        folder = Path(args.dir)
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            fd = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(text)
        print(f"wavepp nats-auth: wrote {', '.join(files)} to {folder}", file=sys.stderr)
        return 0
    metadata: dict[str, str] = {"name": args.name}
    if args.namespace:
        metadata["namespace"] = args.namespace
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata,
        "type": "Opaque",
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in files.items()},
    }
    sys.stdout.write(json.dumps(secret, indent=2) + "\n")  # JSON is YAML: kubectl apply -f -
    return 0
