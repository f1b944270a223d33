"""``wavepp up``: the whole service on this machine, as processes.

Starts an embedded nats-server with JetStream, then for each replica of the spec S ``wavepp
stage`` processes and one ``wavepp admission``, then one ``wavepp gateway``; waits until the
gateway's ``/readyz`` answers 200, prints ``wavepp up: serving http://HOST:PORT ...`` and
supervises: a gateway or admission process that dies is restarted (its requests are in
JetStream); a stage that dies stops everything (exit 1). Ctrl-C or SIGTERM stops all children
(gateway, admissions, stages: SIGTERM, wait, kill) and the nats-server, and exits 0.

``--config FILE`` is a WavePipeline spec in YAML or JSON (the custom resource's ``spec``, or the
whole resource); without it, tiny-llama on 2 torch stages. ``STATE_DIR/processes.json`` lists
the child pids (for tests and operators), ``STATE_DIR/logs/`` their output.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from wavepp.runtime.serving.lifecycle import child_env

DEFAULT_SPEC = {"model": {"name": "tiny-llama"}, "stages": 2}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="", help="WavePipeline spec (YAML or JSON)")
    parser.add_argument("--name", default="default", help="pool name (NATS subjects, results)")
    parser.add_argument("--host", default="127.0.0.1", help="gateway bind address")
    parser.add_argument("--port", type=int, default=8000, help="gateway port (0: a free one)")
    parser.add_argument("--state-dir", default="", help="logs, configs, JetStream store")
    parser.add_argument("--tokenizer", default="", help="local tokenizer path (for text prompts)")
    parser.add_argument(
        "--routing", choices=["prefix", "round_robin", "least_loaded"], default="prefix"
    )
    parser.add_argument(
        "--max-outstanding", type=int, default=8, help="requests per replica past the gateway"
    )
    parser.add_argument(
        "--max-queued",
        type=int,
        default=1024,
        help="requests queued or running in the gateway, all tenants; past it: 429",
    )
    parser.add_argument(
        "--tenant-max-concurrency", type=int, default=None, help="per tenant, queued or running"
    )
    parser.add_argument(
        "--tenant-tokens-per-s", type=float, default=None, help="per tenant prompt-token rate"
    )
    parser.add_argument(
        "--tenant-limits",
        default="",
        help='JSON per tenant, e.g. {"acme": {"max_concurrency": 4, "tokens_per_s": 5000, '
        '"burst_tokens": 20000}}; overrides the two flags above',
    )
    parser.add_argument("--ack-wait-s", type=float, default=10.0, help="intake redelivery delay")
    parser.add_argument("--request-timeout-s", type=float, default=120.0)
    parser.add_argument("--replica-timeout-s", type=float, default=3.0)
    parser.add_argument("--startup-timeout-s", type=float, default=300.0)


def _fail(flag: str, message: str) -> int:
    print(f"wavepp up: {flag}: {message}", file=sys.stderr)
    return 2


def load_spec_file(path: str) -> dict:
    """The spec mapping of a YAML/JSON file holding a spec or a whole WavePipeline resource."""
    import yaml

    raw = yaml.safe_load(Path(path).read_text())
    if isinstance(raw, dict) and "spec" in raw and "kind" in raw:
        raw = raw["spec"]
    if not isinstance(raw, dict):
        raise ValueError("the file holds no mapping")
    return raw


class Supervisor:
    """Owns the child processes of ``wavepp up``."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.log_dir = state_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.commands: dict[str, list[str]] = {}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.num_restarts: dict[str, int] = {}
        self.info: dict[str, object] = {}

    def start(self, name: str, command: list[str]) -> None:
        self.commands[name] = command
        out = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        self.procs[name] = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=child_env(),
        )
        self.write_state()

    def restart(self, name: str) -> None:
        self.num_restarts[name] = self.num_restarts.get(name, 0) + 1
        print(f"wavepp up: {name} exited; restarting", file=sys.stderr, flush=True)
        self.start(name, self.commands[name])

    def write_state(self) -> None:
        state = {
            **self.info,
            "pids": {name: proc.pid for name, proc in self.procs.items()},
            "restarts": self.num_restarts,
        }
        path = self.state_dir / "processes.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(path)

    def log_tail(self, name: str, num_lines: int = 20) -> str:
        path = self.log_dir / f"{name}.log"
        lines = path.read_text(errors="replace").splitlines() if path.exists() else []
        return "\n".join(lines[-num_lines:])

    def stop(self, names: list[str]) -> None:
        for name in names:
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                proc.terminate()
        for name in names:
            proc = self.procs.get(name)
            if proc is None:
                continue
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def _is_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def run(args: argparse.Namespace) -> int:
    from wavepp.api.spec import SpecError, check_spec
    from wavepp.gateway.core import GatewayConfig, ReplicaInfo
    from wavepp.gateway.tenants import TenantPolicy, default_cache_salt
    from wavepp.runtime.serving.from_spec import runtime_configs_from_spec
    from wavepp.runtime.transport.natsio import EmbeddedNatsServer, free_port

    try:
        raw = load_spec_file(args.config) if args.config else dict(DEFAULT_SPEC)
    except (OSError, ValueError) as exc:
        return _fail("--config", f"{args.config}: {exc}")
    spec, issues = check_spec(raw, default_image="local", default_nats_url="nats://embedded")
    if spec is None:
        return _fail("--config", "; ".join(str(i) for i in issues))
    try:
        configs = runtime_configs_from_spec(spec, pool=args.name)
    except SpecError as exc:
        return _fail("--config", str(exc))
    if args.max_outstanding < 1:
        return _fail("--max-outstanding", f"{args.max_outstanding}: must be >= 1")
    if args.max_queued < 1:
        return _fail("--max-queued", f"{args.max_queued}: must be >= 1")
    port = args.port or free_port()
    try:
        overrides = json.loads(args.tenant_limits) if args.tenant_limits else {}
        if not isinstance(overrides, dict):
            raise ValueError("must be a JSON object: tenant -> limits")
    except ValueError as exc:
        return _fail("--tenant-limits", str(exc))
    tenant_specs = [(t.name, t.cache_salt, t.weight) for t in spec.tenants] or [
        ("default", None, 1)
    ]
    unknown = sorted(set(overrides) - {name for name, _, _ in tenant_specs})
    if unknown:
        return _fail("--tenant-limits", f"unknown tenants {unknown}; the spec has {tenant_specs}")
    try:
        tenants = [
            TenantPolicy(
                name=name,
                cache_salt=salt or default_cache_salt(name),
                weight=weight,
                **{
                    "max_concurrency": args.tenant_max_concurrency,
                    "tokens_per_s": args.tenant_tokens_per_s,
                    **overrides.get(name, {}),
                },
            )
            for name, salt, weight in tenant_specs
        ]
    except (ValueError, TypeError) as exc:
        return _fail("--tenant-limits", str(exc))
    first = configs[0]
    max_prompt_tokens = min(
        min(first.kv_blocks_of(r) for r in range(first.num_stages)) * first.block_size,
        first.model.max_position,
    )
    gateway_config = GatewayConfig(
        pool=args.name,
        replicas=[
            ReplicaInfo(
                pipeline=c.pipeline,
                num_stages=c.num_stages,
                stage_blocks=[c.kv_blocks_of(r) for r in range(c.num_stages)],
            )
            for c in configs
        ],
        model_name=first.model.name,
        model_id=first.model_id,
        block_size=first.block_size,
        vocab_size=first.model.vocab_size,
        max_prompt_tokens=max_prompt_tokens,
        tenants=tenants,
        routing=args.routing,
        max_outstanding_per_replica=args.max_outstanding,
        max_queued_requests=args.max_queued,
        request_timeout_s=args.request_timeout_s,
        replica_timeout_s=args.replica_timeout_s,
        tokenizer=str(Path(args.tokenizer).resolve()) if args.tokenizer else None,
    )
    state_dir = Path(args.state_dir or tempfile.mkdtemp(prefix="wavepp-up-")).resolve()
    sup = Supervisor(state_dir)
    (state_dir / "gateway.json").write_text(gateway_config.model_dump_json(indent=2))
    stopping = {"flag": False}

    def on_signal(signum: int, frame: object) -> None:
        stopping["flag"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    # The bus key every child signs and checks messages with (inherited through the
    # environment; generated here unless the caller set WAVEPP_BUS_KEY or WAVEPP_BUS_KEY_FILE).
    from wavepp.runtime.transport.buskey import BusKeyError, ensure_bus_key

    try:
        ensure_bus_key()
    except BusKeyError as exc:
        return _fail("WAVEPP_BUS_KEY", str(exc))
    server = EmbeddedNatsServer(jetstream=True, store_dir=str(state_dir / "jetstream"))
    server.start()
    endpoint = f"http://{args.host}:{port}"
    sup.info = {"endpoint": endpoint, "nats_url": server.url, "state_dir": str(state_dir)}
    cli = [sys.executable, "-m", "wavepp.cli"]
    stage_names: list[str] = []
    service_names: list[str] = []
    for config in configs:
        path = state_dir / f"{config.pipeline}.json"
        path.write_text(config.model_dump_json(indent=2))
        dist_url = f"tcp://127.0.0.1:{free_port()}"
        for rank in range(config.num_stages):
            name = f"stage-{config.pipeline}-{rank}"
            stage_names.append(name)
            sup.start(
                name,
                [*cli, "stage", "--runtime-config", str(path), "--rank", str(rank),
                 "--nats-url", server.url, "--dist-url", dist_url],
            )  # fmt: skip
        name = f"admission-{config.pipeline}"
        service_names.append(name)
        sup.start(
            name,
            [*cli, "admission", "--runtime-config", str(path), "--nats-url", server.url,
             "--pool", args.name, "--ack-wait-s", str(args.ack_wait_s)],
        )  # fmt: skip
    service_names.append("gateway")
    sup.start(
        "gateway",
        [*cli, "gateway", "--gateway-config", str(state_dir / "gateway.json"),
         "--nats-url", server.url, "--host", args.host, "--port", str(port)],
    )  # fmt: skip
    code = 0
    is_serving = False
    deadline = time.monotonic() + args.startup_timeout_s
    try:
        while not stopping["flag"]:
            dead_stage = next((n for n in stage_names if sup.procs[n].poll() is not None), None)
            if dead_stage is not None:
                print(
                    f"wavepp up: {dead_stage} exited with code {sup.procs[dead_stage].returncode}; "
                    f"stopping\n{sup.log_tail(dead_stage)}",
                    file=sys.stderr,
                    flush=True,
                )
                code = 1
                break
            for name in service_names:
                if sup.procs[name].poll() is not None:
                    if not is_serving:
                        print(
                            f"wavepp up: {name} exited during startup\n{sup.log_tail(name)}",
                            file=sys.stderr,
                            flush=True,
                        )
                        stopping["flag"], code = True, 1
                        break
                    sup.restart(name)
            if not is_serving and not stopping["flag"]:
                if _is_ready(f"http://127.0.0.1:{port}/readyz"):
                    is_serving = True
                    print(
                        f"wavepp up: serving {endpoint} (pool {args.name}: {len(configs)} "
                        f"replica(s) x {first.num_stages} {first.engine} stages of "
                        f"{first.model.name}; NATS {server.url}; logs {sup.log_dir})",
                        flush=True,
                    )
                elif time.monotonic() > deadline:
                    print(f"wavepp up: not ready in {args.startup_timeout_s}s", file=sys.stderr)
                    code = 1
                    break
            time.sleep(0.2)
    finally:
        sup.stop(["gateway"])
        sup.stop([n for n in service_names if n != "gateway"])
        sup.stop(stage_names)
        server.stop()
        print("wavepp up: stopped", file=sys.stderr, flush=True)
    return code
