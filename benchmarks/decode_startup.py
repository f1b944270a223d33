"""Seconds until a local vLLM decode server answers ``/health``, started as ``wavepp up
--decode vllm`` starts it (``wavepp.launch.decode.decode_servers``: its command line and
environment), under environment variants started at the same moment (so each round's variants
share one machine load; a ratio within a round is the measurement, not the seconds alone).

Variants (``--variants``, comma-separated):

- ``engine-process``: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the launcher's CPU default): the
  model runs in vLLM's engine-core process;
- ``worker-process``: ``VLLM_ENABLE_V1_MULTIPROCESSING=1``: vLLM starts a worker process of
  its own for the model (one more interpreter importing vLLM);
- ``no-bytecode``: the launcher's default with a fresh, empty ``PYTHONPYCACHEPREFIX``: every
  module compiled from source, as on an environment installed without byte-compiling it.

The checkpoint is benchmarks/pd_handoff.py's (made in ``--work-dir``). Per round and variant:
``healthy_s`` and ``processes`` (the server's process group when healthy).

    scripts/vllm-venv.sh
    python benchmarks/decode_startup.py --rounds 2 --json

This is a benchmark: it measures and prints; it asserts nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from wavepp.bench.signals import exit_on_sigterm  # noqa: E402
from wavepp.launch.decode import CPU_MULTIPROCESSING_ENV, decode_servers  # noqa: E402
from wavepp.runtime.transport.natsio import free_port  # noqa: E402

VARIANTS: dict[str, dict[str, str | None]] = {
    "engine-process": {CPU_MULTIPROCESSING_ENV: "0"},
    "worker-process": {CPU_MULTIPROCESSING_ENV: "1"},
    "no-bytecode": {"PYTHONPYCACHEPREFIX": None},  # None: a fresh empty folder
}


def _checkpoint(work: Path) -> Path:
    spec = importlib.util.spec_from_file_location(
        "pd_handoff", REPO / "benchmarks" / "pd_handoff.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("pd_handoff", module)
    spec.loader.exec_module(module)
    return module.make_checkpoint(work / "model")


def _round(python: str, model: Path, variants: list[str], timeout_s: float) -> dict[str, Any]:
    started = []
    for name in variants:
        server = decode_servers(
            python=python, model_dir=str(model), model_name="model", dtype="float32",
            max_model_len=1024, ports=[free_port()], on_cpu=True, extra_args="--max-num-seqs 8",
        )[0]  # fmt: skip
        env = dict(server.env)
        for key, value in VARIANTS[name].items():
            env[key] = value if value is not None else tempfile.mkdtemp(prefix="pycache-")
        proc = subprocess.Popen(
            server.command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        started.append((name, server.url, proc, time.monotonic()))
    results: dict[str, Any] = {}
    pending = list(started)
    try:
        while pending:
            for item in list(pending):
                name, url, proc, began = item
                took = time.monotonic() - began
                try:
                    with urllib.request.urlopen(f"{url}/health", timeout=2.0):
                        pass
                except OSError:
                    if proc.poll() is None and took < timeout_s:
                        continue
                    results[name] = {"healthy_s": None, "exit": proc.poll()}
                else:
                    group = subprocess.run(
                        ["pgrep", "-g", str(proc.pid)], capture_output=True, text=True
                    ).stdout.split()
                    results[name] = {"healthy_s": round(took, 1), "processes": len(group)}
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                pending.remove(item)
            time.sleep(0.3)
    finally:
        for _, _, proc, _ in pending:
            os.killpg(proc.pid, signal.SIGKILL)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", default=str(REPO / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--variants", default="engine-process,worker-process")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {unknown}; known: {sorted(VARIANTS)}")
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: must be >= 1")
    exit_on_sigterm()  # a killed run stops the servers it started (``_round``'s finally)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="decode-startup-"))
    model = _checkpoint(work)
    rounds = []
    for i in range(args.rounds):
        rounds.append(_round(args.vllm_python, model, variants, args.timeout_s))
        if not args.json:
            print(f"round {i}: {rounds[-1]}", flush=True)
    load = os.getloadavg()
    if args.json:
        print(json.dumps({"variants": variants, "rounds": rounds, "loadavg": load}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
