"""The pure parts of ``wavepp up`` (``launch.up``) a first run depends on: the spec's
``rollout.drainTimeoutSeconds`` reaches the admissions and up's own stop, fields only the
operator applies are named at start, ``--tensor-parallel-size``, and metrics bound to
``--host``. No process of the service is started here (one short child in the stop test)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from wavepp import cli
from wavepp.api.spec import check_spec
from wavepp.launch.flags import FlagError
from wavepp.launch.runtime_config import runtime_configs_from_spec
from wavepp.launch.up import (
    child_commands,
    drain_times,
    local_resources,
    operator_only_warnings,
    serving_line,
    spec_mapping,
    store_limit_config,
    up_dirs,
    with_telemetry,
)
from wavepp.runtime.serving.processes import Supervisor
from wavepp.telemetry.metrics import PrometheusExport


def _up_args(*argv: str) -> argparse.Namespace:
    return cli.build_parser(["up"]).parse_args(["up", *argv])


def _spec_and_configs(raw: dict, pool: str = "default") -> tuple:
    spec, issues = check_spec(
        local_resources(raw), default_image="local", default_nats_url="nats://embedded"
    )
    assert spec is not None, issues
    configs = with_telemetry(runtime_configs_from_spec(spec, pool=pool), spec, raw)
    return spec, configs


def _sub_args(command: list[str]) -> argparse.Namespace:
    """A child's command line (after ``python -m wavepp.cli``) parsed by its own parser."""
    argv = command[3:]
    return cli.build_parser(argv[:1]).parse_args(argv)


# ---- 1. rollout.drainTimeoutSeconds -------------------------------------------------------


@pytest.mark.parametrize(
    ("drain_timeout", "expected"), [(90.0, (85.0, 90.0)), (60.0, (55.0, 60.0)), (0.0, (0.0, 10.0))]
)
def test_drain_times_follow_the_operator(drain_timeout: float, expected: tuple) -> None:
    raw = {"model": {"name": "tiny-llama"}, "stages": 2}
    raw["rollout"] = {"drainTimeoutSeconds": drain_timeout}
    spec, _ = _spec_and_configs(raw)
    assert drain_times(spec) == expected


def test_admission_command_carries_the_spec_drain_timeout(tmp_path: Path) -> None:
    raw = {"model": {"name": "tiny-llama"}, "stages": 2, "replicas": 2}
    raw["rollout"] = {"drainTimeoutSeconds": 90}
    spec, configs = _spec_and_configs(raw)
    drain_s, _ = drain_times(spec)
    args = _up_args("--host", "127.0.0.1")
    commands = dict(
        child_commands(
            configs,
            [str(tmp_path / f"{c.pipeline}.json") for c in configs],
            ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"],
            args=args,
            nats_url="nats://127.0.0.1:4222",
            port=8000,
            drain_s=drain_s,
            creds=None,
            gateway_config=str(tmp_path / "gateway.json"),
        )
    )
    admissions = [n for n in commands if n.startswith("admission-")]
    assert len(admissions) == 2
    for name in admissions:
        assert _sub_args(commands[name]).drain_timeout_s == 85.0


def test_stop_waits_the_grace_for_a_draining_child_then_kills(tmp_path: Path) -> None:
    """A child that takes 1 s to leave after SIGTERM (a drain) exits on its own within a
    longer grace; one that ignores SIGTERM is killed once a short grace has passed."""
    slow_exit = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(1.0), sys.exit(0)))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    ignores = (
        "import signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    sup = Supervisor(tmp_path)
    sup.start("drainer", [sys.executable, "-c", slow_exit])
    sup.start("stubborn", [sys.executable, "-c", ignores])
    deadline = time.monotonic() + 30
    while not all("ready" in sup.log_tail(n) for n in ("drainer", "stubborn")):
        assert time.monotonic() < deadline, "children did not start"
        time.sleep(0.05)
    sup.stop(["drainer"], grace_s=20.0)
    assert sup.procs["drainer"].returncode == 0
    started = time.monotonic()
    sup.stop(["stubborn"], grace_s=0.5)
    assert sup.procs["stubborn"].returncode == -signal.SIGKILL
    assert time.monotonic() - started < 10.0


# ---- 2. fields only the operator applies ------------------------------------------------------


def test_operator_only_fields_are_named_one_line_each() -> None:
    raw = {
        "model": {"name": "tiny-llama"},
        "stages": 2,
        "autoscaling": {"maxReplicas": 4},
        "nodeSelector": {"gpu": "h100"},
        "resources": {"gpusPerStage": 0, "cpu": "2"},
        "nats": {"url": "nats://nats:4222"},
        "rollout": {"drainTimeoutSeconds": 30},
        "telemetry": {"metricsPort": 9400},
        "decode": {"service": {"name": "d", "port": 8000}},
    }
    lines = operator_only_warnings(raw)
    assert [line.split(":")[0] for line in lines] == [
        "spec.autoscaling",
        "spec.nodeSelector",
        "spec.decode",
        "spec.resources.cpu",
        "spec.nats.url",
    ]
    assert lines[0] == (
        "spec.autoscaling: applied by the Kubernetes operator only; wavepp up runs "
        "spec.replicas replicas"
    )


def test_snake_case_fields_are_named_too_and_a_plain_spec_has_none() -> None:
    assert operator_only_warnings({"model": {"name": "tiny-llama"}, "stages": 2}) == []
    assert operator_only_warnings({"network_policy": {"enabled": True}}) == [
        "spec.networkPolicy: a NetworkPolicy the operator renders; wavepp up makes none (its "
        "NATS bus has per-process credentials)"
    ]


# ---- 3. --tensor-parallel-size ------------------------------------------------------------------


def test_tensor_parallel_flag_sets_the_spec_and_the_serving_line() -> None:
    raw = spec_mapping(_up_args("--stages", "2", "--tensor-parallel-size", "2"))
    assert raw["tensorParallelSize"] == 2
    _, configs = _spec_and_configs(raw)
    assert configs[0].tensor_parallel_size == 2
    line = serving_line("http://127.0.0.1:8000", "default", configs, "", "nats://x", True, "/l")
    assert "1 replica(s) x 2 torch stages x tensor parallel 2 of tiny-llama" in line


def test_tensor_parallel_flag_replaces_the_spec_value_and_refuses_zero() -> None:
    with pytest.raises(FlagError) as exc:
        spec_mapping(_up_args("--tensor-parallel-size", "0"))
    assert exc.value.flag == "--tensor-parallel-size"
    assert "0: must be >= 1" in str(exc.value)


def test_a_spec_refused_for_a_flag_names_the_flag_and_the_file_it_overrides(
    tmp_path: Path,
) -> None:
    """--stages beyond the model's layers: alone, the refusal names --stages; over --config, it
    names both and says the file was overridden (the file alone would have been accepted)."""
    from wavepp.launch.up import plan_up

    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"model": {"name": "tiny-llama"}, "stages": 2}))
    with pytest.raises(FlagError, match="exceeds the model's 8 layers") as alone:
        plan_up(_up_args("--stages", "9", "--port", "0"))
    assert alone.value.flag == "--stages"
    assert str(alone.value).startswith("spec.stages: stages=9"), str(alone.value)
    with pytest.raises(FlagError, match="exceeds the model's 8 layers") as over:
        plan_up(_up_args("--config", str(spec), "--stages", "9", "--port", "0"))
    assert over.value.flag == "--config/--stages"
    assert f"{spec} with --stages: spec.stages" in str(over.value), str(over.value)


# ---- 4. metrics bind --host -------------------------------------------------------------------


def test_children_bind_their_metrics_to_the_up_host(tmp_path: Path) -> None:
    raw = {"model": {"name": "tiny-llama"}, "stages": 2, "telemetry": {"metricsPort": 19400}}
    spec, configs = _spec_and_configs(raw)
    commands = child_commands(
        configs,
        [str(tmp_path / "r0.json")],
        ["tcp://127.0.0.1:1"],
        args=_up_args("--host", "127.0.0.2"),
        nats_url="nats://127.0.0.1:4222",
        port=8000,
        drain_s=drain_times(spec)[0],
        creds=None,
        gateway_config=str(tmp_path / "gateway.json"),
    )
    parsed = {name: _sub_args(command) for name, command in commands}
    stages = [a for n, a in parsed.items() if n.startswith("stage-")]
    assert [a.metrics_port for a in stages] == [19401, 19402]
    assert {a.metrics_host for a in stages} == {"127.0.0.2"}
    admission = next(a for n, a in parsed.items() if n.startswith("admission-"))
    assert admission.metrics_host == "127.0.0.2"
    assert parsed["gateway"].host == "127.0.0.2"


def test_pods_keep_every_interface_by_default() -> None:
    stage = ["stage", "--config", "c", "--nats-url", "nats://n:4222", "--dist-url", "tcp://s:1"]
    admission = ["admission", "--config", "c", "--nats-url", "nats://n:4222"]
    for argv in (stage, admission):
        assert cli.build_parser(argv[:1]).parse_args(argv).metrics_host == "0.0.0.0"


def test_prometheus_export_binds_the_given_host() -> None:
    export = PrometheusExport("test")
    try:
        port = export.serve(0, "127.0.0.1")
        assert export._server.server_address[0] == "127.0.0.1"  # type: ignore[attr-defined]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            assert response.status == 200
    finally:
        export.shutdown()


def test_stage_metrics_bind_the_given_host() -> None:
    from types import SimpleNamespace

    from wavepp.runtime.stage.metrics import serve_stage_metrics

    metrics = serve_stage_metrics(SimpleNamespace(rank=0), 0, "127.0.0.1")
    assert metrics is not None
    try:
        assert metrics.export._server.server_address[0] == "127.0.0.1"  # type: ignore[attr-defined]
    finally:
        metrics.shutdown()


# ---- 5. a metricsPort whose derived ports hold the gateway's ------------------------------


def test_metrics_ports_that_include_the_gateway_port_are_refused_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """R = 2, S = 2 and metricsPort 18086: admissions on 18086, 18087, stages on 18088..18091;
    a gateway on 18090 would leave stage r1-0 restarting forever on a port it cannot bind."""
    raw = {
        "model": {"name": "tiny-llama"},
        "stages": 2,
        "replicas": 2,
        "telemetry": {"metricsPort": 18086},
    }
    spec, configs = _spec_and_configs(raw)
    for port in (18086, 18090, 18091):
        with pytest.raises(ValueError, match=rf"telemetry.metricsPort 18086: .* --port {port}"):
            with_telemetry(configs, spec, raw, gateway_port=port)
    for port in (0, 18085, 18092):  # outside (0: a free port, chosen later)
        with_telemetry(configs, spec, raw, gateway_port=port)
    config = tmp_path / "spec.json"
    config.write_text(json.dumps(raw))
    code = cli.main(["up", "--config", str(config), "--port", "18090"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "telemetry.metricsPort 18086" in err[0] and "--port 18090" in err[0], err
    assert "18086..18091" in err[0]


# ---- 5. --planner-cost-model ------------------------------------------------------------------


def test_planner_cost_model_reaches_every_admission_and_a_bad_one_is_refused(
    tmp_path: Path,
) -> None:
    from wavepp.launch.up import plan_up

    fit = tmp_path / "fit.json"
    fit.write_text(json.dumps({"c": 1e-3, "g": 1e-6, "b": 1e-5, "a": 1e-8, "label": "measured"}))
    args = _up_args("--stages", "2", "--port", "0", "--planner-cost-model", str(fit))
    plan = plan_up(args)
    commands = child_commands(
        plan.configs,
        [str(tmp_path / "r0.json")],
        ["tcp://127.0.0.1:1"],
        args=args,
        nats_url="nats://127.0.0.1:4222",
        port=8000,
        drain_s=plan.drain_s,
        creds=None,
        gateway_config=str(tmp_path / "gateway.json"),
    )
    admission = next(_sub_args(c) for n, c in commands if n.startswith("admission-"))
    assert admission.planner_cost_model == str(fit.resolve())
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    for path, why in ((bad, "missing coefficients"), (tmp_path / "missing.json", "No such file")):
        with pytest.raises(FlagError, match=why) as refused:
            plan_up(_up_args("--stages", "2", "--port", "0", "--planner-cost-model", str(path)))
        assert refused.value.flag == "--planner-cost-model"


def test_up_dirs_default_under_the_state_folder_and_follow_their_flags(tmp_path: Path) -> None:
    state = tmp_path / "state"
    assert up_dirs(_up_args("--state-dir", str(state))) == (
        state.resolve(),
        state.resolve() / "logs",
        state.resolve() / "jetstream",
    )
    assert state.is_dir()  # created
    logs, store = tmp_path / "l", tmp_path / "js"
    args = _up_args(
        "--state-dir", str(state), "--log-dir", str(logs), "--jetstream-dir", str(store)
    )
    assert up_dirs(args)[1:] == (logs.resolve(), store.resolve())
    fresh, _, _ = up_dirs(_up_args())
    assert fresh.is_dir() and fresh.name.startswith("wavepp-up-")
    fresh.rmdir()


def test_the_insecure_servers_store_limit_is_a_config_file_only_when_capped(
    tmp_path: Path,
) -> None:
    assert store_limit_config(tmp_path, 0) is None
    assert not list(tmp_path.iterdir())
    path = store_limit_config(tmp_path, 1 << 30)
    assert path is not None
    assert Path(path).read_text() == "jetstream: { max_file_store: 1073741824 }\n"


def test_pin_cores_gives_every_stage_of_every_replica_its_own_share(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eight cores for 2 x 2 stages (patched: the host may have fewer cores than stages)."""
    import wavepp.runtime.serving.processes as processes

    monkeypatch.setattr(processes, "launcher_cores", lambda: list(range(8)))

    def stage_cores_of(raw: dict) -> list:
        spec, configs = _spec_and_configs(raw)
        commands = child_commands(
            configs,
            [str(tmp_path / f"r{i}.json") for i in range(len(configs))],
            [f"tcp://127.0.0.1:{i + 1}" for i in range(len(configs))],
            args=_up_args(),
            nats_url="nats://127.0.0.1:4222",
            port=8000,
            drain_s=drain_times(spec)[0],
            creds=None,
            gateway_config=str(tmp_path / "gateway.json"),
        )
        return [_sub_args(c).cores for n, c in commands if n.startswith("stage-")]

    raw = {"model": {"name": "tiny-llama"}, "stages": 2, "replicas": 2}
    assert stage_cores_of(raw) == [None] * 4  # off by default: every stage floats
    pinned = stage_cores_of(raw | {"engineOptions": {"pinCores": True}})
    assert pinned == ["0,1", "2,3", "4,5", "6,7"]


def test_pin_cores_with_fewer_cores_than_stages_is_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pinCores on 3 cores for 2 x 2 stages: ``wavepp up`` refuses at start, naming
    ``engineOptions.pinCores`` and the counts, rather than letting every stage float; 4 cores
    are enough."""
    import wavepp.launch.up as up
    from wavepp.launch.up import plan_up

    spec = tmp_path / "spec.json"
    spec.write_text(
        json.dumps(
            {
                "model": {"name": "tiny-llama"},
                "stages": 2,
                "replicas": 2,
                "engineOptions": {"pinCores": True},
            }
        )
    )
    monkeypatch.setattr(up, "launcher_cores", lambda: [0, 1, 2])
    with pytest.raises(FlagError, match=r"engineOptions.pinCores: 4 stages on 3 cores") as refused:
        plan_up(_up_args("--config", str(spec), "--port", "0"))
    assert refused.value.flag == "--config"
    monkeypatch.setattr(up, "launcher_cores", lambda: [0, 1, 2, 3])
    assert [
        c.pin_cores for c in plan_up(_up_args("--config", str(spec), "--port", "0")).configs
    ] == [True, True]
