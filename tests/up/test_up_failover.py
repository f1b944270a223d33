"""`wavepp up --config` with 2 replicas, one real process tree:

- ``spec.telemetry.metricsPort`` P is honoured: replica i's admission serves its metrics on
  P + i, and every series the shipped dashboards query is scraped from the run (the admissions'
  ports and the gateway's ``/metrics``) after a load that admits, refuses, evicts and answers;
- a stage SIGKILLed under load: no request fails (each answered 200 within 5 s, by the other
  replica meanwhile), ``wavepp up`` restarts the stage with its arguments, its replica re-forms
  in place and answers again; the other stages keep their pids.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from http_support import post_json
from prometheus_client.parser import text_string_to_metric_families
from up_support import UpService, free_port_run, start_up, stop_up, wait_replicas_in_pool

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

DASHBOARDS = sorted((Path(__file__).parents[2] / "dashboards").glob("*.json"))
BLOCK = 16
ANSWER_WITHIN_S = 5.0


def _post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    return post_json(url, body, timeout_s=60.0)


def _get(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=5.0) as response:
            return response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.read().decode()


def _tokens(seed: int, num_blocks: int) -> list[int]:
    return [(seed * 7919 + 31 * i) % 1000 + 1 for i in range(num_blocks * BLOCK + 3)]


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[UpService, int]]:
    metrics_port = free_port_run(2 + 2 * 2)  # 2 admissions, then 2 x 2 stages
    spec = {
        "model": {"name": "tiny-llama"},
        "stages": 2,
        "replicas": 2,
        "engine": "emulated",
        "engineOptions": {"timeScale": 0.05, "kvBlocks": 64},
        "cache": {"blockSize": BLOCK},
        "telemetry": {"metricsPort": metrics_port},
    }
    service = start_up(tmp_path_factory.mktemp("up-failover"), spec, timeout_s=180)
    try:
        wait_replicas_in_pool(service, 2)  # every process's /metrics is then served
        yield service, metrics_port
    finally:
        stop_up(service.proc)


def test_dashboards_fill_under_wavepp_up(up: tuple[UpService, int]) -> None:
    service, metrics_port = up
    url = f"{service.endpoint}/v1/prefill"
    # Distinct 40-block prompts on 64-block stages: evictions; four at once: refusals (when two
    # of them meet on one replica's stages: waves of four until a refusal was counted, 5 at most).
    for seed in range(4):
        assert _post(url, {"tenant": "default", "token_ids": _tokens(seed, 40)})[0] == 200
    # an OpenAI completion served by the prefill alone (max_tokens 1): the completion TTFT
    completion = {"prompt": _tokens(99, 2), "max_tokens": 1}
    assert _post(f"{service.endpoint}/v1/completions", completion)[0] == 200
    endpoints = service.processes()["metrics"]
    for wave in range(5):
        answers: list[int] = []
        threads = [
            threading.Thread(
                target=lambda s=seed, out=answers: out.append(
                    _post(url, {"tenant": "default", "token_ids": _tokens(s, 50)})[0]
                )
            )
            for seed in range(10 + 4 * wave, 14 + 4 * wave)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert answers == [200] * 4
        if any("wavepp_reservation_refusals_total" in _get(u) for u in endpoints.values()):
            break
    endpoints = service.processes()["metrics"]
    assert sorted(endpoints.values()) == [
        f"http://127.0.0.1:{metrics_port + i}/metrics" for i in range(2)
    ]
    # each stage's own /metrics on the ports after the admissions' (wavepp stage --metrics-port)
    stage_endpoints = service.processes()["stage_metrics"]
    assert sorted(stage_endpoints.values()) == [
        f"http://127.0.0.1:{metrics_port + 2 + i}/metrics" for i in range(4)
    ]
    for stage_url in stage_endpoints.values():
        names = {
            sample.name
            for family in text_string_to_metric_families(_get(stage_url))
            for sample in family.samples
        }
        assert {"wavepp_stage_microbatches_run_total", "wavepp_stage_group_formed"} <= names
    scraped: set[str] = set()
    for text in [_get(u) for u in endpoints.values()] + [_get(f"{service.endpoint}/metrics")]:
        for family in text_string_to_metric_families(text):
            if family.samples:  # a histogram's family name (a panel's text may name it)
                scraped |= {family.name} | {sample.name for sample in family.samples}
    queried: set[str] = set()
    for path in DASHBOARDS:
        queried |= set(re.findall(r"\bwavepp_[a-z0-9_]+", path.read_text()))
    assert len(queried) >= 10
    # The store's limit gauge exists only where the JetStream store is capped (this spec sets
    # no cap); the live Prometheus check (tests/telemetry) caps it and reads the gauge.
    only_with_a_store_limit = {"wavepp_gateway_jetstream_store_limit_bytes"}
    # The time per output token needs tokens after the first: a decode engine, which this spec
    # has none of (tests/gateway/test_decode_observability.py observes it).
    only_with_decode = {
        "wavepp_gateway_time_per_output_token_seconds",
        "wavepp_gateway_time_per_output_token_seconds_bucket",
    }
    assert queried - scraped - only_with_a_store_limit - only_with_decode == set()


def test_stage_killed_under_wavepp_up_no_request_fails(up: tuple[UpService, int]) -> None:
    service, _ = up
    url = f"{service.endpoint}/v1/prefill"
    before = service.processes()
    stage_pids = {n: p for n, p in before["pids"].items() if n.startswith("stage-")}
    victim = sorted(stage_pids)[1]  # stage 1 of the first replica
    replica = re.fullmatch(r"stage-(.+)-\d+", victim).group(1)
    records: list[tuple[float, float, int, dict[str, Any]]] = []
    stop = threading.Event()

    def client(first_seed: int) -> None:
        seed = first_seed
        while not stop.is_set():
            sent = time.monotonic()
            status, body = _post(url, {"tenant": "default", "token_ids": _tokens(seed, 3)})
            records.append((sent, time.monotonic() - sent, status, body))
            seed += 2

    threads = [threading.Thread(target=client, args=(1000 + i,), daemon=True) for i in range(2)]
    for thread in threads:
        thread.start()
    while len(records) < 10:
        time.sleep(0.05)
    os.kill(stage_pids[victim], signal.SIGKILL)
    killed = time.monotonic()
    deadline = killed + 120
    while service.processes()["restarts"].get(victim, 0) < 1:
        assert time.monotonic() < deadline, "wavepp up did not restart the stage"
        time.sleep(0.1)
    restarted = time.monotonic()

    def answered_by_replica_after_restart() -> list[float]:
        return [
            sent + took - killed
            for sent, took, _status, body in list(records)
            if sent > restarted and body.get("replica") == replica
        ]

    while not answered_by_replica_after_restart():
        assert time.monotonic() < deadline, "the replica did not answer again\n" + "".join(
            service.lines[-30:]
        )
        time.sleep(0.1)
    stop.set()
    for thread in threads:
        thread.join(60)
    after = [r for r in records if r[0] + r[1] > killed]
    bad = [(round(s - killed, 2), round(t, 2), st, body) for s, t, st, body in after
           if st != 200 or t > ANSWER_WITHIN_S]  # fmt: skip
    assert not bad, bad
    now = service.processes()["pids"]
    for name, pid in stage_pids.items():
        if name != victim:
            assert now[name] == pid, f"{name} was restarted"
    assert now[victim] != stage_pids[victim]
    print(
        f"wavepp up stage kill: {len(after)} requests answered after the kill, all 200, slowest "
        f"{max(r[1] for r in after):.2f} s; restarted {restarted - killed:.1f} s after the kill; "
        f"{replica} answered again {min(answered_by_replica_after_restart()):.1f} s after the kill"
    )
