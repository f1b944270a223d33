"""``wavepp validate CONFIG``: check a WavePipeline spec as ``wavepp up`` and the operator would.

Reads the file (YAML or JSON; a bare spec or a whole WavePipeline), validates it
(``wavepp.api.spec.check_spec``: types, bounds, non-finite numbers, cross-field checks) and
builds every replica's RuntimeConfig (``runtime_configs_from_spec``; a checkpoint named by
``model.path`` is read: its config.json, the split by cost), starting nothing. Prints one
line: ``CONFIG: ok (...)`` on stdout and exit 0, or the problem naming the field on stderr and
exit 2.
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="WavePipeline spec file (YAML or JSON)")
    parser.add_argument("--pool", default="default", help="pool name the replicas are named by")


def _check_key_files(spec: object, config: str) -> str:
    """The first problem with the tenants' ``apiKeysFile``s (read as ``wavepp up`` reads them,
    relative to the spec's folder), or "" when there is none."""
    from pathlib import Path

    from wavepp.cmd.common import key_files_problem

    folder = Path(config).resolve().parent
    key_files = {
        t.name: str(folder / t.api_keys_file)
        for t in getattr(spec, "tenants", [])
        if t.api_keys_file
    }
    return key_files_problem(key_files)


def run(args: argparse.Namespace) -> int:
    from wavepp.api.spec import SpecError, SpecFileError, check_spec, read_spec_mapping
    from wavepp.runtime.serving.from_spec import (
        checkpoint_tokenizer,
        runtime_configs_from_spec,
        with_checkpoint_layers,
    )

    try:
        raw = with_checkpoint_layers(read_spec_mapping(args.config))
    except SpecFileError as exc:
        print(f"wavepp validate: {exc}", file=sys.stderr)
        return 2
    except SpecError as exc:
        print(f"wavepp validate: {args.config}: {exc}", file=sys.stderr)
        return 2
    spec, issues = check_spec(raw, default_image="local", default_nats_url="nats://embedded")
    if spec is None:
        print(
            f"wavepp validate: {args.config}: " + "; ".join(str(i) for i in issues),
            file=sys.stderr,
        )
        return 2
    try:
        configs = runtime_configs_from_spec(spec, pool=args.pool)
    except SpecError as exc:
        print(f"wavepp validate: {args.config}: {exc}", file=sys.stderr)
        return 2
    key_problem = _check_key_files(spec, args.config)
    if key_problem:
        print(f"wavepp validate: {args.config}: {key_problem}", file=sys.stderr)
        return 2
    first = configs[0]
    checkpoint = ""
    if first.model_dir is not None:
        layers = [last - f for f, last in (first.layers_of(r) for r in range(first.num_stages))]
        tokenizer = "tokenizer.json" if checkpoint_tokenizer(spec) else "no tokenizer.json"
        checkpoint = (
            f"; checkpoint {first.model_dir}: {first.model.architecture}, layers per stage "
            f"{layers}, {tokenizer}"
        )
    print(
        f"{args.config}: ok ({len(configs)} replica(s) x {first.num_stages} {first.engine} "
        f"stages of {first.model.name}, {len(spec.tenants) or 1} tenant(s){checkpoint})"
    )
    return 0
