"""One short real ``wavepp up`` (1 stage x tensor parallel 2 on the CPU): the start-up warning
for a field only the operator applies, the TP size in the serving line and processes.json,
the admission and stage metrics bound to ``--host`` (127.0.0.1), and the admission drain of
``spec.rollout.drainTimeoutSeconds`` at stop."""

from __future__ import annotations

import urllib.request

import pytest
from up_support import start_up, stop_up

from wavepp.runtime.transport.natsio import free_port

pytestmark = pytest.mark.timeout(240)


def _listen_addresses(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp writes them) listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]  # noqa: SIM115, PTH123
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if int(hex_port, 16) == port and fields[3] == "0A":  # LISTEN
                found.add(address)
    return found


def test_up_honours_drain_tp_and_metrics_host(tmp_path) -> None:
    metrics_port = free_port()
    spec = {
        "model": {"name": "tiny-llama"},
        "stages": 1,
        "resources": {"gpusPerStage": 0},
        "autoscaling": {"maxReplicas": 3, "target": 10},
        "rollout": {"drainTimeoutSeconds": 12},
        "telemetry": {"metricsPort": metrics_port},
    }
    service = start_up(tmp_path, spec, ["--tensor-parallel-size", "2"], timeout_s=180.0)
    try:
        out = "".join(service.lines)
        assert (
            "wavepp up: WARNING: spec.autoscaling: applied by the Kubernetes operator only; "
            "wavepp up runs spec.replicas replicas" in out
        )
        assert "1 replica(s) x 1 torch stages x tensor parallel 2 of tiny-llama" in out
        state = service.processes()
        assert state["tensor_parallel_size"] == 2
        assert state["drain_timeout_s"] == 7.0
        admission_url = state["metrics"]["default-r0"]
        stage_url = state["stage_metrics"]["default-r0-0"]
        for url, port in ((admission_url, metrics_port), (stage_url, metrics_port + 1)):
            assert url == f"http://127.0.0.1:{port}/metrics"
            with urllib.request.urlopen(url, timeout=5) as response:
                assert response.status == 200
            assert _listen_addresses(port) == {"0100007F"}, port  # 127.0.0.1 only
    finally:
        code = stop_up(service.proc)
    assert code == 0, "".join(service.lines[-40:])
    log = (service.state_dir / "logs" / "admission-default-r0.log").read_text()
    assert "draining (at most 7 s)" in log
