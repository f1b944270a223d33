"""The operator's container args start the real runtime processes (docs/operator.md, contract).

The manifests come from the operator's own builders (StatefulSet, admission and gateway
Deployments, the spec and pool ConfigMaps). Only what a cluster provides is replaced by local
equivalents: the mounted files (spec.json, pool.json) by files in tmp, the NATS URL by a local
nats-server with JetStream, the rendezvous and container ports by free local ports, and the
downward-API env values by what the kubelet would fill in. Each process then runs with exactly
the rendered ``args`` and ``env``, and is probed on the rendered probe paths.
"""

from __future__ import annotations

import argparse
import base64
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from http_support import http_status, post_json
from pod_support import (
    CLUSTER_NATS_URL,
    REF,
    container_of,
    expand,
    kubelet_env,
    localize,
    log_tail,
    probe_path,
    stage_pod,
    start_wavepp,
    wait_200,
)

from wavepp.api.natsauth import TrustRoot
from wavepp.api.spec import CONFIG_EXIT_CODE, MAX_REPLICAS, check_spec, load_spec_file
from wavepp.cli import main as cli_main
from wavepp.launch.flags import ArgError, resolve_rank
from wavepp.launch.gateway import gateway_config_from_spec, pool_replicas
from wavepp.launch.replica import runtime_config_from_args
from wavepp.launch.runtime_config import runtime_configs_from_spec
from wavepp.operator import builders as b
from wavepp.operator import natscreds
from wavepp.operator.containers import (
    HEALTH_PORT,
    HTTP_PORT,
    NATS_CREDS_DIR,
    NATS_TLS_DIR,
    POOL_FILE,
    SPEC_FILE,
    container_args,
)
from wavepp.operator.gateway_builders import build_gateway_deployment
from wavepp.operator.naming import spec_hash
from wavepp.runtime.procs import stop_processes
from wavepp.runtime.transport.natsio import EmbeddedNatsServer, free_port

RAW_SPEC: dict[str, Any] = {
    "model": {"name": "tiny-llama"},
    "stages": 2,
    "replicas": 1,
    "engine": "emulated",
    "engineOptions": {"timeScale": 0.05, "kvBlocks": 256},
}


def _resolved_spec(metrics_port: int = 9400, *, nats: str = "plain") -> Any:
    raw = json.loads(json.dumps(RAW_SPEC)) | {"telemetry": {"metricsPort": metrics_port}}
    if nats == "mutual-tls":
        raw["nats"] = {"tlsSecret": "nats-client-tls"}
    elif nats == "jwt-creds":
        raw["nats"] = {"credentialsSecret": "nats-user-creds"}
    spec, issues = check_spec(raw, default_image="wavepp:test", default_nats_url=CLUSTER_NATS_URL)
    assert spec is not None, issues
    if nats == "rendered-creds":  # as reconcile.plan resolves it with an account seed
        spec = natscreds.with_rendered_creds(spec, REF)
    return spec


# ---- pure parts --------------------------------------------------------------------------


def test_rank_from_flag_or_env() -> None:
    assert resolve_rank("3", {}) == 3
    assert resolve_rank("$(WAVEPP_RANK)", {"WAVEPP_RANK": "1"}) == 1
    assert resolve_rank(None, {"WAVEPP_RANK": "2"}) == 2
    with pytest.raises(ArgError, match=r"--rank \$\(WAVEPP_RANK\)"):
        resolve_rank("$(WAVEPP_RANK)", {})
    with pytest.raises(ArgError, match="--rank 'x'"):
        resolve_rank("x", {"WAVEPP_RANK": "1"})


def test_pool_replicas_admitting_first_then_listed_then_spec() -> None:
    doc = {
        "pipeline": "p",
        "replicas": [
            {"replica": 0, "admitting": False},
            {"replica": 1, "admitting": True},
            {"replica": 2, "admitting": True},
        ],
    }
    assert pool_replicas(doc, 3) == [1, 2]
    doc["replicas"] = [{"replica": 1, "admitting": False}, {"replica": 0, "admitting": False}]
    assert pool_replicas(doc, 3) == [0, 1]
    assert pool_replicas({"pipeline": "p", "replicas": []}, 2) == [0, 1]
    with pytest.raises(ValueError, match="replicas"):
        pool_replicas({"pipeline": "p", "replicas": [{"replica": "0"}]}, 1)


def test_configs_from_the_operator_files_match_the_spec(tmp_path: Path) -> None:
    spec = _resolved_spec()
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(b.build_spec_configmap(REF, spec, spec_hash(spec))["data"]["spec.json"])
    args = argparse.Namespace(
        runtime_config=None, config=str(spec_path), replica=0, pool=None, nats_url="nats://x"
    )
    with pytest.raises(ArgError, match="--pool"):
        runtime_config_from_args(args, {})
    config = runtime_config_from_args(args, {"WAVEPP_PIPELINE": REF.name})
    # spec.json states every default (model.dtype too); a pod must still get the same
    # RuntimeConfig as `wavepp up --config` with the spec as the user wrote it.
    expected = runtime_configs_from_spec(spec, pool=REF.name)[0]
    assert expected == runtime_configs_from_spec(load_spec_file(spec_path), pool=REF.name)[0]
    assert config.model_copy(update={"telemetry": expected.telemetry}) == expected
    assert config.telemetry.metrics_port == spec.telemetry.metrics_port
    # a replica added by a scale-up reads the file of its spec hash, written when the pipeline
    # had fewer replicas (replicas are not hashed; tests/operator/test_scale_under_load)
    args.replica = 1
    config = runtime_config_from_args(args, {"WAVEPP_PIPELINE": REF.name})
    assert config.pipeline == f"{REF.name}-r1"
    assert config.model_copy(update={"pipeline": expected.pipeline}) == (
        expected.model_copy(update={"telemetry": config.telemetry})
    )
    args.replica = MAX_REPLICAS
    with pytest.raises(ArgError, match=rf"--replica {MAX_REPLICAS}: must be in \[0, "):
        runtime_config_from_args(args, {"WAVEPP_PIPELINE": REF.name})

    pool_doc = json.loads(
        b.build_pool_configmap(REF, [b.PoolEntry(0, spec_hash(spec), admitting=False)])["data"][
            "pool.json"
        ]
    )
    gateway = gateway_config_from_spec(spec, pool_doc)
    assert gateway.pool == REF.name
    assert [r.pipeline for r in gateway.replicas] == [expected.pipeline]
    assert gateway.model_id == expected.model_id
    assert gateway.max_prompt_tokens == min(256 * expected.block_size, expected.model.max_position)


def test_bad_operator_args_exit_with_the_config_code_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = _resolved_spec()
    # The operator's containers carry $WAVEPP_CONFIG_EXIT_CODE (the config errors' exit code).
    sts = b.build_stage_statefulset(REF, spec, spec_hash(spec), 0)
    container = sts["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["WAVEPP_CONFIG_EXIT_CODE"] == str(CONFIG_EXIT_CODE)
    monkeypatch.setenv("WAVEPP_CONFIG_EXIT_CODE", env["WAVEPP_CONFIG_EXIT_CODE"])
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec.to_wire()))
    base = ["--config", str(spec_path), "--nats-url", "nats://127.0.0.1:1"]
    stage = ["stage", *base, "--dist-url", "tcp://127.0.0.1:1", "--pool", "p"]
    assert cli_main([*stage, "--rank", "0"]) == CONFIG_EXIT_CODE
    assert "--replica" in capsys.readouterr().err
    assert cli_main([*stage, "--replica", "0", "--rank", "2"]) == CONFIG_EXIT_CODE
    assert "--rank 2: must be in [0, 2)" in capsys.readouterr().err
    missing = str(tmp_path / "nope.creds")
    assert (
        cli_main([*stage, "--replica", "0", "--rank", "0", "--nats-creds", missing])
        == CONFIG_EXIT_CODE
    )
    assert "--nats-creds" in capsys.readouterr().err
    assert cli_main(["gateway", *base, "--port", "8080"]) == CONFIG_EXIT_CODE
    assert "--pool-file" in capsys.readouterr().err
    # A spec the runtime refuses: the same exit code, the message names the field.
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(spec.to_wire() | {"engineOptions": {"emulate": "gpt-9"}}))
    bad_stage = ["stage", "--config", str(bad), "--nats-url", "nats://127.0.0.1:1"]
    bad_stage += ["--dist-url", "tcp://127.0.0.1:1", "--pool", "p", "--replica", "0"]
    assert cli_main([*bad_stage, "--rank", "0"]) == CONFIG_EXIT_CODE == 78
    assert "spec.engineOptions.emulate" in capsys.readouterr().err
    # Outside the operator's pods the same errors are the CLI's usage exit, 2.
    monkeypatch.delenv("WAVEPP_CONFIG_EXIT_CODE")
    assert cli_main([*bad_stage, "--rank", "0"]) == 2
    assert "spec.engineOptions.emulate" in capsys.readouterr().err


async def test_nats_creds_reach_the_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    import nats

    from wavepp.runtime.transport import natsio

    seen: list[dict[str, Any]] = []

    async def fake_connect(url: str, **options: Any) -> str:
        seen.append(options)
        return url

    monkeypatch.setattr(nats, "connect", fake_connect)
    monkeypatch.setenv("WAVEPP_NATS_CREDS", "/env.creds")
    await natsio.connect("nats://h:4222", name="t", creds="/flag.creds")
    await natsio.connect("nats://h:4222", name="t")
    monkeypatch.delenv("WAVEPP_NATS_CREDS")
    await natsio.connect("nats://h:4222", name="t")
    assert [o.get("user_credentials") for o in seen] == ["/flag.creds", "/env.creds", None]


# ---- the processes ----------------------------------------------------------------------


@pytest.mark.parametrize("nats_security", ["plain", "mutual-tls", "jwt-creds", "rendered-creds"])
def test_container_args_start_the_runtime(tmp_path: Path, nats_security: str) -> None:
    """With ``nats.tlsSecret``, the same pods talk to a nats-server that requires TLS and
    verifies client certificates, using the files mounted from the Secret. With
    ``nats.credentialsSecret``, to a server in operator mode (JWT auth) with the user's
    ``.creds`` file mounted from the Secret. With the operator's rendered credentials (the
    default with an account seed), each pod gets only the files its Secret volume's items name,
    under the server that trusts that account: every component works with only its own
    subjects."""
    tls = nats_security == "mutual-tls"
    spec = _resolved_spec(metrics_port=free_port(), nats=nats_security)
    hash_ = spec_hash(spec)
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(b.build_spec_configmap(REF, spec, hash_)["data"]["spec.json"])
    pool_path = tmp_path / "pool.json"
    # A new pipeline: the pool lists replica 0, which does not admit yet.
    pool_cm = b.build_pool_configmap(REF, [b.PoolEntry(0, hash_, admitting=False)])
    pool_path.write_text(pool_cm["data"]["pool.json"])
    sts = b.build_stage_statefulset(REF, spec, hash_, 0)
    stage_c = container_of(sts)
    admission_d = b.build_admission_deployment(REF, spec, hash_, 0, running=True)
    gateway_d = build_gateway_deployment(REF, spec, hash_)
    admission_c, gateway_c = container_of(admission_d), container_of(gateway_d)
    assert stage_c["command"] == admission_c["command"] == gateway_c["command"] == ["wavepp"]
    for c in (stage_c, admission_c, gateway_c):
        assert c["args"] == container_args(
            c["name"], spec, REF, None if c["name"] == "gateway" else 0
        )

    cluster = {
        "--config": SPEC_FILE,
        "--nats-url": CLUSTER_NATS_URL,
        "--pool-file": POOL_FILE,
        "--dist-url": f"tcp://{sts['metadata']['name']}-0.{sts['metadata']['name']}:29500",
        # the stage's health port, the admission's (its probes' port)
        "--health-port": {str(HEALTH_PORT), str(HTTP_PORT)},
        "--port": str(HTTP_PORT),
        "--metrics-port": str(spec.telemetry.metrics_port),  # each stage's own /metrics
    }
    server_tls = None
    local_tls: dict[str, str] = {}
    if tls:
        from nats_tls_support import make_tls_files

        files = make_tls_files(tmp_path / "tls")
        server_tls = (files.server_cert, files.server_key, files.ca)
        local_tls = {
            "--nats-tls-ca": files.ca,
            "--nats-tls-cert": files.client_cert,
            "--nats-tls-key": files.client_key,
        }
        cluster |= {
            flag: f"{NATS_TLS_DIR}/{name}"
            for flag, name in zip(local_tls, ["ca.crt", "tls.crt", "tls.key"], strict=True)
        }
        for c in (stage_c, admission_c, gateway_c):
            assert set(local_tls) <= set(c["args"]), c["args"]
            mount = next(m for m in c["volumeMounts"] if m["mountPath"] == NATS_TLS_DIR)
            assert mount["readOnly"] is True
        volumes = sts["spec"]["template"]["spec"]["volumes"]
        assert {"name": "nats-tls", "secret": {"secretName": "nats-client-tls"}} in volumes
    server_config = None
    if nats_security == "jwt-creds":
        from nats_auth_support import make_auth_files

        auth = make_auth_files(tmp_path / "auth", tmp_path / "js")
        server_config = auth.server_config
        local_tls = {"--nats-creds": auth.creds}  # the Secret's file, made local
        cluster["--nats-creds"] = f"{NATS_CREDS_DIR}/creds"
        for c in (stage_c, admission_c, gateway_c):
            assert "--nats-creds" in c["args"], c["args"]
    mounts: dict[str, Path] = {}  # container name -> local copy of its nats-creds volume
    if nats_security == "rendered-creds":
        trust = TrustRoot.new()
        secret = natscreds.build_nats_creds_secret(REF, spec, trust.account_seed)
        server_config = str(tmp_path / "server.conf")
        Path(server_config).write_text(trust.server_config(str(tmp_path / "js")))
        for name, manifest in (("stage", sts), ("admission", admission_d), ("gateway", gateway_d)):
            (volume,) = [
                v
                for v in manifest["spec"]["template"]["spec"]["volumes"]
                if v["name"] == "nats-creds"
            ]
            mounts[name] = tmp_path / "mounts" / name
            mounts[name].mkdir(parents=True)
            for item in volume["secret"]["items"]:
                data = base64.b64decode(secret["data"][item["key"]])
                (mounts[name] / item["path"]).write_bytes(data)
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []
    with EmbeddedNatsServer(
        jetstream=server_config is None,
        store_dir=str(tmp_path / "js"),
        tls=server_tls,
        config_file=server_config,
    ) as nats:
        nats_url = nats.url.replace("tls://", "nats://")  # as the spec's URL: TLS from the CA
        common = {
            "--config": str(spec_path),
            "--nats-url": nats_url,
            "--pool-file": str(pool_path),
            **local_tls,
        }
        dist_url = f"tcp://127.0.0.1:{free_port()}"

        def start(name: str, container: dict, local: dict[str, str], env: dict) -> Any:
            args = [expand(a, env) for a in container["args"]]
            if name == "stage-1":
                # As a pod whose args were not expanded: the stage reads $WAVEPP_RANK itself.
                args = list(container["args"])
            if container["name"] in mounts:  # the pod's own mount, made local
                local_dir = str(mounts[container["name"]])
                args = [a.replace(NATS_CREDS_DIR, local_dir) for a in args]
                env = {k: v.replace(NATS_CREDS_DIR, local_dir) for k, v in env.items()}
            log = tmp_path / f"{name}.log"
            proc = start_wavepp(localize(args, common | local, cluster), log, env)
            procs.append(proc)
            logs.append(log)
            return proc, log

        try:
            stages = []
            for rank in range(spec.num_stages):
                local, env, port = stage_pod(sts, stage_c, rank, dist_url)
                proc, log = start(f"stage-{rank}", stage_c, local, env)
                stages.append((proc, log, f"http://127.0.0.1:{port}"))
                if rank == 0:
                    # Alone, the group cannot form: alive, but not started.
                    wait_200(f"{stages[0][2]}{probe_path(stage_c, 'livenessProbe')}", proc, log)
                    startup = f"{stages[0][2]}{probe_path(stage_c, 'startupProbe')}"
                    assert http_status(startup) == 503
            admission_port, gateway_port = free_port(), free_port()
            adm_env = kubelet_env(admission_c, "tiny-r0-admission-x", {})
            adm, adm_log = start(
                "admission", admission_c, {"--health-port": str(admission_port)}, adm_env
            )
            gw_env = kubelet_env(gateway_c, "tiny-gateway-x", {})
            gw, gw_log = start("gateway", gateway_c, {"--port": str(gateway_port)}, gw_env)

            for proc, log, base in stages:
                wait_200(f"{base}{probe_path(stage_c, 'startupProbe')}", proc, log)
                wait_200(f"{base}{probe_path(stage_c, 'readinessProbe')}", proc, log)
                assert http_status(f"{base}{probe_path(stage_c, 'livenessProbe')}") == 200
            admission = f"http://127.0.0.1:{admission_port}"
            wait_200(f"{admission}{probe_path(admission_c, 'readinessProbe')}", adm, adm_log)
            assert http_status(f"{admission}{probe_path(admission_c, 'livenessProbe')}") == 200
            # The admission process serves Prometheus metrics on the spec's port.
            assert http_status(f"http://127.0.0.1:{spec.telemetry.metrics_port}/metrics") == 200
            gateway = f"http://127.0.0.1:{gateway_port}"
            wait_200(f"{gateway}{probe_path(gateway_c, 'readinessProbe')}", gw, gw_log)

            block_size = spec.cache.block_size
            token_ids = [(7 * i) % 200 + 1 for i in range(3 * block_size + 5)]
            status, first = post_json(
                f"{gateway}/v1/prefill", {"tenant": "default", "token_ids": token_ids}
            )
            assert status == 200, first
            assert first["num_prompt_tokens"] == len(token_ids)
            assert first["replica"] == f"{REF.name}-r0"
            assert not first["error"], first
            # The same prompt again: its full blocks are cached on both stages.
            status, second = post_json(
                f"{gateway}/v1/prefill", {"tenant": "default", "token_ids": token_ids}
            )
            assert status == 200, second
            assert second["num_cached_tokens"] == 3 * block_size
            assert second["first_token_id"] == first["first_token_id"]
        except pytest.fail.Exception as exc:
            # the process waited on may be stuck because another one died: show every log
            tails = "\n".join(
                f"--- {log.name} (exit {proc.poll()}):\n{log_tail(log)}"
                for proc, log in zip(procs, logs, strict=True)
            )
            pytest.fail(f"{exc}\n{tails}")
        finally:
            stop_processes(reversed(procs))
