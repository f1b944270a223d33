"""``wavepp validate CONFIG``: check a WavePipeline spec as ``wavepp up`` and the operator would.

Reads the file (YAML or JSON; a bare spec or a whole WavePipeline), validates it
(``wavepp.api.spec.check_spec``: types, bounds, non-finite numbers, cross-field checks) and
builds every replica's RuntimeConfig (``runtime_configs_from_spec``; a checkpoint named by
``model.path`` is read: its config.json, the split by cost), starting nothing. Prints one
line: ``CONFIG: ok (...)`` on stdout (for the torch engine it says what each stage pod
requests: GPUs, or CPUs with ``gpusPerStage: 0``) and exit 0, or the problem naming the field
on stderr and exit 2.

Two lines on stderr may come before the ok (docs/operator.md, "Checking a spec"):

- ``warning (Kubernetes)``: ``wavepp up`` serves the spec, but the operator refuses it (a
  checkpoint spec without ``model.config.numLayers``: the operator cannot read the volume;
  ``wavepp up`` and this command read it from config.json). Exit 0: the spec is valid for
  ``wavepp up``.
- ``note``: the checkpoint comes from ``model.pvc`` (no ``model.path``) and its mount path is
  absent here: the checkpoint's checks (config.json, the shape, the split by cost) are skipped,
  everything else is checked. An explicit ``model.path`` that is absent stays an error.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="WavePipeline spec file (YAML or JSON)")
    parser.add_argument("--pool", default="default", help="pool name the replicas are named by")


def run(args: argparse.Namespace) -> int:
    from wavepp.api.spec import SpecError, SpecFileError, check_spec, read_spec_mapping
    from wavepp.launch.gateway import spec_key_files_problem
    from wavepp.launch.runtime_config import (
        absent_pvc_mount,
        checkpoint_tokenizer,
        runtime_configs_from_spec,
        with_checkpoint_layers,
    )

    defaults = {"default_image": "local", "default_nats_url": "nats://embedded"}
    try:
        stated = read_spec_mapping(args.config)
        absent_mount = absent_pvc_mount(stated)
        raw = stated if absent_mount else with_checkpoint_layers(stated)
    except SpecFileError as exc:
        print(f"wavepp validate: {exc}", file=sys.stderr)
        return 2
    except SpecError as exc:
        print(f"wavepp validate: {args.config}: {exc}", file=sys.stderr)
        return 2
    spec, issues = check_spec(raw, **defaults)
    if spec is None:
        print(
            f"wavepp validate: {args.config}: " + "; ".join(str(i) for i in issues),
            file=sys.stderr,
        )
        return 2
    try:
        configs = runtime_configs_from_spec(
            spec, pool=args.pool, read_checkpoint=absent_mount is None
        )
    except SpecError as exc:
        print(f"wavepp validate: {args.config}: {exc}", file=sys.stderr)
        return 2
    key_problem = spec_key_files_problem(spec, args.config)
    if key_problem:
        print(f"wavepp validate: {args.config}: {key_problem}", file=sys.stderr)
        return 2
    if raw is not stated:
        # NOTE: the layer count came from the checkpoint; the operator cannot read it.
        _, kube_issues = check_spec(stated, **defaults)
        if kube_issues:
            found = spec.num_layers()
            print(
                f"wavepp validate: {args.config}: warning (Kubernetes): the operator refuses "
                "this spec (wavepp up serves it): "
                + "; ".join(str(i) for i in kube_issues)
                + f"; its config.json gives numLayers: {found}",
                file=sys.stderr,
            )
    if absent_mount is not None:
        print(
            f"wavepp validate: {args.config}: note: spec.model.pvc.mountPath {absent_mount!r} "
            "is not a directory here (the PVC is mounted in the pods): the checkpoint's checks "
            "(config.json, its shape, the split by cost) are skipped; everything else is checked",
            file=sys.stderr,
        )
    first = configs[0]
    checkpoint = ""
    if first.model_dir is not None:
        layers = [last - f for f, last in (first.layers_of(r) for r in range(first.num_stages))]
        tokenizer = "tokenizer.json" if checkpoint_tokenizer(spec) else "no tokenizer.json"
        checkpoint = (
            f"; checkpoint {first.model_dir}: {first.model.architecture}, layers per stage "
            f"{layers}, {tokenizer}"
        )
    elif absent_mount is not None:
        checkpoint = f"; checkpoint on the PVC at {absent_mount}: not read here"
    print(
        f"{args.config}: ok ({len(configs)} replica(s) x {first.num_stages} {first.engine} "
        f"stages of {first.model.name}, {len(spec.tenants) or 1} tenant(s){checkpoint}"
        f"{_devices(spec)})"
    )
    return 0


def _devices(spec: Any) -> str:
    """Where a stage pod computes (the pods follow ``resources.gpusPerStage``, which defaults
    to ``tensorParallelSize`` for the torch engine, while ``wavepp up`` runs on this host's
    devices): "" for the emulated engine."""
    if spec.engine != "torch":
        return ""
    gpus = spec.gpus_per_stage()
    tp = spec.tensor_parallel_size
    if gpus == 0:
        return f"; stage pods on CPUs ({tp} process(es) each, gpusPerStage: 0)"
    return f"; stage pods request {gpus} GPU(s) each (gpusPerStage; 0 runs them on CPUs)"
