"""A stage process's own metrics: ``GET /metrics`` on the stage pod's metrics port.

The same stack as the admission's and the gateway's (``wavepp.telemetry.metrics``, "Metrics" in
``docs/architecture.md``): OpenTelemetry observable instruments on a ``PrometheusExport``, whose
callbacks read the live :class:`StageSnapshot` at scrape time (in the scraping thread; the
counters read are plain ints and floats the event loop and compute thread update). Every
series carries ``pipeline`` (the replica) and ``stage_rank``; like the gateway's, no
``otel_scope_*`` labels and no ``target_info``.

| OTel instrument                   | kind        | unit         | Prometheus series                                 |
| --------------------------------- | ----------- | ------------ | ------------------------------------------------- |
| wavepp.stage.microbatches_run     | obs counter | {microbatch} | wavepp_stage_microbatches_run_total               |
| wavepp.stage.execute              | obs counter | s            | wavepp_stage_execute_seconds_total                |
| wavepp.stage.kv_blocks            | obs gauge   | {block}      | wavepp_stage_kv_blocks{state}                     |
| wavepp.stage.group_formed         | obs gauge   | (none)       | wavepp_stage_group_formed                         |
| wavepp.stage.group_epoch          | obs gauge   | (none)       | wavepp_stage_group_epoch                          |
| wavepp.stage.reforms              | obs counter | {reform}     | wavepp_stage_reforms_total                        |
| wavepp.stage.host_kv_blocks       | obs counter | {block}      | wavepp_stage_host_kv_blocks_total{op}             |
| wavepp.stage.chunks               | obs counter | {chunk}      | wavepp_stage_chunks_total{context}                |
| wavepp.stage.tokens               | obs counter | {token}      | wavepp_stage_tokens_total{kind}                   |

``state`` of a KV block: ``used`` (pinned by a request), ``cached`` (holding a hash, reusable,
not pinned) and ``free`` (neither); the three add up to the stage's block count.
``op`` of a host-tier block copy: ``spilled`` (an evicted device block written to the stage's
host tier) and ``loaded`` (a host block loaded into a device block for a reused prefix: a host
hit); both stay 0 without a host tier.
``context`` of a chunk run: ``none`` (a chunk at position 0: it attends to itself only) and
``cached`` (a chunk after an earlier chunk of its prompt or a reused prefix: it attends through
the paged cache). ``kind`` of a token: ``new`` (computed: activation rows) and ``context`` (the
cached positions the ``cached`` chunks attended, summed per chunk).
``group_formed`` is 1 while the stage's torch.distributed group is formed (0 while it re-forms);
``group_epoch`` the rendezvous epoch it formed in. Busy time per stage as the admission sees it stays ``wavepp_stage_busy_seconds_total``
on the admission's port; ``wavepp_stage_execute_seconds_total`` is the stage's own count.

The port is the spec's ``telemetry.metricsPort`` (``$WAVEPP_METRICS_PORT``), as for the
admission pod; the operator declares it as the stage container's ``metrics`` port.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from opentelemetry.metrics import CallbackOptions, Observation

from wavepp.telemetry.metrics import Instrument, PrometheusExport, attach

log = logging.getLogger(__name__)

# fmt: off
STAGE_INSTRUMENTS = (
    Instrument("wavepp.stage.microbatches_run", "observable_counter", "{microbatch}",
               "_observe_microbatches", "Micro-batches this stage finished"),
    Instrument("wavepp.stage.execute", "observable_counter", "s", "_observe_execute",
               "Wall time this stage spent executing micro-batches"),
    Instrument("wavepp.stage.kv_blocks", "gauge", "{block}", "_kv_blocks",
               "KV blocks by state: used (pinned), cached (reusable), free"),
    Instrument("wavepp.stage.group_formed", "gauge", "", "_observe_formed",
               "1 while the stage's torch.distributed group is formed"),
    Instrument("wavepp.stage.group_epoch", "gauge", "", "_observe_epoch",
               "The rendezvous epoch the stage's group formed in"),
    Instrument("wavepp.stage.reforms", "observable_counter", "{reform}", "_observe_reforms",
               "Times this stage re-formed its group in place"),
    Instrument("wavepp.stage.host_kv_blocks", "observable_counter", "{block}", "_host_kv_blocks",
               "KV blocks copied between the device and the host tier, by op: spilled (evicted "
               "to host), loaded (a host hit brought back)"),
    Instrument("wavepp.stage.chunks", "observable_counter", "{chunk}", "_chunks",
               "Chunks this stage ran, by context: none (at position 0), cached (after an "
               "earlier chunk or a reused prefix)"),
    Instrument("wavepp.stage.tokens", "observable_counter", "{token}", "_tokens",
               "Tokens of the chunks run, by kind: new (computed), context (cached positions "
               "attended)"),
)
# fmt: on
STAGE_PROMETHEUS_NAMES = tuple(i.prometheus_name for i in STAGE_INSTRUMENTS)


@dataclass(frozen=True)
class StageSnapshot:
    """One stage's counters now. Seconds are wall-clock execute time; blocks are KV blocks."""

    pipeline: str
    rank: int
    num_microbatches: int
    execute_s: float
    kv_used: int
    kv_cached: int
    kv_free: int
    is_formed: bool
    group_epoch: int
    num_reforms: int
    host_spilled: int = 0
    host_loaded: int = 0
    num_chunks: int = 0
    num_context_chunks: int = 0
    num_new_tokens: int = 0
    num_context_tokens: int = 0


def snapshot_of(worker: Any) -> StageSnapshot:
    """The live ``StageWorker``'s counters (its core's micro-batches and execute time, its KV
    pool). (Typed ``Any``: the worker imports this module, not the other way round.)"""
    pool = worker.core.manager.pool
    host = pool.host
    used = pool.num_pinned_blocks
    cached = pool.num_evictable_blocks
    return StageSnapshot(
        pipeline=worker.config.pipeline,
        rank=worker.rank,
        num_microbatches=worker.core.num_microbatches,
        execute_s=worker.core.execute_s,
        kv_used=used,
        kv_cached=cached,
        kv_free=pool.num_blocks - used - cached,
        is_formed=worker.is_formed,
        group_epoch=worker.group_epoch,
        num_reforms=worker.num_reforms,
        host_spilled=host.num_spills if host is not None else 0,
        host_loaded=host.num_loads if host is not None else 0,
        num_chunks=worker.core.num_chunks,
        num_context_chunks=worker.core.num_context_chunks,
        num_new_tokens=worker.core.num_new_tokens,
        num_context_tokens=worker.core.num_context_tokens,
    )


class StageMetrics:
    """The stage's instruments over ``source`` (called once per instrument per scrape).

    Args:
        source: returns the snapshot to report.
        export: where the instruments live (default: a new ``PrometheusExport`` without scope
            labels or ``target_info``).
    """

    def __init__(
        self, source: Callable[[], StageSnapshot], export: PrometheusExport | None = None
    ) -> None:
        self.source = source
        self.export = export or PrometheusExport(
            "wavepp-stage", scope_labels=False, target_info=False
        )
        self._observe_microbatches = self._one(lambda s: s.num_microbatches)
        self._observe_execute = self._one(lambda s: s.execute_s)
        self._observe_formed = self._one(lambda s: int(s.is_formed))
        self._observe_epoch = self._one(lambda s: s.group_epoch)
        self._observe_reforms = self._one(lambda s: s.num_reforms)
        self._kv_blocks = self._by(
            "state", lambda s: {"used": s.kv_used, "cached": s.kv_cached, "free": s.kv_free}
        )
        self._host_kv_blocks = self._by(
            "op", lambda s: {"spilled": s.host_spilled, "loaded": s.host_loaded}
        )
        self._chunks = self._by(
            "context",
            lambda s: {"none": s.num_chunks - s.num_context_chunks, "cached": s.num_context_chunks},
        )
        self._tokens = self._by(
            "kind", lambda s: {"new": s.num_new_tokens, "context": s.num_context_tokens}
        )
        attach(self, self.export.meter(), STAGE_INSTRUMENTS)

    @staticmethod
    def _labels(snapshot: StageSnapshot) -> dict[str, str | int]:
        return {"pipeline": snapshot.pipeline, "stage_rank": snapshot.rank}

    def _one(
        self, value: Callable[[StageSnapshot], float]
    ) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(_options: CallbackOptions) -> Iterable[Observation]:
            snapshot = self.source()
            return [Observation(value(snapshot), self._labels(snapshot))]

        return observe

    def _by(
        self, label: str, values: Callable[[StageSnapshot], dict[str, float]]
    ) -> Callable[[CallbackOptions], Iterable[Observation]]:
        """An observer of one series per ``label`` value: ``values(snapshot)`` in its order."""

        def observe(_options: CallbackOptions) -> Iterable[Observation]:
            snapshot = self.source()
            labels = self._labels(snapshot)
            return [Observation(v, labels | {label: k}) for k, v in values(snapshot).items()]

        return observe

    def scrape(self) -> tuple[bytes, str]:
        """The Prometheus text now (tests; ``serve`` is what a pod uses)."""
        return self.export.scrape()

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Serve ``GET /metrics`` on ``host``:``port`` (0: any free one); returns the port bound."""
        return self.export.serve(port, host)

    def shutdown(self) -> None:
        self.export.shutdown()


def serve_stage_metrics(
    worker: Any, port: int | None, host: str = "0.0.0.0"
) -> StageMetrics | None:
    """Serve the ``StageWorker``'s metrics on ``host``:``port`` (None: metrics off, returns
    None)."""
    if port is None:
        return None
    metrics = StageMetrics(lambda: snapshot_of(worker))
    bound = metrics.serve(port, host)
    log.info("stage %d: Prometheus metrics on http://%s:%d/metrics", worker.rank, host, bound)
    return metrics
