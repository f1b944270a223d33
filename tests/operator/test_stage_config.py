"""What a stage pod runs: the GPU example rendered by the operator and read back by the stage
process (device, dtype, the checkpoint's directory), and a CPU stage given ``model.path`` serving
that checkpoint."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from hf_reference import last_logits

from wavepp.api.spec import check_spec
from wavepp.cmd.stage import add_arguments
from wavepp.launch.replica import runtime_config_from_args
from wavepp.launch.runtime_config import model_config_from_spec, runtime_configs_from_spec
from wavepp.operator.containers import SPEC_FILE
from wavepp.operator.reconcile import Apply, Create, Defaults, Observed, plan
from wavepp.runtime.stage.build import build_engine
from wavepp.runtime.stage.chunk import ChunkSpec

REPO = Path(__file__).resolve().parents[2]


def _render(body: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    result = plan(body, Observed(), 1_000_000.0, Defaults("wavepp:1", "nats://nats:4222"))
    assert not result.issues, result.issues
    return {
        (a.manifest["kind"], a.manifest["metadata"]["name"]): a.manifest
        for a in result.actions
        if isinstance(a, Apply | Create)
    }


def _as_the_pod_runs_it(
    objects: dict[tuple[str, str], dict[str, Any]], sts_name: str, rank: int, tmp: Path
) -> Any:
    """The stage's RuntimeConfig as ``wavepp stage`` builds it in the pod: its args (spec.json
    from the spec ConfigMap), the env the kubelet resolves (namespace, pool, rank)."""
    sts = objects[("StatefulSet", sts_name)]
    container = sts["spec"]["template"]["spec"]["containers"][0]
    (spec_cm,) = [
        o for (k, _), o in objects.items() if k == "ConfigMap" and "spec.json" in o["data"]
    ]
    spec_file = tmp / "spec.json"
    spec_file.write_text(spec_cm["data"]["spec.json"])
    args = [str(spec_file) if a == SPEC_FILE else a for a in container["args"][1:]]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parsed = parser.parse_args(args)
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    env |= {"WAVEPP_NAMESPACE": sts["metadata"]["namespace"], "WAVEPP_RANK": str(rank)}
    return runtime_config_from_args(parsed, env), container, sts


def test_the_gpu_example_runs_on_cuda_in_bf16_with_the_pvcs_weights(tmp_path: Path) -> None:
    """The GPU example with its PVC mounted where a small-llama-sized checkpoint lies (here: a
    folder; in the cluster the volume): the stage's config serves it as ``model_dir``, its
    layers split by cost; every pod that reads the spec (stages, admission, gateway) mounts it."""
    pytest.importorskip("transformers")
    from wavepp.bench.checkpoints import save_random_checkpoint
    from wavepp.runtime.stage.engine.balance import checkpoint_partition

    models = tmp_path / "models"
    save_random_checkpoint("llama", models, num_layers=8, vocab_size=256)  # small-llama: 8
    body = yaml.safe_load((REPO / "examples" / "wavepipeline-gpu.yaml").read_text())
    body["metadata"]["uid"] = "uid-gpu"
    body["spec"]["model"]["pvc"]["mountPath"] = str(models)
    objects = _render(body)
    config, container, sts = _as_the_pod_runs_it(objects, "small-gpu-r1", 2, tmp_path)
    summary = {
        "pipeline": config.pipeline,
        "namespace": config.namespace,
        "device": config.device,
        "dtype": config.model.dtype,
        "model_dir": config.model_dir,
        "engine": config.engine,
        "model": config.model.name,
        "layers": config.layers_of(2),
        "subject_prefix": config.subject_prefix,
    }
    print("stage runtime config:", json.dumps(summary))
    assert (config.device, config.model.dtype) == ("cuda", "bfloat16")
    assert (config.model_dir, config.weights) == (str(models), None)
    assert config.partition == checkpoint_partition(models, 4)
    assert config.model.name == "small-llama"
    assert config.subject_prefix == "wavepp.default.small-gpu-r1"
    # ... and the pod is given what that config needs: a GPU, the PVC, one host.
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    pod = sts["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"]["claimName"] == "small-llama-weights"
    mount = {"name": "model", "mountPath": str(models), "readOnly": True}
    assert mount in container["volumeMounts"]
    (together,) = pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert together["topologyKey"] == "kubernetes.io/hostname"
    # the admission and gateway pods read the checkpoint too (config.json, tokenizer.json)
    deployments = [o for (kind, _), o in objects.items() if kind == "Deployment"]
    assert {d["metadata"]["name"] for d in deployments} >= {"small-gpu-gateway"}
    for deployment in deployments:
        (c,) = deployment["spec"]["template"]["spec"]["containers"]
        assert mount in c["volumeMounts"], deployment["metadata"]["name"]


transformers = pytest.importorskip("transformers")


def test_a_cpu_stage_given_model_path_serves_those_weights(tmp_path: Path) -> None:
    """A Llama checkpoint saved by transformers (safetensors + config.json), named by
    ``model.path``: the pipeline's stages load it and their first token and logits equal
    transformers' on the same checkpoint; without the path they would not (seeded weights)."""
    shape = {
        "numLayers": 4, "hiddenSize": 64, "intermediateSize": 160, "numHeads": 4,
        "numKvHeads": 2, "headDim": 16, "vocabSize": 256,
    }  # fmt: skip
    raw = {
        "model": {"name": "ckpt-llama", "path": str(tmp_path / "ckpt"), "config": shape},
        "stages": 2,
        "resources": {"gpusPerStage": 0},
    }
    spec, issues = check_spec(raw, default_image="i", default_nats_url="nats://n:4222")
    assert spec is not None, issues
    shaped = model_config_from_spec(spec)  # the shape the checkpoint is made with
    torch.manual_seed(11)
    hf_config = transformers.LlamaConfig(**shaped.to_hf_llama_kwargs())
    hf_config._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(hf_config).eval()
    model.save_pretrained(tmp_path / "ckpt", safe_serialization=True)
    assert list((tmp_path / "ckpt").glob("*.safetensors"))
    (config,) = runtime_configs_from_spec(spec, pool="ckpt", namespace="t")
    assert (config.device, config.model.dtype, config.model_dir) == (
        "cpu",
        "float32",
        str(tmp_path / "ckpt"),
    )

    tokens = [(13 * i + 5) % 256 for i in range(21)]
    expected = last_logits(model, tokens)

    def pipeline_logits(cfg: Any) -> torch.Tensor:
        hidden = None
        for rank in range(cfg.num_stages):
            engine = build_engine(cfg, rank)
            chunk = ChunkSpec(
                request_id="r",
                context_offset=0,
                num_tokens=len(tokens),
                block_ids=tuple(range(-(-len(tokens) // cfg.block_size))),
                token_ids=tuple(tokens) if rank == 0 else None,
                is_last=True,
            )
            out = engine.execute(engine.prepare([chunk]), hidden)
            hidden = out.hidden
        return out.last_token_logits["r"]

    served = pipeline_logits(config)
    diff = (served - expected).abs().max().item()
    print(
        f"first token: served {int(served.argmax())}, transformers {int(expected.argmax())}; "
        f"max |logit difference| {diff:.2e}"
    )
    assert int(served.argmax()) == int(expected.argmax())
    assert diff < 1e-4
    seeded = pipeline_logits(config.model_copy(update={"model_dir": None}))
    assert (seeded - expected).abs().max().item() > 0.1  # control: the path is what matters
