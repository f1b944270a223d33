"""The spec ``wavepp up`` serves: ``--config``, ``--model DIR``, ``--stages S``, this host.

``--config FILE`` is a WavePipeline spec; without it, tiny-llama on 2 torch stages.
``--model DIR`` serves the Hugging Face checkpoint in DIR (config.json + safetensors, any family
``wavepp.runtime.hf_config`` reads): it replaces the spec's ``model`` by ``{name: <DIR's
name>-<config.json's sha8>, path: DIR}`` (keeping ``model.dtype``), so the shape comes from
config.json and the layers are split by cost. ``--stages S`` replaces ``stages`` (and drops a
``layerPartition`` of the old count). A model directory's ``tokenizer.json`` is the gateway's
tokenizer unless ``--tokenizer`` names another. Then, as in the pods: the spec's
``telemetry``, and ``resources.gpusPerStage`` decided for this host.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

DEFAULT_SPEC = {"model": {"name": "tiny-llama"}, "stages": 2}


class UpSpecError(ValueError):
    """A flag's value ``wavepp up`` cannot serve; ``flag`` names it."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(message)
        self.flag = flag


def spec_mapping(args: argparse.Namespace) -> dict[str, Any]:
    """The raw spec from ``--config`` (or the default), ``--model`` and ``--stages``, with a
    checkpoint's layer count from its config.json (``from_spec.with_checkpoint_layers``).

    Raises:
        UpSpecError: an unreadable ``--config``, a ``--model`` directory without a readable
            config.json, ``--stages`` < 1, or a spec model path without config.json (names the
            flag).
    """
    from wavepp.api.spec import SpecError, SpecFileError, read_spec_mapping
    from wavepp.runtime.hf_config import load_model_dir
    from wavepp.runtime.serving.from_spec import with_checkpoint_layers

    try:
        raw = dict(read_spec_mapping(args.config)) if args.config else dict(DEFAULT_SPEC)
    except SpecFileError as exc:
        raise UpSpecError("--config", str(exc)) from None
    if args.model:
        try:
            name = load_model_dir(args.model).name
        except ValueError as exc:
            raise UpSpecError("--model", f"{args.model}: {exc}") from None
        old = raw.get("model") if isinstance(raw.get("model"), dict) else {}
        model: dict[str, Any] = {"name": name, "path": str(Path(args.model).resolve())}
        if old.get("dtype") is not None:
            model["dtype"] = old["dtype"]
        raw["model"] = model
        if raw.get("engine", "torch") != "torch":
            raise UpSpecError("--model", f"{args.model}: a checkpoint needs engine: torch")
    if args.stages is not None:
        if args.stages < 1:
            raise UpSpecError("--stages", f"{args.stages}: must be >= 1")
        raw["stages"] = args.stages
        raw.pop("layerPartition", None)
        raw.pop("layer_partition", None)
    try:
        return with_checkpoint_layers(raw)
    except SpecError as exc:
        raise UpSpecError("--model" if args.model else "--config", str(exc)) from None


def local_resources(raw: Any) -> dict[str, Any]:
    """The spec as a dict, with ``resources.gpusPerStage`` decided for this host when the spec
    leaves it out (torch engine): 1 (CUDA) when torch sees a GPU, else 0 (CPU). In a cluster the
    default is 1 GPU per stage pod; on a laptop there are no pods to give GPUs to."""
    from wavepp.api.spec import WavePipelineSpec

    data = raw.to_wire() if isinstance(raw, WavePipelineSpec) else dict(raw)
    resources = dict(data.get("resources") or {})
    if data.get("engine", "torch") == "torch" and resources.get("gpusPerStage") is None:
        import torch

        resources["gpusPerStage"] = 1 if torch.cuda.is_available() else 0
        data["resources"] = resources
    return data


def stage_metrics_port(configs: list, replica: int, rank: int) -> int | None:
    """Under ``wavepp up`` (one host), the port of stage ``rank`` of replica ``replica``'s own
    ``/metrics``: P + R + replica x S + rank after the R admission ports P .. P + R - 1 (P the
    stated ``metricsPort``); None when no metrics port is stated."""
    first = configs[0].telemetry.metrics_port
    if not first:
        return None
    return first + len(configs) + replica * configs[0].num_stages + rank


def metrics_endpoints(configs: list, host: str) -> dict[str, dict[str, str]]:
    """``processes.json``'s Prometheus endpoints: ``metrics`` (pipeline -> its admission's URL)
    and ``stage_metrics`` (``{pipeline}-{rank}`` -> that stage's URL); empty without a port."""
    return {
        "metrics": {
            c.pipeline: f"http://{host}:{c.telemetry.metrics_port}/metrics"
            for c in configs
            if c.telemetry.metrics_port
        },
        "stage_metrics": {
            f"{c.pipeline}-{rank}": f"http://{host}:{stage_metrics_port(configs, i, rank)}/metrics"
            for i, c in enumerate(configs)
            for rank in range(c.num_stages)
            if c.telemetry.metrics_port
        },
    }


def with_telemetry(configs: list, spec: object, raw: dict) -> list:  # RuntimeConfig, spec
    """The replicas' configs with ``spec.telemetry``: ``otlpEndpoint``/``samplingRatio`` as in
    the pods; a stated ``metricsPort`` P serves replica i's admission metrics on P + i and
    stage s of replica i its own on P + R + i x S + s (``stage_metrics_port``; one machine, one
    port each); without it no Prometheus port is opened.

    Raises:
        ValueError: the last of those ports passes 65535, or a bad ``$WAVEPP_METRICS_PORT``
            (named).
    """
    from wavepp.cmd.stage import telemetry_from_spec

    telemetry = telemetry_from_spec(spec, os.environ)  # type: ignore[arg-type]
    stated = isinstance(raw.get("telemetry"), dict) and (
        "metricsPort" in raw["telemetry"] or "metrics_port" in raw["telemetry"]
    )
    if not stated and not os.environ.get("WAVEPP_METRICS_PORT"):
        telemetry = telemetry.model_copy(update={"metrics_port": None})
    if telemetry.metrics_port and configs:
        last = telemetry.metrics_port + len(configs) * (1 + configs[0].num_stages) - 1
        if last > 65535:
            raise ValueError(
                f"metricsPort {telemetry.metrics_port}: the {len(configs)} admissions' and "
                f"{len(configs) * configs[0].num_stages} stages' ports reach {last} > 65535"
            )
    out = []
    for i, config in enumerate(configs):
        port = telemetry.metrics_port
        if port:
            port += i
        out.append(
            config.model_copy(
                update={"telemetry": telemetry.model_copy(update={"metrics_port": port})}
            )
        )
    return out
