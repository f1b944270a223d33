"""A real Prometheus server (Debian's ``prometheus`` package) for the metrics checks: start it on
a free port with static scrape targets and rule files, query it over its HTTP API, stop it.

Also what the checks evaluate: every panel query and template variable of the shipped Grafana
dashboards, and the chart's prometheus-adapter rule and alert rules.

Without the ``prometheus`` / ``promtool`` commands (``scripts/install-prometheus.sh`` installs
them on Debian/Ubuntu) ``require`` skips the test with a message naming the script.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from wavepp.runtime.procs import stop_processes
from wavepp.runtime.transport.natsio import free_port

REPO = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((REPO / "dashboards").glob("*.json"))
CHART = REPO / "charts" / "wavepp"
ALERT_RULES = CHART / "rules" / "wavepp-alerts.yaml"
ADAPTER_RULES = CHART / "templates" / "prometheus-adapter-rules.yaml"


def require(command: str) -> str:
    """The path of ``command`` (``prometheus`` or ``promtool``). Without it the test skips, or
    fails where ``$WAVEPP_REQUIRE_PROMETHEUS`` is 1 (scripts/test.sh sets it where the install
    can work: apt-get, as root)."""
    path = shutil.which(command)
    if path is None:
        why = (
            f"{command} not installed (Debian/Ubuntu: bash scripts/install-prometheus.sh; "
            "scripts/test.sh runs it)"
        )
        if os.environ.get("WAVEPP_REQUIRE_PROMETHEUS") == "1":
            pytest.fail(why)
        pytest.skip(why)
    return path


@dataclass(frozen=True)
class PanelQuery:
    """One target of a dashboard panel: ``dashboard`` file stem, panel ``title``, ``expr``."""

    dashboard: str
    title: str
    expr: str


def dashboard_variables(path: Path) -> dict[str, str]:
    """A dashboard's query template variables: name -> its ``label_values(series, label)``."""
    variables = {}
    for variable in json.loads(path.read_text()).get("templating", {}).get("list", []):
        query = variable.get("query")
        if isinstance(query, dict):
            query = query.get("query")
        if variable.get("type") == "query" or (query and query.startswith("label_values(")):
            variables[variable["name"]] = query
    return variables


def dashboard_queries(path: Path) -> list[PanelQuery]:
    """Every target ``expr`` of every panel (rows' nested panels included), in file order."""

    def walk(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for panel in panels:
            yield panel
            yield from walk(panel.get("panels", []))

    queries = []
    for panel in walk(json.loads(path.read_text())["panels"]):
        for target in panel.get("targets", []):
            if target.get("expr"):
                queries.append(PanelQuery(path.stem, panel.get("title", ""), target["expr"]))
    return queries


def adapter_external_rules() -> list[dict[str, Any]]:
    """The chart's prometheus-adapter ``externalRules`` (its ConfigMap's ``external-rules.yaml``,
    the template's ``{{ }}`` lines dropped: they only wrap the manifest)."""
    text = "\n".join(line for line in ADAPTER_RULES.read_text().splitlines() if "{{" not in line)
    config_map = yaml.safe_load(text)
    return yaml.safe_load(config_map["data"]["external-rules.yaml"])["externalRules"]


def adapter_custom_rules() -> list[dict[str, Any]]:
    """The chart's prometheus-adapter custom ``rules`` (per-object metrics: its ConfigMap's
    ``custom-rules.yaml``), read as :func:`adapter_external_rules` reads the external ones."""
    text = "\n".join(line for line in ADAPTER_RULES.read_text().splitlines() if "{{" not in line)
    config_map = yaml.safe_load(text)
    return yaml.safe_load(config_map["data"]["custom-rules.yaml"])["rules"]


def adapter_pods_query(rule: dict[str, Any], series: str, namespace: str, pods: list[str]) -> str:
    """``rule``'s ``metricsQuery`` as prometheus-adapter expands it for a Pods metric request
    (an HPA's ``type: Pods``) over ``pods`` of ``namespace``: ``<<.Series>>`` the series name,
    ``<<.LabelMatchers>>`` the namespace and the pods (a regex alternation),
    ``<<.GroupBy>>`` the pod label. Pod names are DNS labels: nothing a regex escapes."""
    for pod in pods:
        assert re.fullmatch(r"[a-z0-9-]+", pod), pod
    matchers = f'namespace="{namespace}",pod=~"{"|".join(pods)}"'
    return (
        rule["metricsQuery"]
        .replace("<<.Series>>", series)
        .replace("<<.LabelMatchers>>", matchers)
        .replace("<<.GroupBy>>", "pod")
    )


def adapter_metrics_query(rule: dict[str, Any], matchers: dict[str, str]) -> str:
    """``rule``'s ``metricsQuery`` as prometheus-adapter expands it for an External metric
    request with ``matchLabels`` ``matchers``: ``<<.Series>>`` the series name,
    ``<<.LabelMatchers>>`` ``k="v"`` joined by commas."""
    series = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", rule["seriesQuery"].strip("'\" "))
    assert series, rule["seriesQuery"]
    label_matchers = ",".join(f'{k}="{v}"' for k, v in sorted(matchers.items()))
    return (
        rule["metricsQuery"]
        .replace("<<.Series>>", series.group(0))
        .replace("<<.LabelMatchers>>", label_matchers)
    )


class PrometheusServer:
    """A ``prometheus`` process on 127.0.0.1 scraping ``targets`` every ``interval_s``.

    Args:
        directory: its config, rule copies and TSDB go here.
        targets: ``(job, url of a /metrics, extra target labels)``.
        rule_files: Prometheus rules files (evaluated every ``interval_s``).
        interval_s: scrape and rule evaluation interval, seconds.
    """

    def __init__(
        self,
        directory: Path,
        targets: list[tuple[str, str, dict[str, str]]],
        rule_files: list[Path] = (),
        interval_s: float = 1.0,
    ) -> None:
        self.directory = directory
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        jobs: dict[str, list[dict[str, Any]]] = {}
        for job, url, labels in targets:
            parsed = urllib.parse.urlparse(url)
            jobs.setdefault(job, []).append(
                {"targets": [parsed.netloc], "labels": {**labels, "__metrics_path__": parsed.path}}
            )
        interval = f"{int(interval_s * 1000)}ms"
        config = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": [
                {"job_name": job, "scrape_timeout": interval, "static_configs": static}
                for job, static in jobs.items()
            ],
        }
        directory.mkdir(parents=True, exist_ok=True)
        self.config_path = directory / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = directory / "prometheus.log"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 30.0) -> None:
        """Start and wait for ``/-/ready``. Raises RuntimeError (with its log) if it exits."""
        with self.log_path.open("wb") as log:
            self._proc = subprocess.Popen(
                [
                    require("prometheus"),
                    f"--config.file={self.config_path}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    f"--storage.tsdb.path={self.directory / 'tsdb'}",
                    "--storage.tsdb.retention.time=1h",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError("prometheus exited:\n" + self.log_path.read_text()[-3000:])
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1.0) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"prometheus not ready in {timeout_s}s")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            stop_processes([proc])

    def api(self, path: str, **params: str) -> Any:
        """GET ``/api/v1/{path}``; its ``data``. Raises AssertionError on a non-success status
        (a PromQL error names the expression)."""
        query = urllib.parse.urlencode(params, doseq=True)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read() or b"{}")
        assert body.get("status") == "success", f"{path} {params}: {body}"
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result vector (scalar results as one sample)."""
        data = self.api("query", query=expr)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def series(self, match: str) -> list[dict[str, str]]:
        """``/api/v1/series`` of one selector over the last 10 minutes."""
        now = time.time()
        return self.api("series", **{"match[]": match, "start": str(now - 600), "end": str(now)})

    def label_values(self, label: str, match: str) -> list[str]:
        """What Grafana's ``label_values(match, label)`` lists."""
        return self.api(f"label/{label}/values", **{"match[]": match})

    def targets_up(self) -> dict[str, str]:
        """scrape URL -> health (``up``, ``down``, ``unknown``) of every active target."""
        return {t["scrapeUrl"]: t["health"] for t in self.api("targets")["activeTargets"]}

    def wait_scraped_after(self, wall_s: float, timeout_s: float = 60.0) -> None:
        """Wait until every active target's last scrape started after ``wall_s`` (seconds since
        the epoch) and succeeded: from then on each series holds a sample that counts whatever
        happened before ``wall_s``. A target's scrape may time out while the machine is loaded
        (``scrape_timeout`` is the interval), so a fixed sleep does not give that.

        Raises:
            AssertionError: not within ``timeout_s``; names each target's last scrape and health.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            targets = self.api("targets")["activeTargets"]
            late = {
                t["scrapeUrl"]: (t["lastScrape"], t["health"])
                for t in targets
                if t["health"] != "up" or _rfc3339_s(t["lastScrape"]) <= wall_s
            }
            if targets and not late:
                return
            assert time.monotonic() < deadline, f"not scraped after {wall_s}: {late}"
            time.sleep(0.2)

    def firing(self) -> list[dict[str, Any]]:
        """The alerts firing now (``/api/v1/alerts``, state ``firing``)."""
        return [a for a in self.api("alerts")["alerts"] if a["state"] == "firing"]


def _rfc3339_s(stamp: str) -> float:
    """Seconds since the epoch of Prometheus' RFC 3339 time (nanosecond digits, ``Z`` or an
    offset); 0.0 for Go's zero time (a target not scraped yet)."""
    match = re.fullmatch(r"(.+?T\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)", stamp)
    assert match, stamp
    whole, fraction, zone = match.groups()
    parsed = datetime.fromisoformat(whole + ("+00:00" if zone == "Z" else zone))
    return max(0.0, parsed.timestamp() + float(fraction or 0))


def substitute(expr: str, values: dict[str, list[str]]) -> str:
    """``expr`` with Grafana's ``$name`` variables replaced by a regex of their values (the
    dashboards match them with ``=~``). Values are names (pipelines, tenants): letters, digits,
    ``-`` and ``_``, nothing a regex or a PromQL string would need escaped."""
    for name in sorted(values, key=len, reverse=True):
        for value in values[name]:
            assert re.fullmatch(r"[A-Za-z0-9_-]+", value), f"${name} value {value!r}"
        regex = "|".join(values[name]) or ".*"
        expr = expr.replace(f"${name}", regex).replace(f"${{{name}}}", regex)
    return expr
