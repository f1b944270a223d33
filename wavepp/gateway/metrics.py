"""The gateway's metrics: OpenTelemetry instruments, scraped on the gateway's ``GET /metrics``.

The same stack as the runtime's metrics (``wavepp.telemetry.metrics``): instruments on an
OpenTelemetry ``MeterProvider``, rendered by the OpenTelemetry Prometheus exporter through a
``PrometheusExport``. Each ``Gateway`` has its own provider and registry. The series are the
table's, with exactly the labels it names: the export adds no ``otel_scope_*`` labels, no
``target_info`` series and (as the exporter never does) no ``*_created`` series.

| OTel instrument                      | kind       | unit       | Prometheus series                                   |
| ------------------------------------ | ---------- | ---------- | --------------------------------------------------- |
| wavepp.gateway.requests              | counter    | {request}  | wavepp_gateway_requests_total{tenant,code}          |
| wavepp.gateway.prompt_tokens         | counter    | {token}    | wavepp_gateway_prompt_tokens_total{tenant}          |
| wavepp.gateway.cached_tokens         | counter    | {token}    | wavepp_gateway_cached_tokens_total{tenant}          |
| wavepp.gateway.ttft                  | histogram  | s          | wavepp_gateway_ttft_seconds_*{tenant}               |
| wavepp.gateway.completion_ttft       | histogram  | s          | wavepp_gateway_completion_ttft_seconds_*{tenant}    |
| wavepp.gateway.time_per_output_token | histogram  | s          | wavepp_gateway_time_per_output_token_seconds_*{tenant} |
| wavepp.gateway.queue_depth           | obs. gauge | {request}  | wavepp_gateway_queue_depth{tenant}                  |
| wavepp.gateway.active_requests       | obs. gauge | {request}  | wavepp_gateway_active_requests{tenant}              |
| wavepp.gateway.requests_in_gateway   | obs. gauge | {request}  | wavepp_gateway_requests_in_gateway                  |
| wavepp.gateway.max_queued_requests   | obs. gauge | {request}  | wavepp_gateway_max_queued_requests                  |
| wavepp.gateway.backlog_requests      | obs. gauge | {request}  | wavepp_gateway_backlog_requests{pool}               |
| wavepp.gateway.replica_up            | obs. gauge | (none)     | wavepp_gateway_replica_up{replica}                  |
| wavepp.gateway.routed_reusable_blocks| counter    | {block}    | wavepp_gateway_routed_reusable_blocks_total{replica}|
| wavepp.gateway.auth_failures         | counter    | {request}  | wavepp_gateway_auth_failures_total{reason}          |
| wavepp.gateway.jetstream_store_used  | obs. gauge | By         | wavepp_gateway_jetstream_store_used_bytes           |
| wavepp.gateway.jetstream_store_limit | obs. gauge | By         | wavepp_gateway_jetstream_store_limit_bytes          |

``code`` is the HTTP status answered (the NATS API counts the status it puts in its reply);
``tenant`` is ``unknown`` for a request whose tenant could not be read or is not configured
(with API keys: the key's tenant, whenever the key was valid). ``reason`` of an authentication
failure: ``missing``, ``invalid``, ``tenant_mismatch``, ``rate_limited`` (never key material,
never the client's address).

``wavepp_gateway_ttft_seconds`` is the prefill's time to first token as the replica measured it
(``PrefillResult.ttft_s``), one sample per prefill served. The completion histograms are what a
client of ``/v1/completions`` and ``/v1/chat/completions`` sees (``decode.CompletionClock``):
``completion_ttft``, seconds from the request's admission (validated, before the gateway's queue)
to the first generated token sent to the client (a non-streamed answer carries every token at
once: its send; a prefill-only completion, ``max_tokens`` 1, is its answer, one sample per
request whatever its number of prompts); ``time_per_output_token``, per streamed request that ended normally with at
least two tokens, the mean seconds between the first token sent and the last
(``(t_last - t_first) / (tokens - 1)``, the definition vLLM's per-request TPOT uses). A request
that failed before its first token records neither; one that broke off mid-stream keeps its
TTFT and records no TPOT.

``wavepp_gateway_backlog_requests{pool}`` is the autoscaling signal (``spec.autoscaling.metric:
backlog``): the pool's requests queued or running in the gateway, labelled with the pool (the
WavePipeline's name) so that an HPA's External metric selects one pipeline; the chart's
prometheus-adapter rule (``charts/wavepp/templates/prometheus-adapter-rules.yaml``) serves it.

``wavepp_gateway_jetstream_store_*_bytes``: the JetStream file store of the gateway's NATS
account (its intake streams and results bucket, with every other WavePP stream of the account),
as the server's account info last answered (``JetStreamStore``). The limit series exists only
where the account has a disk limit (``wavepp up --jetstream-max-bytes``, ``wavepp nats-auth
--jetstream-max-bytes``); their ratio is what the chart's ``WavePPJetStreamStoreNearFull``
alert watches. Neither series exists before the first answer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from opentelemetry.metrics import CallbackOptions, Observation

from wavepp.telemetry.metrics import Instrument, PrometheusExport, attach

# Bucket bounds in seconds (no 60 s bucket, unlike the runtime's TTFT histogram).
GATEWAY_TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Seconds between output tokens: a decode step of a few ms (one GPU) to seconds (a loaded CPU).
GATEWAY_TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


# fmt: off
GATEWAY_INSTRUMENTS = (
    Instrument("wavepp.gateway.requests", "counter", "{request}", "_requests",
               "Requests by tenant and HTTP status"),
    Instrument("wavepp.gateway.prompt_tokens", "counter", "{token}", "_prompt_tokens",
               "Prompt tokens served"),
    Instrument("wavepp.gateway.cached_tokens", "counter", "{token}", "_cached_tokens",
               "Prompt tokens served from cache"),
    Instrument("wavepp.gateway.ttft", "histogram", "s", "_ttft", "Time to first token",
               GATEWAY_TTFT_BUCKETS_S),
    Instrument("wavepp.gateway.completion_ttft", "histogram", "s", "_completion_ttft",
               "Completions: admission to the first generated token sent to the client",
               GATEWAY_TTFT_BUCKETS_S),
    Instrument("wavepp.gateway.time_per_output_token", "histogram", "s", "_tpot",
               "Streamed completions: mean seconds between output tokens after the first",
               GATEWAY_TPOT_BUCKETS_S),
    Instrument("wavepp.gateway.routed_reusable_blocks", "counter", "{block}", "_routed_reusable",
               "Reusable blocks the router expected at the chosen replica"),
    Instrument("wavepp.gateway.auth_failures", "counter", "{request}", "_auth_failures",
               "Requests refused by authentication, by reason"),
    Instrument("wavepp.gateway.queue_depth", "gauge", "{request}", "_observe_queued",
               "Requests in the fair-share queue"),
    Instrument("wavepp.gateway.active_requests", "gauge", "{request}", "_observe_active",
               "Requests queued or running"),
    Instrument("wavepp.gateway.requests_in_gateway", "gauge", "{request}", "_observe_in_gateway",
               "Requests queued or running in the gateway, all tenants "
               "(the queue limit counts these)"),
    Instrument("wavepp.gateway.max_queued_requests", "gauge", "{request}", "_observe_max_queued",
               "The queue limit: past it requests get 429 (field queue)"),
    Instrument("wavepp.gateway.backlog_requests", "gauge", "{request}", "_observe_backlog",
               "The pool's requests queued or running in the gateway (autoscaling)"),
    Instrument("wavepp.gateway.replica_up", "gauge", "", "_observe_replica_up",
               "Replica in the pool (heartbeat)"),
    Instrument("wavepp.gateway.jetstream_store_used", "gauge", "By", "_observe_store_used",
               "JetStream file store used by the NATS account"),
    Instrument("wavepp.gateway.jetstream_store_limit", "gauge", "By", "_observe_store_limit",
               "The NATS account's JetStream disk limit"),
)
# fmt: on
GATEWAY_PROMETHEUS_NAMES = tuple(i.prometheus_name for i in GATEWAY_INSTRUMENTS)


@dataclass(frozen=True)
class JetStreamStore:
    """The account's JetStream file store, from the server's account info: ``used_bytes`` on
    disk; ``limit_bytes`` the account's disk limit, None where it has none (then only the
    server's ``max_file_store`` bounds it, which account info does not report)."""

    used_bytes: int
    limit_bytes: int | None

    @classmethod
    def from_account_info(cls, storage: int, max_storage: int | None) -> JetStreamStore:
        """From account info's ``storage`` and ``limits.max_storage`` (-1 or 0: no limit)."""
        limit = max_storage if max_storage is not None and max_storage > 0 else None
        return cls(used_bytes=storage, limit_bytes=limit)


@dataclass(frozen=True)
class GatewayLoad:
    """What the gateway's gauges read, once per scrape per gauge.

    ``num_queued_by_tenant``: requests in the fair-share queue; ``num_active_by_tenant``:
    requests queued or running; ``num_requests_in_gateway``: all tenants (what the queue limit
    counts); ``max_queued_requests``: that limit; ``is_replica_up``: replica -> in the pool;
    ``jetstream_store``: the account's store as last read (None: not read yet).
    """

    num_queued_by_tenant: Mapping[str, int]
    num_active_by_tenant: Mapping[str, int]
    num_requests_in_gateway: int
    max_queued_requests: int
    is_replica_up: Mapping[str, bool]
    jetstream_store: JetStreamStore | None = None


class GatewayMetrics:
    """The instruments of one gateway, on their own provider and registry (see the module doc).

    ``read_load`` is called on each scrape; the gateway's ``/metrics`` handler scrapes on the
    event loop, so it reads the gateway's state from the thread that owns it.
    """

    def __init__(self, read_load: Callable[[], GatewayLoad], *, pool: str = "") -> None:
        self._read_load = read_load
        self.pool = pool
        self.export = PrometheusExport("wavepp-gateway", scope_labels=False, target_info=False)
        attach(self, self.export.meter(), GATEWAY_INSTRUMENTS)

    # ---- recording -----------------------------------------------------------------------

    def request_answered(self, tenant: str, status: int) -> None:
        """Count one answered request (``status``: the HTTP status code)."""
        self._requests.add(1, {"tenant": tenant, "code": str(status)})

    def result_served(
        self, tenant: str, num_prompt_tokens: int, num_cached_tokens: int, ttft_s: float
    ) -> None:
        """Count a served result's prompt and cached tokens and record its TTFT (seconds)."""
        attrs = {"tenant": tenant}
        self._prompt_tokens.add(num_prompt_tokens, attrs)
        self._cached_tokens.add(num_cached_tokens, attrs)
        self._ttft.record(ttft_s, attrs)

    def first_token_sent(self, tenant: str, ttft_s: float) -> None:
        """A completion's first generated token reached the client ``ttft_s`` seconds after
        its admission (module doc)."""
        self._completion_ttft.record(ttft_s, {"tenant": tenant})

    def output_tokens_paced(self, tenant: str, tpot_s: float) -> None:
        """A streamed completion ended normally; ``tpot_s``: its mean seconds between output
        tokens after the first (module doc)."""
        self._tpot.record(tpot_s, {"tenant": tenant})

    def auth_failed(self, reason: str) -> None:
        """Count one request refused by authentication (``reason``: see the module doc)."""
        self._auth_failures.add(1, {"reason": reason})

    def routed(self, replica: str, num_reusable_blocks: int) -> None:
        """Count the reusable blocks the router expected at the replica it chose."""
        self._routed_reusable.add(num_reusable_blocks, {"replica": replica})

    def scrape(self) -> tuple[bytes, str]:
        """(Prometheus text, Content-Type) of every instrument, gauges read now."""
        return self.export.scrape()

    def shutdown(self) -> None:
        self.export.shutdown()

    # ---- gauges --------------------------------------------------------------------------

    def _observe_queued(self, _options: CallbackOptions) -> Iterable[Observation]:
        load = self._read_load()
        return [Observation(n, {"tenant": t}) for t, n in load.num_queued_by_tenant.items()]

    def _observe_active(self, _options: CallbackOptions) -> Iterable[Observation]:
        load = self._read_load()
        return [Observation(n, {"tenant": t}) for t, n in load.num_active_by_tenant.items()]

    def _observe_in_gateway(self, _options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(self._read_load().num_requests_in_gateway)]

    def _observe_backlog(self, _options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(self._read_load().num_requests_in_gateway, {"pool": self.pool})]

    def _observe_max_queued(self, _options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(self._read_load().max_queued_requests)]

    def _observe_replica_up(self, _options: CallbackOptions) -> Iterable[Observation]:
        load = self._read_load()
        return [Observation(int(up), {"replica": r}) for r, up in load.is_replica_up.items()]

    def _observe_store_used(self, _options: CallbackOptions) -> Iterable[Observation]:
        store = self._read_load().jetstream_store
        return [] if store is None else [Observation(store.used_bytes)]

    def _observe_store_limit(self, _options: CallbackOptions) -> Iterable[Observation]:
        store = self._read_load().jetstream_store
        return (
            [] if store is None or store.limit_bytes is None else [Observation(store.limit_bytes)]
        )
