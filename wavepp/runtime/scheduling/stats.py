"""Wave statistics as a bounded snapshot: running sums over a run, fixed windows of recent detail.

A long-lived scheduler (the admission service) records one ``StageSpan`` per (micro-batch,
stage) for as long as it runs, and a metrics scrape reads the statistics at any time: memory and
read cost must not grow with the run. ``WaveStats`` keeps

* running sums (O(1) to read): micro-batches and their tokens, per-stage busy seconds, the
  execution window (first execute start, last execute end), hence wave fill and idle time;
* fixed windows (a ring of the last ``window`` entries): recent spans (timelines, idle gaps)
  and recent micro-batch sizes.

The sums are accumulated in arrival order, so a run's wave fill and busy seconds equal, bit for
bit, ``sum()`` over every span in the order recorded. The windows hold the whole run while it has
at most ``window`` entries (every replay, grid and simulator run; ``DEFAULT_WINDOW``).
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

DEFAULT_WINDOW = 16384  # spans (and micro-batch sizes) kept for detail; ~4 MiB at most


@dataclass(frozen=True, slots=True)
class StageSpan:
    """One stage's work on one micro-batch (for wave-fill accounting and timelines).

    Times are the stage's ``time.time()`` seconds (virtual seconds in the simulator).
    """

    rank: int
    microbatch_id: int
    num_tokens: int
    prepare_start_s: float
    prepare_end_s: float
    execute_start_s: float
    execute_end_s: float


class WaveStats:
    """Running sums and recent windows of one scheduler's micro-batches; see the module docstring.

    Stored: counters (``num_microbatches``, ``num_spans``), per-rank
    busy seconds, the execution window, and two rings, oldest first: ``spans`` (arrival order)
    and ``microbatch_tokens`` (publish order), each at most ``window`` long.

    Args:
        spans: spans to record at once (tests, snapshots).
        microbatch_tokens: micro-batch sizes to record at once, tokens.
        num_microbatches: micro-batches counted before (default: one per size given).
        window: the rings' length.
    """

    def __init__(
        self,
        spans: Iterable[StageSpan] = (),
        microbatch_tokens: Iterable[int] = (),
        num_microbatches: int | None = None,
        *,
        window: int = DEFAULT_WINDOW,
    ) -> None:
        if window < 1:
            raise ValueError(f"window={window}: must be >= 1 entry")
        self.window = window
        self.reset()
        for span in spans:
            self.record_span(span)
        for num_tokens in microbatch_tokens:
            self.record_microbatch(num_tokens)
        if num_microbatches is not None:
            self.num_microbatches = num_microbatches

    def reset(self) -> None:
        """Start a new measured window in place (readers holding this object see the new run)."""
        self.num_microbatches = 0
        self.num_spans = 0
        self.spans: deque[StageSpan] = deque(maxlen=self.window)
        self.microbatch_tokens: deque[int] = deque(maxlen=self.window)
        # NOTE: the scheduler's own host time per micro-batch (after the planning set is
        # gathered until the plan is handed to the bus), seconds; deliberate sleeps excluded.
        self.host_s: deque[float] = deque(maxlen=self.window)
        # NOTE: speculative planning (scheduling/speculation.py): plans published from a
        # speculation; speculations dropped (a reply differed from its prediction, a request
        # refused or failed, the planning set changed).
        self.num_speculative_plans = 0
        self.num_speculations_discarded = 0
        self._busy_s: dict[int, float] = {}
        self._busy_total_s = 0.0
        self._first_start_s = float("inf")
        self._last_end_s = float("-inf")

    def snapshot(self) -> WaveStats:
        """An independent copy (a report keeps it; the live object goes on counting)."""
        return copy.deepcopy(self)

    # ---- recording -----------------------------------------------------------------------

    def record_microbatch(self, num_tokens: int) -> None:
        """One published micro-batch of ``num_tokens`` new tokens."""
        self.num_microbatches += 1
        self.microbatch_tokens.append(num_tokens)

    def record_host_time(self, seconds: float) -> None:
        """The scheduler's host time for one published micro-batch (see ``host_s``)."""
        self.host_s.append(seconds)

    def record_span(self, span: StageSpan) -> None:
        """One stage's report of one micro-batch (each (micro-batch, stage) once)."""
        busy_s = span.execute_end_s - span.execute_start_s
        self.num_spans += 1
        self._busy_s[span.rank] = self._busy_s.get(span.rank, 0.0) + busy_s
        self._busy_total_s += busy_s
        self._first_start_s = min(self._first_start_s, span.execute_start_s)
        self._last_end_s = max(self._last_end_s, span.execute_end_s)
        self.spans.append(span)

    # ---- figures -------------------------------------------------------------------------

    def execution_window(self) -> tuple[float, float] | None:
        """(first execute start, last execute end) over every span recorded, or None."""
        if not self.num_spans:
            return None
        return self._first_start_s, self._last_end_s

    def wave_fill(self, num_stages: int) -> float:
        """Busy time of all stages / (S x wall time) over the execution window (docs/design.md, "wave fill")."""
        window = self.execution_window()
        if window is None:
            return 0.0
        start, end = window
        return self._busy_total_s / (num_stages * (end - start)) if end > start else 0.0

    def busy_s_by_stage(self, num_stages: int) -> list[float]:
        """Seconds each stage executed, ranks 0..S-1."""
        return [self._busy_s.get(rank, 0.0) for rank in range(num_stages)]
