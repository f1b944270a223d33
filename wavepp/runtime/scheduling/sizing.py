"""The scheduler core's micro-batch size: the closed-loop target each micro-batch is planned to.

``MicroBatchSizing`` is mixed into ``SchedulerCore`` (core.py) and works on its state (the open
population, the live records, the planner), as ``DoneAccounting`` (outputs.py) does for the
output side. No I/O. It owns the works of the requests admitted last (``_record_work``, called
at each admission), whose mean caps the target of a population that turns over within a round
(``recent_work_window`` states the window's contract).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence

from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.planning import ChunkPlanner, RequestProgress
from wavepp.runtime.scheduling.records import RequestRecord

# A planning set within this fraction of the closed-loop target counts as a full micro-batch
# (agreements of requests returning together end a few microseconds apart).
_FULL_FRACTION = 0.98
# With a way back, the closed-loop target of a population larger than the micro-batches in flight
# caps W by the mean work of the requests admitted last (the population's law): the last
# WORK_TURNOVERS x (open requests) of them, at least WORK_WINDOW_FLOOR
# (MicroBatchSizing.recent_work_window states the contract).
WORK_TURNOVERS = 8
WORK_WINDOW_FLOOR = 32
_WORKS_KEPT = 4096  # admitted requests' works kept: the window of up to 512 open requests


class MicroBatchSizing:
    """The closed-loop target of ``SchedulerCore``; the attributes below are the core's."""

    config: RuntimeConfig
    num_stages: int
    planner: ChunkPlanner
    num_open: int
    live: dict[str, RequestRecord]
    active: list[RequestRecord]

    def _init_sizing(self) -> None:
        self._mean_work_s: float | None = None
        # The work of the requests admitted last, oldest first, each request once (its latest
        # admission), at most _WORKS_KEPT of them.
        self._recent_works: OrderedDict[str, float] = OrderedDict()
        # Admissions so far, and the sum of the newest works last read: ((admissions, count),
        # sum), so the several targets of one micro-batch sum the window once.
        self._num_admissions = 0
        self._recent_sum: tuple[tuple[int, int], float] = ((0, 0), 0.0)

    def _record_work(self, request_id: str, work_s: float) -> None:
        """An admission of ``request_id`` with ``work_s`` seconds of chunk work: the newest of
        the recent works; admitted again (a re-form), its new work replaces its earlier one."""
        self._recent_works.pop(request_id, None)
        self._recent_works[request_id] = work_s
        if len(self._recent_works) > _WORKS_KEPT:
            self._recent_works.popitem(last=False)
        self._num_admissions += 1

    def recent_work_window(self) -> int:
        """How many requests admitted last the closed-loop cap averages over:
        ``WORK_TURNOVERS`` x the open requests, at least ``WORK_WINDOW_FLOOR`` (fewer while fewer
        were admitted; at most the last ``_WORKS_KEPT``).

        Counted in turnovers of the open population (a turnover: as many admissions as open
        requests, about one round of the closed loop), whatever the concurrency:

        - after a shift in the workload the window holds only the new workload's requests
          within ``WORK_TURNOVERS`` turnovers, and the cap is then the population's own work
          (a shift to longer prompts is followed in at most that many rounds; to shorter ones
          at once, the cap being a min);
        - within the window one request's work w above the mean m raises the cap by
          (w - m) / ``WORK_TURNOVERS`` (the population's own sum: by w - m), for
          ``WORK_TURNOVERS`` turnovers.

        ``WORK_TURNOVERS`` = 8 sets the two: a prompt of up to 9 x the mean work raises W by at
        most one mean request, so no micro-batch of its round grows by more than one request's
        share, and a shift is followed in at most 8 rounds. ``WORK_WINDOW_FLOOR`` keeps the
        mean over at least 32 requests when few are open.
        """
        return max(WORK_WINDOW_FLOOR, WORK_TURNOVERS * self.num_open)

    def _recent_mean_work_s(self, extra_works_s: Sequence[float]) -> float:
        """Mean work of the last ``recent_work_window()`` admitted requests, ``extra_works_s``
        (a speculation's, admitted after them) the newest; requires one of them."""
        window = self.recent_work_window()
        extra = list(extra_works_s)[-window:]
        num_old = min(len(self._recent_works), window - len(extra))
        key = (self._num_admissions, num_old)
        if self._recent_sum[0] != key:
            newest = itertools.islice(reversed(self._recent_works.values()), num_old)
            self._recent_sum = (key, sum(newest))
        old_s = self._recent_sum[1]
        return (old_s + sum(extra)) / (num_old + len(extra))

    def closed_loop_target_s(self, extra_works_s: Sequence[float] = ()) -> float | None:
        """Seconds per micro-batch on the slowest stage so that m micro-batches hold the work of
        every open request: c + W / m, m in [1, max_inflight] the count that finishes a round
        soonest, capped by the engine's largest micro-batch in the planner. None when off
        (``resolved_closed_loop_fill``) or before any request was admitted.

        A round lasts at least m*c + W (the busiest stage) and (S - 1 + k + r)(c + W / m): a
        request's k micro-batches cross the S stages one behind the other (GPipe's fill and
        drain, Huang et al. 2019, section 2.3), then its successor takes r micro-batch times to
        come back (``resolved_return_microbatches``: answer, resubmission, agreement, plan).
        With r = 0 (no way back: docs/bench/bound.md) m = S once W is large next to c; with
        r >= 1 m = S + r, so stage 0 runs the round's last r micro-batches while the first
        one's requests return, for r more c a round.

        W: the sum of each admitted, unfinished request's whole chunk work (once per round,
        however far it got) and, for open requests not admitted yet, the mean work of the
        admitted ones. With a way back (r >= 1) and more open requests than micro-batches in
        flight, every micro-batch carries several requests and the population turns over
        within a round (each finished request is replaced by a new one from the same workload,
        some of the round's requests being on their way back): W is then at most the open
        requests times the mean work of the last ``recent_work_window()`` admitted requests
        (each once: a request admitted again after a re-form counts its latest work), so that one
        long prompt entering the population does not raise the target of every micro-batch of
        its round (a micro-batch several times its neighbours' cost makes the next stage wait
        for it, and the closed loop keeps that size, since its requests come back together).
        ``extra_works_s``: requests counted as admitted with this work (a speculation's).
        """
        if not self.config.resolved_closed_loop_fill:
            return None
        works = [
            record.work_s
            for record in self.live.values()
            if record.ticket is not None and not record.status.is_finished
        ]
        mean_work_s = self._mean_work_s
        if works and not extra_works_s:
            self._mean_work_s = mean_work_s = sum(works) / len(works)
        works.extend(extra_works_s)
        if works and extra_works_s:
            mean_work_s = sum(works) / len(works)
        if mean_work_s is None:
            return None
        num_unadmitted = max(0, self.num_open - len(works))
        total_s = sum(works) + num_unadmitted * mean_work_s
        if (
            self.config.resolved_return_microbatches > 0
            and self.num_open > self.config.resolved_max_inflight
            and self._recent_works
        ):
            total_s = min(total_s, self.num_open * self._recent_mean_work_s(extra_works_s))
        fixed_s = self.planner.fixed_cost_s
        # m micro-batches per round (see the docstring), k = max(1, m / open requests) per
        # request. With little work in the system (W small next to c) fewer than S
        # micro-batches finish a round sooner.
        num_open = max(1, self.num_open)
        way_back = self.num_stages - 1 + self.config.resolved_return_microbatches
        num_microbatches = min(
            range(1, self.config.resolved_max_inflight + 1),
            key=lambda m: (
                max(
                    m * fixed_s + total_s,
                    (way_back + max(1.0, m / num_open)) * (fixed_s + total_s / m),
                ),
                -m,
            ),
        )
        return fixed_s + total_s / num_microbatches

    def is_underfull(self) -> bool:
        """The planning set holds less than one micro-batch's worth: the closed-loop target
        (capped by the engine's largest micro-batch), else ``chunk_tokens`` new tokens."""
        return self.is_underfull_over(
            [record.progress for record in self.active if record.progress is not None],
            self.closed_loop_target_s(),
        )

    def is_underfull_over(
        self, progresses: Sequence[RequestProgress], target_s: float | None
    ) -> bool:
        """``is_underfull`` for a given planning set and target (a speculation's)."""
        remaining = sum(p.num_prompt_tokens - p.num_computed_tokens for p in progresses)
        if target_s is None:
            return remaining < self.config.chunk_tokens
        if remaining >= self.planner.max_microbatch_tokens:
            return False
        pending_s = self.planner.remaining_work_s(progresses)
        return pending_s < _FULL_FRACTION * (target_s - self.planner.fixed_cost_s)
