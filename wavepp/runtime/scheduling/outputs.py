"""The scheduler core's output side: what a stage's done message and a deadline mean.

``DoneAccounting`` is mixed into ``SchedulerCore`` (core.py) and works on its state (the ledger,
the records, the micro-batches in flight), as SGLang splits its scheduler's output processing
from the core loop. No I/O.

A result is answered once every stage reported the micro-batch that carried it: a middle stage
publishes its done after sending its activations on, so the last stage's done (with the result)
can arrive first. The answer promises every stage's report (``stage_agreed_blocks``, the
service's per-stage timings), so the result waits in ``_held_results`` for the late done; the
slot and the pins are freed at the last stage's report. A done lost for good is
resent on a gap or a resync; failing that, the micro-batch's deadline answers the held
results as they are (``expire``).

Trust nothing: a done message counts only with this scheduler's epoch (an empty one never), a
rank in [0, S), with the bus key a valid tag, for a micro-batch outstanding in the ledger that
this rank has not reported; a result counts only for a request whose last chunk that
micro-batch carried. Anything else is dropped and counted (``num_forged_dones``).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

from wavepp.api.messages import MicroBatchDone, MicroBatchPlan, RequestResult
from wavepp.api.signing import BusKey
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.request import RequestOutcome
from wavepp.runtime.scheduling.ledger import PlanLedger, Report
from wavepp.runtime.scheduling.records import DoneUpdate, RequestRecord
from wavepp.runtime.scheduling.stats import StageSpan, WaveStats

log = logging.getLogger(__name__)


class DoneAccounting:
    """Done messages and deadlines of ``SchedulerCore``; the attributes below are the core's."""

    config: RuntimeConfig
    num_stages: int
    epoch: str
    bus_key: BusKey | None
    num_forged_dones: int = 0
    stats: WaveStats
    monotonic: Callable[[], float]
    ledger: PlanLedger[MicroBatchPlan]
    live: dict[str, RequestRecord]
    inflight: dict[int, list[str]]
    _published_at_s: dict[int, float]
    _held_results: dict[int, list[tuple[RequestRecord, RequestResult]]]
    _recent: OrderedDict[str, RequestOutcome]
    _finish: Callable[..., None]  # SchedulerCore._finish: the one way a request ends
    _prune_active: Callable[[], None]

    def update_from_done(self, done: MicroBatchDone) -> DoneUpdate:
        """Apply one stage's done message, once per (micro-batch, stage).

        A stage error fails the micro-batch's unanswered requests; the last stage's report
        answers requests with a result, frees the slot, and names the requests to release
        (none of their micro-batches left in flight, every chunk planned or answered).
        """
        update = DoneUpdate()
        if done.epoch != self.epoch:
            if done.epoch == "":
                self.num_forged_dones += 1
                log.error(
                    "done message without an epoch dropped (micro-batch %d)", done.microbatch_id
                )
            return update  # a previous scheduler's micro-batch
        if not 0 <= done.rank < self.num_stages:
            log.error("done message from rank %d dropped (S=%d)", done.rank, self.num_stages)
            return update
        if self.bus_key is not None and not self.bus_key.verify(done):
            self.num_forged_dones += 1
            log.error(
                "done message of micro-batch %d from rank %d dropped: its mac is missing or "
                "wrong (is WAVEPP_BUS_KEY the same in every process?)",
                done.microbatch_id,
                done.rank,
            )
            return update
        entry_plan = self.ledger.plan(done.microbatch_id)
        owners = self.ledger.owners(done.microbatch_id)
        report = self.ledger.report(done.microbatch_id, done.rank)
        if report in (Report.DUPLICATE, Report.UNKNOWN):
            return update
        update.counted = True
        update.owners = owners
        # Stages report in order: earlier done messages of this rank were lost.
        update.missing = self.ledger.missing_before(done.rank, done.microbatch_id)
        self.stats.record_span(
            StageSpan(
                rank=done.rank,
                microbatch_id=done.microbatch_id,
                num_tokens=done.num_tokens,
                prepare_start_s=done.prepare_start_s,
                prepare_end_s=done.prepare_end_s,
                execute_start_s=done.execute_start_s,
                execute_end_s=done.execute_end_s,
            )
        )
        for request_id, num_agreed in zip(owners, done.num_agreed_blocks, strict=False):
            recent = self._recent.get(request_id)
            if recent is not None:
                recent.stage_agreed_blocks.append((done.rank, num_agreed))
        if done.error:
            for request_id in self.inflight.get(done.microbatch_id, []):
                record = self.live.get(request_id)
                if record is not None and not record.status.is_finished:
                    self._finish(record, error=done.error)
            self._prune_active()
        if report is Report.LAST:  # every stage reported: answer what waited for this one
            self._answer_held(done.microbatch_id)
        if done.rank != self.num_stages - 1:
            return update
        request_ids = self.inflight.pop(done.microbatch_id, [])
        update.slot_freed = True
        held: list[tuple[RequestRecord, RequestResult]] = []
        last_chunks = (
            {c.request_id for c in entry_plan.chunks if c.is_last}
            if entry_plan is not None
            else set()
        )
        for result in done.results:
            if result.request_id not in last_chunks:
                self.num_forged_dones += 1
                log.error(
                    "micro-batch %d: result for %r dropped: the plan has no last chunk of it",
                    done.microbatch_id,
                    result.request_id,
                )
                continue
            record = self.live.get(result.request_id)
            if record is None or record.status.is_finished:
                continue
            held.append((record, result))
        if held and report is not Report.LAST:
            self._held_results[done.microbatch_id] = held
            update.held = True
        else:
            self._published_at_s.pop(done.microbatch_id, None)
            for record, result in held:
                self._answer(record, result)
        held_ids = {record.request_id for record, _ in held}
        for request_id in request_ids:
            record = self.live.get(request_id)
            if record is None:
                continue
            record.num_inflight_microbatches -= 1
            if record.num_inflight_microbatches == 0 and record.status.is_fully_planned:
                if not record.status.is_finished and request_id not in held_ids:
                    # last chunk ran without a result: report
                    self._finish(record, error="no result from the last stage")
                del self.live[request_id]
                update.to_release.append(request_id)
        return update

    def _answer(self, record: RequestRecord, result: RequestResult) -> None:
        if not record.status.is_finished:
            self._finish(record, first_token_id=result.first_token_id, logits=result.logits)

    def _answer_held(self, microbatch_id: int) -> None:
        """Answer the results held for ``microbatch_id`` (none: nothing happens)."""
        held = self._held_results.pop(microbatch_id, None)
        if held is None:
            return
        self._published_at_s.pop(microbatch_id, None)
        for record, result in held:
            self._answer(record, result)

    def overdue(self) -> list[int]:
        """Micro-batches in flight longer than ``microbatch_deadline_s``, in publish order
        (also those whose results wait for a stage's done)."""
        now = self.monotonic()
        deadline_s = self.config.microbatch_deadline_s
        return [
            mb for mb, published in self._published_at_s.items() if now - published > deadline_s
        ]

    def expire(self, microbatch_id: int) -> list[str]:
        """Fail the unfinished requests of a micro-batch past ``microbatch_deadline_s``.

        Each request is answered once, with an error naming the micro-batch and how many stages
        reported it; a result arriving later is dropped (the request is no longer live). Results
        the last stage reported while another stage's done never came are answered as they are
        (their ``stage_agreed_blocks`` lack that stage).

        Returns:
            The request ids to release on every stage.
        """
        self._published_at_s.pop(microbatch_id, None)
        request_ids = self.inflight.pop(microbatch_id, [])
        num_reports = self.ledger.num_reports(microbatch_id)
        self.ledger.drop(microbatch_id)
        if microbatch_id in self._held_results:
            log.warning(
                "micro-batch %d: %d of %d stages reported it within microbatch_deadline_s=%s s;"
                " answering its results without the others' reports",
                microbatch_id,
                num_reports,
                self.num_stages,
                self.config.microbatch_deadline_s,
            )
            self._answer_held(microbatch_id)
        if not request_ids:
            return []
        error = (
            f"micro-batch {microbatch_id} not finished within microbatch_deadline_s="
            f"{self.config.microbatch_deadline_s} s ({num_reports} of {self.num_stages} stages "
            "reported it): a stage died or lost the plan"
        )
        log.error("%s; failing requests %s", error, request_ids)
        to_release = []
        for request_id in request_ids:
            record = self.live.pop(request_id, None)
            if record is None:
                continue
            if not record.status.is_finished:
                self._finish(record, error=error)
            to_release.append(request_id)
        self._prune_active()
        return to_release
