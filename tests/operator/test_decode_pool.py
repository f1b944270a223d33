"""The decode section on Kubernetes: ``examples/wavepipeline-pd.yaml`` rendered by the operator's
planner (a vLLM decode Deployment and Service, the gateway's decode URLs, the NetworkPolicy rule
to the stages' KV transfer port), every object validated offline, and the spec's refusals."""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from operator_support import kubernetes_validate, pod_status

from wavepp.api.pod import HANDOFF_PORT, POD_IP_ENV
from wavepp.api.spec import DECODE_PORT, check_spec, decode_urls
from wavepp.api.vllm_decode import CONNECTOR_CONFIG, vllm_decode_args
from wavepp.launch.flags import ArgError
from wavepp.launch.gateway import gateway_config_from_spec
from wavepp.launch.replica import runtime_config_from_args
from wavepp.operator.naming import LABEL_COMPONENT, LABEL_PIPELINE, spec_hash
from wavepp.operator.reconcile import Apply, Create, Defaults, Delete, Observed, plan

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "wavepipeline-pd.yaml"
DEFAULTS = Defaults(image="img:1", nats_url="nats://n:4222")


def _body(spec_patch: dict[str, Any] | None = None) -> dict[str, Any]:
    body = yaml.safe_load(EXAMPLE.read_text())
    body["metadata"]["uid"] = "pd-uid"
    if spec_patch:
        body["spec"].update(spec_patch)
    return body


def _rendered(body: dict[str, Any], observed: Observed | None = None) -> dict[tuple[str, str], Any]:
    actions = plan(body, observed or Observed(), 0.0, DEFAULTS).actions
    return {
        (a.manifest["kind"], a.manifest["metadata"]["name"]): a.manifest
        for a in actions
        if isinstance(a, (Apply, Create))
    }


def test_the_example_renders_a_decode_pool_and_every_object_validates(tmp_path: Path) -> None:
    objects = _rendered(_body())
    deployment = objects[("Deployment", "small-pd-decode")]
    service = objects[("Service", "small-pd-decode")]
    pool = yaml.safe_load(EXAMPLE.read_text())["spec"]["decode"]["pool"]

    # The example autoscales the pool: the HPA owns the count (test_decode_scaling).
    assert "replicas" not in deployment["spec"] and "replicas" not in pool
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == pool["image"]
    # The one vLLM command line (wavepp up --decode vllm runs the same builder), then args.
    expected = vllm_decode_args(
        model_dir="/models",
        model_name="small-llama",
        host="0.0.0.0",
        port=DECODE_PORT,
        dtype="bfloat16",
        max_model_len=4096,
        on_cpu=False,
        has_tokenizer=True,
    )
    drain = ["--shutdown-timeout", str(pool["drainSeconds"])]
    assert container["command"] == ["python3", *expected, *drain, *pool["args"]]
    kv = container["command"][container["command"].index("--kv-transfer-config") + 1]
    assert json.loads(kv) == CONNECTOR_CONFIG
    assert container["resources"]["limits"] == {"cpu": "4", "memory": "32Gi", "nvidia.com/gpu": "1"}
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]
    assert pod["tolerations"] == pool["tolerations"]
    assert not any("secret" in v for v in pod["volumes"])  # it holds no WavePP secret
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"] == [{"name": "http", "port": DECODE_PORT, "targetPort": "http"}]

    # The stages listen for KV transfers; exactly the decode pods may reach that port.
    stage_policy = objects[("NetworkPolicy", "small-pd-stage")]["spec"]["ingress"]
    decode_selector = deployment["spec"]["selector"]["matchLabels"]
    handoff_rules = [
        r for r in stage_policy if {"protocol": "TCP", "port": HANDOFF_PORT} in r.get("ports", [])
    ]
    assert handoff_rules == [
        {
            "from": [{"podSelector": {"matchLabels": decode_selector}}],
            "ports": [{"protocol": "TCP", "port": HANDOFF_PORT}],
        }
    ]
    assert decode_selector.items() <= labels.items()
    sts = objects[("StatefulSet", "small-pd-r0")]
    stage = sts["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "handoff", "containerPort": HANDOFF_PORT, "protocol": "TCP"} in stage["ports"]
    assert {"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in stage[
        "env"
    ]
    # Decode pods take requests from the pipeline's gateway only (and Prometheus's scrapes:
    # vLLM serves /metrics on the same port; test_decode_scaling).
    decode_policy = objects[("NetworkPolicy", "small-pd-decode")]["spec"]
    assert decode_policy["podSelector"]["matchLabels"] == decode_selector
    assert decode_policy["ingress"][0] == {
        "from": [
            {
                "podSelector": {
                    "matchLabels": {LABEL_PIPELINE: "small-pd", LABEL_COMPONENT: "gateway"}
                }
            }
        ],
        "ports": [{"protocol": "TCP", "port": DECODE_PORT}],
    }
    rc, output = kubernetes_validate(list(objects.values()), tmp_path)
    assert rc == 0, output


def test_the_pods_read_the_decode_urls_and_the_handoff_address_from_the_rendered_files(
    tmp_path: Path,
) -> None:
    """The gateway and stage processes, given the files the operator renders (spec.json,
    pool.json; the checkpoint moved from the PVC to a local random one), serve whole
    completions through the rendered Service and listen for KV transfers on the pod's IP."""
    from wavepp.bench.checkpoints import save_random_checkpoint

    objects = _rendered(_body())
    spec_name = next(n for k, n in objects if k == "ConfigMap" and n.startswith("small-pd-spec-"))
    raw = json.loads(objects[("ConfigMap", spec_name)]["data"]["spec.json"])
    pool_doc = json.loads(objects[("ConfigMap", "small-pd-pool")]["data"]["pool.json"])
    save_random_checkpoint("llama", tmp_path / "ckpt", num_layers=8, vocab_size=64)
    raw["model"] |= {"path": str(tmp_path / "ckpt"), "dtype": "float32"}
    raw["model"].pop("pvc")
    raw["resources"]["gpusPerStage"] = 0
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(raw))
    spec, issues = check_spec(raw)
    assert spec is not None, issues

    gateway = gateway_config_from_spec(spec, pool_doc, namespace="default")
    service = objects[("Service", "small-pd-decode")]
    assert gateway.decode_urls == [f"http://small-pd-decode.default.svc:{DECODE_PORT}"]
    assert service["metadata"]["namespace"] == "default"

    args = argparse.Namespace(
        runtime_config=None, config=str(spec_path), replica=0, pool=None, nats_url="nats://x"
    )
    env = {"WAVEPP_PIPELINE": "small-pd", "WAVEPP_NAMESPACE": "default"}
    with pytest.raises(ArgError, match=rf"\${POD_IP_ENV}: required with the spec's decode"):
        runtime_config_from_args(args, env)
    config = runtime_config_from_args(args, env | {POD_IP_ENV: "10.1.2.3"})
    assert config.handoff_listen == f"0.0.0.0:{HANDOFF_PORT}"
    assert config.handoff_advertise == "10.1.2.3"

    # Without a decode section: prefill only, the stages' handoff stays on loopback.
    raw.pop("decode")
    spec_path.write_text(json.dumps(raw))
    spec, _ = check_spec(raw)
    assert spec is not None
    assert gateway_config_from_spec(spec, pool_doc, namespace="default").decode_urls == []
    assert runtime_config_from_args(args, env).handoff_listen.startswith("127.0.0.1:")


def test_a_referenced_service_is_the_gateways_and_its_pods_reach_the_stages() -> None:
    ref = {"name": "my-decode", "port": 9000, "podSelector": {"app": "my-decode"}}
    objects = _rendered(_body({"decode": {"service": ref}}))
    assert not [k for k in objects if k[1] == "small-pd-decode"]  # nothing rendered for it
    ingress = objects[("NetworkPolicy", "small-pd-stage")]["spec"]["ingress"]
    assert {
        "from": [{"podSelector": {"matchLabels": {"app": "my-decode"}}}],
        "ports": [{"protocol": "TCP", "port": HANDOFF_PORT}],
    } in ingress
    spec, issues = check_spec(
        _body({"decode": {"service": ref}})["spec"], default_image="i", default_nats_url="nats://n"
    )
    assert spec is not None, issues
    assert decode_urls(spec.decode, pipeline="small-pd", namespace="llm") == [
        "http://my-decode.llm.svc:9000"
    ]


def test_removing_the_pool_deletes_its_objects_and_its_policy() -> None:
    before = _rendered(_body())
    observed = Observed(
        deployments=[before[("Deployment", "small-pd-decode")]],
        services=[before[("Service", "small-pd-decode")]],
        network_policies=[o for (k, _), o in before.items() if k == "NetworkPolicy"],
    )
    body = _body()
    del body["spec"]["decode"]
    actions = plan(body, observed, 0.0, DEFAULTS).actions
    deleted = {(a.kind, a.name) for a in actions if isinstance(a, Delete)}
    assert {
        ("Deployment", "small-pd-decode"),
        ("Service", "small-pd-decode"),
        ("NetworkPolicy", "small-pd-decode"),
    } <= deleted


def test_the_pools_size_and_image_do_not_roll_the_stages() -> None:
    spec, _ = check_spec(_body()["spec"], default_image="i", default_nats_url="nats://n")
    assert spec is not None
    pool = spec.decode.pool  # type: ignore[union-attr]
    bigger = spec.model_copy(
        update={
            "decode": spec.decode.model_copy(
                update={"pool": pool.model_copy(update={"replicas": 8, "image": "v:2"})}
            )
        }  # type: ignore[union-attr]
    )
    assert spec_hash(bigger) == spec_hash(spec)
    body = _body()
    del body["spec"]["decode"]
    without, _ = check_spec(body["spec"], default_image="i", default_nats_url="nats://n")
    assert without is not None
    assert spec_hash(without) != spec_hash(spec)  # the stages start a transfer server


@pytest.mark.parametrize(
    ("decode", "patch", "field", "text"),
    [
        ({}, {}, "spec.decode", "exactly one of decode.service"),
        (
            {"pool": {"image": "v"}, "service": {"name": "d", "port": 8000}},
            {},
            "spec.decode",
            "exactly one of",
        ),
        (
            {"pool": {"image": "v"}},
            {"model": {"name": "small-llama"}},
            "spec.decode.pool",
            "model.path or model.pvc",
        ),
        (
            {"service": {"name": "d", "port": 8000}},
            {},
            "spec.decode.service.podSelector",
            "networkPolicy.enabled",
        ),
        (
            {"pool": {"image": "v", "replicas": -1}},
            {},
            "decode.pool.replicas",
            "greater than or equal",
        ),
        (
            {"pool": {"image": "v", "resources": {"memory": "lots"}}},
            {},
            "decode.pool.resources.memory",
            "pattern",
        ),
        ({"service": {"name": "Bad_Name", "port": 8000}}, {}, "decode.service.name", "pattern"),
        (
            {"service": {"name": "d", "port": 70000}},
            {},
            "decode.service.port",
            "less than or equal",
        ),
    ],
)
def test_bad_decode_sections_are_refused_naming_the_field(
    decode: dict[str, Any], patch: dict[str, Any], field: str, text: str
) -> None:
    raw = copy.deepcopy(_body()["spec"]) | patch
    raw["decode"] = decode
    spec, issues = check_spec(raw, default_image="i", default_nats_url="nats://n")
    assert spec is None
    assert any(field in i.field and text in i.message for i in issues), issues


def test_the_emulated_engine_has_no_kv_to_hand_off() -> None:
    raw = {"model": {"name": "tiny-llama"}, "engine": "emulated", "stages": 2}
    raw["decode"] = {"service": {"name": "d", "port": 8000, "podSelector": {"app": "d"}}}
    spec, issues = check_spec(raw, default_image="i", default_nats_url="nats://n")
    assert spec is None
    assert [i.field for i in issues] == ["spec.decode"], issues


def _decode_condition(body: dict[str, Any], observed: Observed) -> dict[str, Any] | None:
    conditions = plan(body, observed, 0.0, DEFAULTS).status["conditions"]
    found = [c for c in conditions if c["type"] == "DecodeReady"]
    assert len(found) <= 1
    return found[0] if found else None


def test_decode_ready_follows_the_decode_pods() -> None:
    body = _body()
    deployment = _rendered(body)[("Deployment", "small-pd-decode")]
    deployment["spec"]["replicas"] = 2  # as the API server holds it: the HPA's count
    template = deployment["spec"]["template"]

    def pod(name: str, phase: str) -> dict[str, Any]:
        meta = {"name": name, "namespace": "default", "labels": template["metadata"]["labels"]}
        return {"metadata": meta, "spec": template["spec"], "status": pod_status(phase)}

    assert _decode_condition(body, Observed())["reason"] == "DecodeNotCreated"  # type: ignore[index]
    pods = [pod("d-1", "formed"), pod("d-2", "pending")]  # running, not Ready; unscheduled
    cond = _decode_condition(body, Observed(deployments=[deployment], pods=pods))
    assert cond is not None
    assert (cond["status"], cond["reason"], cond["message"]) == (
        "False",
        "NoDecodePodReady",
        "0/2 decode pods Ready",
    )
    pods[0] = pod("d-1", "warm")  # its readiness probe passes
    cond = _decode_condition(body, Observed(deployments=[deployment], pods=pods))
    assert cond is not None
    assert (cond["status"], cond["reason"], cond["message"]) == (
        "True",
        "DecodePodsReady",
        "1/2 decode pods Ready",
    )
    ref = {"name": "my-decode", "port": 9000, "podSelector": {"app": "my-decode"}}
    cond = _decode_condition(_body({"decode": {"service": ref}}), Observed())
    assert cond is not None
    assert (cond["status"], cond["reason"]) == ("Unknown", "ExternalService")
    body = _body()
    del body["spec"]["decode"]
    assert _decode_condition(body, Observed()) is None


@pytest.mark.parametrize(
    ("endpoint", "protocol"),
    [("http://otel:4318/v1/traces", "http/protobuf"), ("otel:4317", "grpc"), (None, None)],
)
def test_the_decode_pods_export_their_spans_where_the_pipelines_do(
    endpoint: str | None, protocol: str | None
) -> None:
    body = _body({"telemetry": {"otlpEndpoint": endpoint}} if endpoint else None)
    deployment = _rendered(body)[("Deployment", "small-pd-decode")]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    command, env = container["command"], {e["name"]: e.get("value") for e in container["env"]}
    if endpoint is None:
        assert "--otlp-traces-endpoint" not in command
        assert "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL" not in env
        return
    at = command.index("--otlp-traces-endpoint")
    assert command[at + 1] == endpoint
    assert env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == protocol
