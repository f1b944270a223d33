"""Running the operator's rendered containers as local processes (the runtime-contract tests).

A rendered container's args and env are resolved as the kubelet would (``kubelet_env``,
``expand``), its cluster paths, hosts and ports swapped for local ones (``localize``), the
command run as ``python -m wavepp.cli ...`` (``start_wavepp``) and stopped with the others at
the end (``wavepp.runtime.procs.stop_processes``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from http_support import http_status

from wavepp.operator.naming import POD_INDEX_LABEL, PipelineRef, stage_pod_name
from wavepp.runtime.transport.natsio import free_port

REPO = Path(__file__).resolve().parents[2]
REF = PipelineRef(name="tiny", namespace="ml", uid="uid-contract")
CLUSTER_NATS_URL = "nats://nats.wavepp-system:4222"
# A stage pod is ready only once its whole group formed (every peer beating), so it waits for the
# slowest of its peers to start: on 2 loaded cores with tensor-parallel followers, over 30 s.
WAIT_S = 90.0


def container_of(manifest: dict[str, Any]) -> dict[str, Any]:
    """The one container of a Deployment's or StatefulSet's pod template."""
    (container,) = manifest["spec"]["template"]["spec"]["containers"]
    return container


def kubelet_env(
    container: dict[str, Any],
    pod_name: str,
    labels: dict[str, str],
    *,
    namespace: str = REF.namespace,
) -> dict:
    """The container's env as the kubelet resolves it (values and downward-API fieldRefs)."""
    env: dict[str, str] = {}
    for item in container["env"]:
        if "value" in item:
            env[item["name"]] = item["value"]
            continue
        path = item["valueFrom"]["fieldRef"]["fieldPath"]
        if path == "metadata.namespace":
            env[item["name"]] = namespace
        elif path == "metadata.name":
            env[item["name"]] = pod_name
        else:
            label = re.fullmatch(r"metadata\.labels\['(.+)'\]", path)
            assert label, f"unknown fieldRef {path}"
            env[item["name"]] = labels[label.group(1)]
    return env


def stage_pod(
    statefulset: dict[str, Any], container: dict[str, Any], rank: int, dist_url: str
) -> tuple[dict[str, str], dict[str, str], int]:
    """Stage ``rank`` of replica 0's pod made local: its local flags (``--dist-url``, a free
    ``--health-port`` and ``--metrics-port``), the env the kubelet gives it (the pod's name and
    its index label) and its health port."""
    pod = stage_pod_name(REF.name, 0, rank)
    labels = statefulset["spec"]["template"]["metadata"]["labels"] | {POD_INDEX_LABEL: str(rank)}
    port = free_port()
    local = {
        "--dist-url": dist_url,
        "--health-port": str(port),
        "--metrics-port": str(free_port()),
    }
    return local, kubelet_env(container, pod, labels), port


def expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in args: defined variables only, others left as they are."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


def localize(args: list[str], local: dict[str, str], cluster: dict[str, Any]) -> list[str]:
    """Replace the value after each flag in ``local``; it must be the cluster value in
    ``cluster`` (a path, host or port, or a set of them), so nothing but those is rewritten."""
    out = list(args)
    for i, flag in enumerate(args[:-1]):
        if flag in local:
            expected = cluster[flag]
            expected = expected if isinstance(expected, set) else {expected}
            assert args[i + 1] in expected, (flag, args[i + 1])
            out[i + 1] = local[flag]
    return out


def probe_path(container: dict[str, Any], probe: str) -> str:
    """The HTTP path of the container's ``probe`` (``livenessProbe``, ``readinessProbe``...)."""
    return container[probe]["httpGet"]["path"]


def start_wavepp(
    args: list[str], log: Path, env: dict[str, str], *, append: bool = False
) -> subprocess.Popen[bytes]:
    """``python -m wavepp.cli *args`` from the repository, as a pod's container runs it: ``env``
    over this process's, unbuffered, one OpenMP thread, in its own session; stdout and stderr
    into ``log`` (appended with ``append``, e.g. for a restart)."""
    with open(log, "ab" if append else "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "wavepp.cli", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=os.environ | env | {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
            start_new_session=True,
        )


def log_tail(path: Path) -> str:
    """The last 25 lines of a process's log ("" before it exists)."""
    return "\n".join(path.read_text(errors="replace").splitlines()[-25:]) if path.exists() else ""


def wait_200(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    """Wait up to ``WAIT_S`` for ``url`` to answer 200; fail with the log when ``proc`` exits
    first or time runs out."""
    deadline = time.monotonic() + WAIT_S
    while http_status(url) != 200:
        if proc.poll() is not None:
            pytest.fail(f"{proc.args[3]} exited with {proc.returncode}:\n{log_tail(log)}")
        if time.monotonic() > deadline:
            pytest.fail(f"{url} not 200 in {WAIT_S}s:\n{log_tail(log)}")
        time.sleep(0.1)


class Load:
    """A closed loop of prefill requests with fresh prompts (``num_tokens`` each) from
    ``num_clients`` threads, sent to ``urls`` in turn through ``post(url, body)`` -> (status,
    body); each client waits ``pause_s`` seconds after an answer before its next request (0: at
    once); ``records`` holds (sent, took, status, body) per answer."""

    def __init__(
        self,
        urls: list[str],
        num_tokens: int,
        post: Callable[[str, dict[str, Any]], tuple[int, Any]],
        num_clients: int = 2,
        pause_s: float = 0.0,
    ) -> None:
        self.urls = urls
        self.pause_s = pause_s
        self.num_tokens = num_tokens
        self.post = post
        self.records: list[tuple[float, float, int, dict[str, Any]]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._next = 0
        self._threads = [
            threading.Thread(target=self._run, daemon=True) for _ in range(num_clients)
        ]

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                seed = self._next
                self._next += 1
            tokens = [(seed * 131 + 7 * i) % 997 + 1 for i in range(self.num_tokens)]
            sent = time.monotonic()
            url = self.urls[seed % len(self.urls)]  # every URL (gateway pod) in turn
            status, body = self.post(url, {"tenant": "default", "token_ids": tokens})
            with self._lock:
                self.records.append((sent, time.monotonic() - sent, status, body))
            if self.pause_s:
                self._stop.wait(self.pause_s)

    def start(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self, join_s: float = 70.0) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(join_s)

    def answered_by(self, replica: str, after: float) -> bool:
        return any(r[0] > after and r[3].get("replica") == replica for r in list(self.records))
