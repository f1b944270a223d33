"""Every config-loading failure is one line naming the field, exit 2, in every command that
reads a spec (`up`, `validate`, `stage`, `admission`, `gateway`) and in the operator's check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from wavepp import cli
from wavepp.api.spec import MAX_REPLICAS, MAX_TENANTS, check_spec

BASE = "model: {name: tiny-llama}\nstages: 2\n"
TENANTS = "".join(f"  - name: t{i}\n" for i in range(MAX_TENANTS + 1))
# (name, file text, what the one line must contain)
CASES = [
    ("yaml-syntax", "model: [tiny-llama\nstages: 2\n", "line 2, column 7"),
    ("python-tag", "model: !!python/object/apply:os.system ['true']\nstages: 2\n", "python"),
    ("time-scale-text", BASE + "engineOptions: {timeScale: abc}\n", "engineOptions.timeScale"),
    ("mapping-for-number", "model: {name: tiny-llama}\nstages: {a: 1}\n", "spec.stages"),
    ("kv-blocks-mapping", BASE + "engineOptions: {kvBlocks: {a: 1}}\n", "engineOptions.kvBlocks"),
    ("lease-inf", BASE + "engineOptions: {leaseSeconds: .inf}\n", "engineOptions.leaseSeconds"),
    ("time-scale-nan", BASE + "engineOptions: {timeScale: .nan}\n", "engineOptions.timeScale"),
    ("typed-float-inf", BASE + "restartBudget: {windowSeconds: .inf}\n", "windowSeconds"),
    ("replicas-absurd", BASE + "replicas: 100000\n", "spec.replicas"),
    ("tenants-past-bound", BASE + "tenants:\n" + TENANTS, "spec.tenants"),
    ("unknown-engine-option", BASE + "engineOptions: {timescale: 2}\n", "engineOptions.timescale"),
    ("not-a-mapping", "- 1\n- 2\n", "expected a mapping"),
]


@pytest.fixture(autouse=True)
def _no_parent_death_signal(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pod commands arm PR_SET_PDEATHSIG first; in-process that would bind pytest."""
    monkeypatch.setattr("wavepp.runtime.serving.lifecycle.exit_with_parent", lambda: None)


def _commands(config: Path, tmp: Path) -> dict[str, list[str]]:
    pool = tmp / "pool.json"
    pool.write_text(json.dumps({"pipeline": "p", "replicas": []}))
    nats = ["--nats-url", "nats://127.0.0.1:1"]
    return {
        "up": ["up", "--config", str(config), "--port", "0"],
        "validate": ["validate", str(config)],
        "stage": [
            "stage",
            "--config",
            str(config),
            "--replica",
            "0",
            "--pool",
            "p",
            "--rank",
            "0",
            *nats,
            "--dist-url",
            "tcp://127.0.0.1:1",
        ],  # fmt: skip
        "admission": [
            "admission",
            "--config",
            str(config),
            "--replica",
            "0",
            "--pool",
            "p",
            *nats,
        ],  # fmt: skip
        "gateway": ["gateway", "--config", str(config), "--pool-file", str(pool), *nats],
    }


@pytest.mark.parametrize(("name", "text", "needle"), CASES, ids=[c[0] for c in CASES])
def test_config_failure_is_one_line_exit_2_everywhere(
    name: str, text: str, needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / f"{name}.yaml"
    config.write_text(text)
    for command, argv in _commands(config, tmp_path).items():
        code = cli.main(argv)
        out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        assert code == 2, f"{command}: exit {code}, stderr {err!r}"
        assert len(lines) == 1, f"{command}: {len(lines)} lines: {err!r}"
        assert needle in lines[0], f"{command}: {lines[0]!r} does not name {needle!r}"
        assert "Traceback" not in err and not out.strip(), command


@pytest.mark.parametrize(
    ("name", "text", "needle"),
    [
        c
        for c in CASES
        if c[0]
        in {
            "time-scale-text",
            "mapping-for-number",
            "kv-blocks-mapping",
            "lease-inf",
            "time-scale-nan",
            "typed-float-inf",
            "replicas-absurd",
            "tenants-past-bound",
            "unknown-engine-option",
        }
    ],  # fmt: skip
)
def test_operator_spec_check_names_the_field(name: str, text: str, needle: str) -> None:
    """The operator reads the object's spec (already parsed): check_spec never raises and its
    one issue names the field (written into the pipeline's conditions)."""
    spec, issues = check_spec(yaml.safe_load(text))
    assert spec is None and issues
    assert any(needle in str(issue) for issue in issues), issues
    assert all("\n" not in str(issue) for issue in issues)


def test_bounds_are_the_documented_ones() -> None:
    defaults = {"default_image": "local", "default_nats_url": "nats://x"}
    ok, issues = check_spec({"model": {"name": "tiny-llama"}, "stages": 2,
                             "replicas": MAX_REPLICAS}, **defaults)  # fmt: skip
    assert ok is not None and not issues
    bad, issues = check_spec({"model": {"name": "tiny-llama"}, "stages": 2,
                              "replicas": MAX_REPLICAS + 1}, **defaults)  # fmt: skip
    assert bad is None and str(MAX_REPLICAS) in str(issues[0])


def test_valid_config_validates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "ok.yaml"
    config.write_text(
        # timeScale is read by the emulated engine only (the torch engine refuses it)
        BASE
        + "engine: emulated\nengineOptions: {timeScale: 0.5, leaseSeconds: 10, kvBlocks: [8, 9]}\n"
    )
    assert cli.main(["validate", str(config)]) == 0
    assert "ok (1 replica(s) x 2 emulated stages of tiny-llama" in capsys.readouterr().out


def test_runtime_and_gateway_config_files_refuse_infinity(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The files `wavepp up` hands its children: JSON's Infinity is refused naming the field."""
    from wavepp.runtime.config import RuntimeConfig

    runtime = json.loads(RuntimeConfig(num_stages=2).model_dump_json())
    path = tmp_path / "runtime.json"
    path.write_text(json.dumps(runtime | {"lease_s": float("inf")}))
    argv = ["admission", "--runtime-config", str(path), "--nats-url", "nats://127.0.0.1:1",
            "--pool", "p"]  # fmt: skip
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "lease_s" in err, err
    with pytest.raises(SystemExit) as info:
        cli.main(["up", "--tenant-tokens-per-s", "nan"])
    assert info.value.code == 2
    assert "--tenant-tokens-per-s" in capsys.readouterr().err
