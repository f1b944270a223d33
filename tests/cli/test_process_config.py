"""The per-process settings ``wavepp.launch`` resolves from a subcommand's flags and
environment: a stage's own metrics port, the admission's pool, the gateway's bind address."""

from __future__ import annotations

from pathlib import Path

import pytest

from wavepp import cli
from wavepp.launch.flags import POOL_ENV, ArgError
from wavepp.launch.gateway import gateway_config_from_args, gateway_host
from wavepp.launch.replica import admission_pool, stage_config_from_args
from wavepp.runtime.config import RuntimeConfig
from wavepp.telemetry.settings import TelemetrySettings


def _parse(*argv: str):  # noqa: ANN202 - argparse.Namespace
    return cli.build_parser(argv[:1]).parse_args(list(argv))


def _runtime_config(tmp_path: Path) -> str:
    path = tmp_path / "rc.json"
    config = RuntimeConfig(telemetry=TelemetrySettings(metrics_port=9100))
    path.write_text(config.model_dump_json())
    return str(path)


def test_a_stages_metrics_port_is_its_flag_not_the_configs(tmp_path: Path) -> None:
    base = ("stage", "--runtime-config", _runtime_config(tmp_path), "--nats-url", "nats://x:1")
    base += ("--dist-url", "tcp://x:1")
    assert stage_config_from_args(_parse(*base), {}).telemetry.metrics_port is None
    flagged = stage_config_from_args(_parse(*base, "--metrics-port", "9500"), {})
    assert flagged.telemetry.metrics_port == 9500
    with pytest.raises(ArgError, match="--metrics-port"):
        stage_config_from_args(_parse(*base, "--metrics-port", "70000"), {})


def test_the_admissions_pool_is_its_flag_else_the_environment(tmp_path: Path) -> None:
    base = ("admission", "--runtime-config", _runtime_config(tmp_path), "--nats-url", "nats://x:1")
    assert admission_pool(_parse(*base, "--pool", "flag"), {POOL_ENV: "env"}) == "flag"
    assert admission_pool(_parse(*base), {POOL_ENV: "env"}) == "env"
    with pytest.raises(ArgError, match="--pool"):
        admission_pool(_parse(*base), {})


def test_the_gateway_binds_every_interface_only_in_a_pod() -> None:
    local = ("gateway", "--gateway-config", "g.json", "--nats-url", "nats://x:1")
    pod = ("gateway", "--config", "s.json", "--pool-file", "p.json", "--nats-url", "nats://x:1")
    assert gateway_host(_parse(*local)) == "127.0.0.1"
    assert gateway_host(_parse(*pod)) == "0.0.0.0"
    assert gateway_host(_parse(*pod, "--host", "10.0.0.7")) == "10.0.0.7"


def test_a_stage_given_cores_it_cannot_use_exits_naming_cores(tmp_path: Path) -> None:
    """``--cores`` is parsed and applied before the stage starts (``placement`` tests the rest
    of its errors)."""
    import subprocess
    import sys

    argv = ["stage", "--runtime-config", _runtime_config(tmp_path), "--rank", "0"]
    argv += ["--nats-url", "nats://127.0.0.1:1", "--dist-url", "tcp://127.0.0.1:1"]
    done = subprocess.run(
        [sys.executable, "-m", "wavepp.cli", *argv, "--cores", "99999"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "wavepp stage: --cores 99999: not cores this process may use" in done.stderr


@pytest.mark.parametrize(
    ("process", "flag"),
    [("stage", "--runtime-config"), ("stage", "--config"), ("gateway", "--gateway-config"),
     ("gateway", "--config")],
)  # fmt: skip
def test_a_config_file_that_fails_to_load_is_named_with_its_flag(
    tmp_path: Path, process: str, flag: str
) -> None:
    """Unreadable, invalid and unresolvable files: the one line starts ``FLAG FILE: ``."""
    pool = tmp_path / "pool.json"
    pool.write_text('{"pipeline": "p", "replicas": []}')
    invalid = tmp_path / "invalid.json"
    invalid.write_text('{"num_stages": "x"}' if flag != "--config" else "stages: [2\n")
    unresolvable = tmp_path / "unresolvable.yaml"
    unresolvable.write_text("model: {name: no-such-preset}\nstages: 2\n")
    files = [tmp_path / "missing.json", invalid] + ([unresolvable] if flag == "--config" else [])
    for path in files:
        argv = [process, flag, str(path), "--nats-url", "nats://x:1"]
        if process == "stage":
            argv += ["--dist-url", "tcp://x:1", "--rank", "0", "--replica", "0", "--pool", "p"]
        elif flag == "--config":
            argv += ["--pool-file", str(pool)]
        with pytest.raises(ArgError) as raised:
            if process == "stage":
                stage_config_from_args(_parse(*argv), {})
            else:
                gateway_config_from_args(_parse(*argv), {})
        assert str(raised.value).startswith(f"{flag} {path}: "), str(raised.value)
