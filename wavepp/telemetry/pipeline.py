"""The runtime's telemetry hooks: one object in the scheduler process, one in each stage process.

Span tree of one request (all in one trace; ``request`` lives in the scheduler process, the stage
spans in the stage processes, joined through the W3C traceparent of their parent). ``request`` is
the trace's root, or, when the gateway traced the request (``IntakeRequest.traceparent``), a
child of the gateway's ``prefill`` span (``wavepp.gateway.decode_flow``)::

    request                               request.id, tenant, tokens.prompt, tokens.cached, ...
    ├── agreement  (one per attempt)      prefix.agreed_blocks, agreement.refused, prefix.stage_hits
    │   └── agreement.probe_reserve       pin each stage's hit, reserve the rest, in one round
    │                                     trip (prefix.agreed_blocks, reservation.num_blocks)
    ├── reservation.wait                  only after a refusal: backpressure until blocks free up
    └── microbatch (one per chunk of      microbatch.id, chunk.index, tokens.new, context.length
        │           this request)         from planning start to the last stage's end
        ├── planning                      the planner's cut and the plan's publication
        ├── stage.prepare  x S            stage.rank, block tables and slot mapping
        └── stage.execute  x S            stage.rank, the stage's layers on the micro-batch

A micro-batch holds chunks of several requests. We chose **one micro-batch span per request
chunk** (rather than one span per micro-batch with links to the requests): each request's trace
is then complete on its own (TTFT, agreement and every stage's work in one tree), and a
micro-batch's spans across traces share ``microbatch.id``; tools that need one bar per stage and
micro-batch (wave fill, the timeline) deduplicate on (``stage.rank``, ``microbatch.id``).
``microbatch.num_chunks`` says how many traces share a micro-batch.

The plan's traceparent field carries the first chunk's context; the NATS message header
``traceparent`` carries the same, and ``wavepp-chunk-traceparents`` carries one per chunk, in
plan order (empty for a chunk whose request is not sampled).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from opentelemetry.context import Context
from opentelemetry.trace import Span, Status, StatusCode

from wavepp.api.messages import KVEventBatch, MicroBatchDone, MicroBatchPlan
from wavepp.api.signing import BusKey
from wavepp.api.subjects import ReplicaSubjects
from wavepp.telemetry import tracing
from wavepp.telemetry.metrics import PipelineSource, get_metrics

log = logging.getLogger(__name__)

CHUNK_TRACEPARENTS_HEADER = "wavepp-chunk-traceparents"


class _Stats(Protocol):
    """The runtime's wave statistics (``WaveStats``), read by the observable gauges.

    NOTE: the gauges hold this object for the pipeline's life; a new measured window resets it
    in place (``WaveStats.reset``), so a scrape always reads the current run. ``spans`` may be
    a window of the recent ones; an ``execution_window()`` method, where present, gives the
    bounds over every span recorded.
    """

    spans: Sequence[Any]

    def wave_fill(self, num_stages: int) -> float: ...

    def busy_s_by_stage(self, num_stages: int) -> list[float]: ...


@dataclass(frozen=True)
class ChunkInfo:
    """One chunk of a published micro-batch, as the telemetry hooks see it."""

    request_id: str
    chunk_index: int
    num_tokens: int
    context_offset: int


def tenant_of(tenant: str, cache_salt: str) -> str:
    """The ``tenant`` label of a request: its tenant; else from a default salt ``tenant:{name}``;
    else ``default`` (no salt) or ``salted`` (a custom salt, never put in a label)."""
    if tenant:
        return tenant
    if cache_salt.startswith("tenant:"):
        return cache_salt[len("tenant:") :]
    return "salted" if cache_salt else "default"


def stage_idle_s(stats: _Stats, num_stages: int) -> list[float]:
    """Per stage: execution window (first execute start to last execute end) minus busy time."""
    execution_window = getattr(stats, "execution_window", None)
    if execution_window is not None:
        window = execution_window()
    elif stats.spans:
        window = (
            min(s.execute_start_s for s in stats.spans),
            max(s.execute_end_s for s in stats.spans),
        )
    else:
        window = None
    if window is None:
        return [0.0] * num_stages
    start, end = window
    return [max(0.0, (end - start) - busy) for busy in stats.busy_s_by_stage(num_stages)]


class PipelineTelemetry:
    """Scheduler-side hooks: request root spans, micro-batch spans, and the runtime metrics.

    Every method returns at once when tracing and metrics are off.
    """

    def __init__(
        self,
        pipeline: str,
        num_stages: int,
        stats: _Stats,
        queue_depths: Callable[[], dict[str, int]],
        *,
        bus_key: BusKey | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.num_stages = num_stages
        self.bus_key = bus_key  # the replica's: KV events must carry its tag (None: unchecked)
        self.metrics = get_metrics()
        self._roots: dict[str, Span] = {}
        self._num_submitted: dict[str, int] = {}  # a duplicate id shares the first one's root
        self._tenants: dict[str, str] = {}
        self._microbatches: dict[int, list[Span]] = {}
        self._sub: Any = None
        if self.metrics is not None:
            self.metrics.register(
                PipelineSource(
                    pipeline=pipeline,
                    wave_fill=lambda: stats.wave_fill(num_stages),
                    stage_idle_s=lambda: stage_idle_s(stats, num_stages),
                    queue_depths=queue_depths,
                )
            )
            # A counter's series appears at its first add: a pipeline that never dropped a
            # speculation would show "no data" on its dashboard panel (and a scrape would
            # lack the series), so it starts at 0.
            self.metrics.speculations_discarded.add(0, self._attrs())

    def _attrs(self, tenant: str | None = None, **extra: Any) -> dict[str, Any]:
        attrs: dict[str, Any] = {"pipeline": self.pipeline}
        if tenant is not None:
            attrs["tenant"] = tenant
        attrs.update(extra)
        return attrs

    # ---- requests ------------------------------------------------------------------------

    def request_arrived(
        self,
        request_id: str,
        arrival_s: float,
        num_prompt_tokens: int,
        tenant: str,
        *,
        traceparent: str = "",
    ) -> None:
        """Open the request's ``request`` span: a child of ``traceparent`` (the gateway's span,
        W3C) when given and valid, else the root of a trace of its own."""
        self._tenants[request_id] = tenant
        if not tracing.is_enabled():
            return
        self._num_submitted[request_id] = self._num_submitted.get(request_id, 0) + 1
        if request_id in self._roots:
            return
        span = tracing.start_span(
            "request",
            start_s=arrival_s,
            # the caller's span, else a root: never a child of whatever is current here
            parent=tracing.context_from_traceparent(traceparent) or Context(),
            attributes={
                "request.id": request_id,
                "tenant": tenant,
                "tokens.prompt": num_prompt_tokens,
                "pipeline": self.pipeline,
            },
        )
        if span is not None:
            self._roots[request_id] = span

    @contextlib.contextmanager
    def request_context(self, request_id: str) -> Iterator[None]:
        """Spans started in the block (agreement) become children of the request's root."""
        with tracing.use_span(self._roots.get(request_id)):
            yield

    def admitted(
        self,
        request_id: str,
        *,
        num_prompt_tokens: int,
        num_cached_tokens: int,
        agreement_s: float,
        num_refusals: int,
    ) -> None:
        tenant = self._tenants.get(request_id, "")
        root = self._roots.get(request_id)
        if root is not None:
            root.set_attributes(
                {
                    "tokens.cached": num_cached_tokens,
                    "tokens.new": num_prompt_tokens - num_cached_tokens,
                    "reservation.refusals": num_refusals,
                }
            )
        if self.metrics is None:
            return
        attrs = self._attrs(tenant)
        self.metrics.admissions.add(1, attrs)
        self.metrics.agreement_duration.record(agreement_s, self._attrs())
        if num_refusals:
            self.metrics.reservation_refusals.add(num_refusals, attrs)
        self.metrics.prompt_tokens.add(num_cached_tokens, {**attrs, "kind": "cached"})
        self.metrics.prompt_tokens.add(
            num_prompt_tokens - num_cached_tokens, {**attrs, "kind": "new"}
        )

    def completed(
        self, request_id: str, *, ttft_s: float, finished_s: float, error: str = ""
    ) -> None:
        tenant = self._tenants.get(request_id, "")
        root = None
        num_left = self._num_submitted.get(request_id, 0) - 1
        if num_left > 0:
            self._num_submitted[request_id] = num_left
        else:
            self._num_submitted.pop(request_id, None)
            self._tenants.pop(request_id, None)
            root = self._roots.pop(request_id, None)
        if root is not None:
            root.set_attribute("ttft_s", ttft_s)
            if error:
                root.set_status(Status(StatusCode.ERROR, error))
            tracing.end_span(root, finished_s)
        if self.metrics is None:
            return
        attrs = self._attrs(tenant)
        self.metrics.requests_completed.add(1, {**attrs, "outcome": "error" if error else "ok"})
        if not error:
            self.metrics.ttft.record(ttft_s, attrs)

    # ---- micro-batches -------------------------------------------------------------------

    def microbatch_published(
        self,
        microbatch_id: int,
        chunks: Sequence[ChunkInfo],
        planning_start_s: float,
        published_s: float,
    ) -> tuple[str, dict[str, str] | None]:
        """Open one ``microbatch`` span per request chunk; return (traceparent, NATS headers).

        Returns ``("", None)`` when no chunk's request is traced.
        """
        if self.metrics is not None:
            self.metrics.microbatches.add(1, self._attrs())
        if not self._roots:
            return "", None
        spans: list[Span] = []
        traceparents: list[str] = []
        for chunk in chunks:
            root = self._roots.get(chunk.request_id)
            span = None
            if root is not None and root.is_recording():  # unsampled: no stage spans either
                span = tracing.start_span(
                    "microbatch",
                    parent=tracing.context_of(root),
                    start_s=planning_start_s,
                    attributes={
                        "microbatch.id": microbatch_id,
                        "microbatch.num_chunks": len(chunks),
                        "chunk.index": chunk.chunk_index,
                        "tokens.new": chunk.num_tokens,
                        "context.length": chunk.context_offset,
                    },
                )
            if span is not None:
                spans.append(span)
                tracing.record_span(
                    "planning",
                    planning_start_s,
                    published_s,
                    parent=tracing.context_of(span),
                    attributes={"microbatch.id": microbatch_id},
                )
            traceparents.append(tracing.traceparent_of(span))
        if not spans:
            return "", None
        self._microbatches[microbatch_id] = spans
        first = next((tp for tp in traceparents if tp), "")
        headers = {
            tracing.TRACEPARENT_HEADER: first,
            CHUNK_TRACEPARENTS_HEADER: ",".join(traceparents),
        }
        return first, headers

    def speculation_discarded(self) -> None:
        """A speculative plan was dropped (``scheduling/speculation.py``); the scheduler's
        ``stats.num_speculations_discarded`` counts the same."""
        if self.metrics is not None:
            self.metrics.speculations_discarded.add(1, self._attrs())

    def stage_done(self, done: MicroBatchDone) -> None:
        """A stage reported a micro-batch: busy time; the last stage closes its spans."""
        if self.metrics is not None:
            self.metrics.stage_busy.add(
                max(0.0, done.execute_end_s - done.execute_start_s),
                self._attrs(**{"stage.rank": done.rank}),
            )
        if done.rank == self.num_stages - 1:
            for span in self._microbatches.pop(done.microbatch_id, []):
                tracing.end_span(span, done.execute_end_s)

    # ---- KV events -----------------------------------------------------------------------

    async def start(self, transport: Any, subject_prefix: str) -> None:
        """Count evictions from the stages' KV events (only when metrics are on).

        Args:
            transport: the scheduler's ``PlanTransport`` (its ``subscribe(subject, cb)``).
            subject_prefix: the replica's subject prefix.
        """
        if self.metrics is None:
            return
        self._sub = await transport.subscribe(
            ReplicaSubjects(subject_prefix).kv_events("*"), self._on_kv_events
        )

    async def _on_kv_events(self, msg: Any) -> None:
        try:
            batch = KVEventBatch.model_validate_json(msg.data)
        except ValueError as exc:
            log.debug("invalid KV event batch ignored: %s", exc)
            return
        if not 0 <= batch.rank < self.num_stages or (
            self.bus_key is not None and not self.bus_key.verify(batch)
        ):
            log.debug("KV event batch of rank %d ignored: not a stage's", batch.rank)
            return
        self.kv_removed(batch.rank, sum(len(chain) for chain in batch.removed))

    def kv_removed(self, rank: int, num_blocks: int) -> None:
        if self.metrics is not None and num_blocks:
            self.metrics.kv_evictions.add(num_blocks, self._attrs(**{"stage.rank": rank}))

    async def close(self) -> None:
        """Unsubscribe, stop observing this pipeline, end spans still open (at now)."""
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None
        if self.metrics is not None:  # keep reporting the final values, frozen
            source = self.metrics.sources.get(self.pipeline)
            if source is not None:
                fill, idle = source.wave_fill(), source.stage_idle_s()
                self.metrics.register(
                    PipelineSource(self.pipeline, lambda: fill, lambda: idle, lambda: {})
                )
        for spans in self._microbatches.values():
            for span in spans:
                tracing.end_span(span)
        for root in self._roots.values():
            tracing.end_span(root)
        self._microbatches.clear()
        self._roots.clear()


class StageTelemetry:
    """Stage-side hooks: record ``stage.prepare``/``stage.execute`` under each chunk's span."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._parents: dict[int, list[Context | None]] = {}

    def plan_received(self, plan: MicroBatchPlan, headers: Mapping[str, str] | None) -> None:
        if not tracing.is_enabled():
            return
        joined = (headers or {}).get(CHUNK_TRACEPARENTS_HEADER)
        if joined is not None:
            traceparents = joined.split(",")
        else:  # a publisher without per-chunk headers: the plan's one context for chunk 0
            traceparents = [plan.traceparent] + [""] * (len(plan.chunks) - 1)
        parents = [tracing.context_from_traceparent(tp) for tp in traceparents]
        if any(p is not None for p in parents):
            self._parents[plan.microbatch_id] = parents

    def microbatch_done(self, plan: MicroBatchPlan, done: MicroBatchDone) -> None:
        parents = self._parents.pop(plan.microbatch_id, None)
        if parents is None:
            return
        for i, (chunk, parent) in enumerate(zip(plan.chunks, parents, strict=False)):
            if parent is None:
                continue
            attrs: dict[str, Any] = {
                "stage.rank": self.rank,
                "microbatch.id": plan.microbatch_id,
                "microbatch.num_chunks": len(plan.chunks),
                "microbatch.num_tokens": done.num_tokens,
                "chunk.index": chunk.chunk_index,
                "tokens.new": len(chunk.token_ids),
                "context.length": chunk.context_offset,
            }
            if i < len(done.num_agreed_blocks):
                attrs["prefix.agreed_blocks"] = done.num_agreed_blocks[i]
            if done.error:
                attrs["error"] = done.error
            tracing.record_span(
                "stage.prepare",
                done.prepare_start_s,
                done.prepare_end_s,
                parent=parent,
                attributes=attrs,
            )
            tracing.record_span(
                "stage.execute",
                done.execute_start_s,
                done.execute_end_s,
                parent=parent,
                attributes=attrs,
            )
