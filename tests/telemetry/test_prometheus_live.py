"""Operations against a real Prometheus (Debian's ``prometheus``): ``wavepp up`` (2 replicas of 2
stages, API keys on, a rate-limited tenant) scraped every second by a real server (the gateway,
both admissions and the four stages: the endpoints ``processes.json`` lists), a short mixed
load (prefix hits, misses, a 429, a 401, KV pressure), then through Prometheus's HTTP API:

- every panel query of every dashboard in ``dashboards/`` (template variables resolved by
  their own ``label_values`` queries, then substituted) returns data, except the ones listed in
  ``LEGITIMATELY_EMPTY`` with why;
- the chart's prometheus-adapter rule: its ``seriesQuery`` finds the gateway's series and its
  ``metricsQuery``, expanded as the adapter does for the operator's HPA (``matchLabels``
  namespace and pool), returns the one value the HPA reads;
- the chart's alert rules (a copy with every ``for:`` at 0 s: the chart's are minutes) load,
  none fires on the healthy run, and ``WavePPStageDown`` fires for a stage after it is killed;
  the JetStream store's use against its limit (``--jetstream-max-bytes``) is there to watch.

The table of queries and result counts is printed (``-s``) and kept in docs/observability.md.
Scrape targets carry the labels the chart's PodMonitor gives (``namespace``, ``component``).
Skips where ``prometheus`` is not installed (``scripts/install-prometheus.sh``).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import signal
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import aiohttp
import pytest
import yaml
from prometheus_support import (
    ALERT_RULES,
    DASHBOARDS,
    PrometheusServer,
    adapter_external_rules,
    adapter_metrics_query,
    dashboard_queries,
    dashboard_variables,
    require,
    substitute,
)
from up_support import UpService, free_port_run, start_up, stop_up

from wavepp.cmd.api_key import new_key, rotate

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

BLOCK = 16
KV_BLOCKS = 64
NAMESPACE = "wavepp-live"  # the target label a PodMonitor sets from the pod's namespace
POOL = "default"  # wavepp up's --pool default
STORE_LIMIT = 256 * 2**20  # --jetstream-max-bytes: the store gauges' limit series exists

# expr -> why it may return nothing under this load (every other query must return data)
LEGITIMATELY_EMPTY = {
    'sum(rate(wavepp_speculations_discarded_total{pipeline=~"$pipeline"}[1m]))': (
        "a speculative plan is discarded only when an agreed prefix differs from its prediction "
        "(a prefix evicted meanwhile on one stage); the counter's series appears at its first "
        "increment"
    ),
    'sum by (tenant) (rate(wavepp_requests_completed_total{pipeline=~"$pipeline",tenant=~"$tenant",'
    'outcome="error"}[1m]))': (
        "no request fails in the runtime under this load (the 429 and the 401 are the gateway's "
        "refusals: wavepp_gateway_requests_total{code}); the outcome=error series appears at the "
        "first failure"
    ),
}
_TPOT = (
    "a time per output token needs a completion of two or more tokens, decoded by a decode "
    "engine (vLLM with WavePP's connector); this check runs none (a vLLM start costs about a "
    "minute here; tests/gateway/test_decode_observability.py checks the histogram's samples, "
    "tests/telemetry/test_telemetry_dashboards.py its series and labels)"
)
LEGITIMATELY_EMPTY |= {
    f"histogram_quantile({q}, sum by (le, tenant) (rate(wavepp_gateway_time_per_output_token_"
    f'seconds_bucket{{tenant=~"$tenant"}}[5m])))': _TPOT
    for q in ("0.5", "0.99")
}


def _tokens(seed: int, num_blocks: int) -> list[int]:
    return [(seed * 7919 + 31 * i) % 1000 + 1 for i in range(num_blocks * BLOCK + 3)]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    require("prometheus")
    started = time.monotonic()
    tmp = tmp_path_factory.mktemp("prometheus-live")
    metrics_port = free_port_run(2 + 2 * 2)  # 2 admissions, then 2 x 2 stages
    tenants = [
        {"name": "default", "apiKeysFile": "keys/default.keys"},
        {"name": "acme", "apiKeysFile": "keys/acme.keys", "weight": 2, "maxConcurrency": 16},
        {"name": "limited", "apiKeysFile": "keys/limited.keys", "tokensPerSecond": 1.0,
         "burstTokens": 100},
    ]  # fmt: skip
    spec = {
        "model": {"name": "tiny-llama"},
        "stages": 2,
        "replicas": 2,
        "engine": "emulated",
        "engineOptions": {"timeScale": 0.05, "kvBlocks": KV_BLOCKS},
        "cache": {"blockSize": BLOCK},
        "telemetry": {"metricsPort": metrics_port},
        "tenants": tenants,
    }
    (tmp / "keys").mkdir()
    keys = {}
    for tenant in tenants:
        keys[tenant["name"]] = new_key()
        rotate(tmp / tenant["apiKeysFile"], keys[tenant["name"]], None, datetime.now(UTC))
    service = start_up(tmp, spec, ["--jetstream-max-bytes", str(STORE_LIMIT)], timeout_s=180)
    prometheus = None
    try:
        up_s = time.monotonic() - started
        processes = service.processes()
        targets = [("wavepp-gateway", f"{service.endpoint}/metrics", {"component": "gateway"})]
        targets += [("wavepp-admission", u, {"component": "admission"})
                    for u in processes["metrics"].values()]  # fmt: skip
        targets += [("wavepp-stage", u, {"component": "stage"})
                    for u in processes["stage_metrics"].values()]  # fmt: skip
        targets = [(job, url, {**labels, "namespace": NAMESPACE}) for job, url, labels in targets]
        # the chart's rules with every `for:` at 0 s: fire at the first evaluation that holds
        rules = yaml.safe_load(ALERT_RULES.read_text())
        for group in rules["groups"]:
            for rule in group["rules"]:
                rule["for"] = "0s"
        rules_copy = tmp / "wavepp-alerts-for-0s.yaml"
        rules_copy.write_text(yaml.safe_dump(rules))
        prometheus = PrometheusServer(tmp / "prometheus", targets, [rules_copy], interval_s=1.0)
        prometheus.start()
        yield {
            "service": service,
            "prometheus": prometheus,
            "keys": keys,
            "targets": targets,
            "started": started,
            "up_s": up_s,
        }
    finally:
        if prometheus is not None:
            prometheus.stop()
        stop_up(service.proc)


async def _post(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], key: str | None
) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with session.post(url, json=body, headers=headers) as response:
        await response.read()
        return response.status


async def _mixed_load(
    endpoint: str, keys: dict[str, str], prometheus: PrometheusServer
) -> dict[str, list[int]]:
    """Misses, hits, KV pressure (evictions, refusals), a 429 and a 401; statuses by kind.
    Between the warm-up and the load, every target is scraped once (``prometheus``)."""
    url = f"{endpoint}/v1/prefill"
    statuses: dict[str, list[int]] = {}
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def post(kind: str, body: dict[str, Any], key: str | None) -> None:
            statuses.setdefault(kind, []).append(await _post(session, url, body, key))

        async def complete(seed: int, key: str, stream: bool) -> None:
            # an OpenAI completion served by the prefill alone (max_tokens 1): its TTFT
            body = {"prompt": _tokens(seed, 2), "max_tokens": 1, "stream": stream}
            status = await _post(session, f"{endpoint}/v1/completions", body, key)
            statuses.setdefault("completion", []).append(status)

        # one request per tenant first, scraped before the load: a counter's series appears at
        # its first increment, and rate() sees only what comes after that first sample
        await post("warm-up", {"token_ids": _tokens(900, 2)}, keys["acme"])
        await post("warm-up", {"token_ids": _tokens(901, 2)}, keys["default"])
        await post("warm-up", {"token_ids": _tokens(902, 1)[:16]}, keys["limited"])
        await complete(903, keys["acme"], False)
        await complete(904, keys["default"], True)
        await asyncio.to_thread(prometheus.wait_scraped_after, time.time())
        # misses, then the same prompts again: prefix hits; 40- to 50-block prompts on 64-block
        # stages, four at a time: evictions, refusals; for a few seconds of scrapes
        for wave in range(3):
            prompts = [_tokens(10 * wave + s, 4) for s in range(6)]
            for round_ in ("miss", "hit"):
                await asyncio.gather(
                    *(post(round_, {"token_ids": p}, keys["acme"]) for p in prompts)
                )
            await asyncio.gather(
                *(
                    post("pressure", {"token_ids": _tokens(100 + 4 * wave + i, 40 + 5 * wave)},
                         keys["default"])
                    for i in range(4)
                )
            )  # fmt: skip
            await asyncio.gather(
                complete(500 + wave, keys["acme"], wave % 2 == 0),
                complete(600 + wave, keys["default"], wave % 2 == 1),
            )
            await asyncio.sleep(1.0)
        # 100 burst tokens, 1 token/s: the second 80-token prompt waits past its bucket
        for seed in (200, 201):
            await post("rate", {"token_ids": _tokens(seed, 5)[:80]}, keys["limited"])
        await post("bad key", {"token_ids": _tokens(300, 1)}, "wpp-not-a-key")
    return statuses


def _cell(text: str) -> str:
    """``text`` in a Markdown table cell (its ``|`` escaped)."""
    return text.replace("|", "\\|")


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def test_every_panel_rule_and_alert_on_live_data(live: dict[str, Any]) -> None:
    service: UpService = live["service"]
    prometheus: PrometheusServer = live["prometheus"]
    load_started = time.monotonic()
    statuses = asyncio.run(_mixed_load(service.endpoint, live["keys"], prometheus))
    load_ended = time.time()
    load_s = time.monotonic() - load_started
    assert statuses["warm-up"] == [200] * 3, statuses
    assert statuses["miss"] == [200] * 18 and statuses["hit"] == [200] * 18, statuses
    assert statuses["pressure"] == [200] * 12, statuses
    assert statuses["rate"] == [200, 429], statuses
    assert statuses["bad key"] == [401], statuses
    assert statuses["completion"] == [200] * 8, statuses

    # every target up, and the load's last counts scraped
    prometheus.wait_scraped_after(load_ended)
    assert len(prometheus.targets_up()) == len(live["targets"]), prometheus.targets_up()

    rows: list[tuple[str, str, int, str]] = []  # (where, what, result count, largest value)
    empty: list[str] = []
    for path in DASHBOARDS:
        values = {}
        for name, query in dashboard_variables(path).items():
            match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query)
            assert match, f"{path.name} ${name}: {query}"
            values[name] = prometheus.label_values(match.group(2), match.group(1))
            rows.append(
                (path.stem, f"${name} = {query}", len(values[name]), ",".join(values[name]))
            )
            assert values[name], f"{path.name}: template variable ${name} lists nothing"
        for panel in dashboard_queries(path):
            result = prometheus.query(substitute(panel.expr, values))
            why = "" if result else LEGITIMATELY_EMPTY.get(panel.expr, "")
            numbers = [float(r["value"][1]) for r in result]
            sample = _fmt(max(numbers)) if result else "(empty: see below)"
            rows.append((path.stem, f"{panel.title}: `{panel.expr}`", len(result), sample))
            if not result and not why:
                empty.append(f"{path.name} / {panel.title}: {panel.expr}")
            elif result and all(math.isnan(n) for n in numbers):  # 0 / 0: no rate in the window
                empty.append(f"{path.name} / {panel.title}: NaN only: {panel.expr}")
    assert len(rows) >= 30

    # prometheus-adapter: the External metric the operator's HPA asks for
    (rule,) = adapter_external_rules()
    series = prometheus.series(rule["seriesQuery"])
    rows.append(("adapter", f"seriesQuery `{rule['seriesQuery']}`", len(series), ""))
    assert [s.get("pool") for s in series] == [POOL], series
    hpa_query = adapter_metrics_query(rule, {"namespace": NAMESPACE, "pool": POOL})
    hpa = prometheus.query(hpa_query)
    hpa_value = float(hpa[0]["value"][1]) if hpa else float("nan")
    rows.append(("adapter", f"metricsQuery (HPA) `{hpa_query}`", len(hpa), _fmt(hpa_value)))
    assert len(hpa) == 1 and hpa[0]["metric"] == {"namespace": NAMESPACE, "pool": POOL}, hpa
    assert hpa_value == 0.0  # nothing queued or running once the load is answered

    # the alert rules: loaded, healthy, silent on the healthy run
    groups = prometheus.api("rules")["groups"]
    loaded = [r for g in groups for r in g["rules"]]
    assert len(loaded) == 8 and all(r["health"] == "ok" for r in loaded), loaded
    # the store alert's ratio is there to watch (the rule is silent at this fill)
    store = prometheus.query(
        "max without (instance, pod) (wavepp_gateway_jetstream_store_used_bytes"
        " / wavepp_gateway_jetstream_store_limit_bytes)"
    )
    rows.append(("alerts", "WavePPJetStreamStoreNearFull's ratio", len(store),
                 _fmt(float(store[0]["value"][1])) if store else ""))  # fmt: skip
    assert len(store) == 1 and 0 < float(store[0]["value"][1]) < 0.85, store
    firing_healthy = [a["labels"]["alertname"] for a in prometheus.firing()]
    assert "WavePPStageDown" not in firing_healthy, prometheus.firing()

    # kill a stage: WavePPStageDown fires for it (its target down, its peer's group broken)
    stage_pids = {n: p for n, p in service.processes()["pids"].items() if n.startswith("stage-")}
    victim = sorted(stage_pids)[0]
    os.kill(stage_pids[victim], signal.SIGKILL)
    killed = time.monotonic()
    fired: list[dict[str, Any]] = []
    while not fired:
        fired = [a for a in prometheus.firing() if a["labels"]["alertname"] == "WavePPStageDown"]
        assert time.monotonic() - killed < 30, "WavePPStageDown did not fire within 30 s"
        time.sleep(0.25)
    fired_s = time.monotonic() - killed
    rows.append(("alerts", f"WavePPStageDown after SIGKILL of {victim}", len(fired),
                 f"firing after {fired_s:.1f} s"))  # fmt: skip
    check_s = time.monotonic() - live["started"]

    table = ["| dashboard / rule | query | results | largest value |", "| --- | --- | --- | --- |"]
    table += [f"| {w} | {_cell(q)} | {n} | {v} |" for w, q, n, v in rows]
    table += [f"| {e} | {LEGITIMATELY_EMPTY[e]} | | |" for e in LEGITIMATELY_EMPTY]
    print("\n" + "\n".join(table))
    print(
        f"\nlive check: wavepp up {live['up_s']:.1f} s, load {load_s:.1f} s "
        f"({sum(len(v) for v in statuses.values())} requests: "
        f"{json.dumps({k: v for k, v in statuses.items()})}), "
        f"{len(rows)} queries, WavePPStageDown firing {fired_s:.1f} s after the kill; "
        f"{check_s:.1f} s in all"
    )
    assert not empty, "queries with no data:\n" + "\n".join(empty)
