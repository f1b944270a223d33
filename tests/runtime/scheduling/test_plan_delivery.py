"""Gap-free plan delivery (PlanSequencer on the stage side, PlanLedger on the scheduler side)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from wavepp.runtime.scheduling.ledger import PlanLedger, Report
from wavepp.runtime.stage.sequencing import PlanSequencer


@st.composite
def lossy_arrivals(draw: st.DrawFn) -> tuple[int, list[int]]:
    """N plans; each arrives 0, 1 or 2 times, in a shuffled order."""
    n = draw(st.integers(1, 40))
    copies = draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
    arrivals = [i for i in range(n) for _ in range(copies[i])]
    return n, draw(st.permutations(arrivals))


@given(lossy_arrivals())
def test_every_plan_once_in_order_after_a_resend(case: tuple[int, list[int]]) -> None:
    n, arrivals = case
    seq: PlanSequencer[int] = PlanSequencer()
    out: list[int] = []
    for i in arrivals:
        out += seq.offer("e", i, i)
        assert out == list(range(len(out))), "never out of order, never twice"
        gap = seq.gap()
        if gap is not None:
            assert gap[0] == seq.next_id < gap[1]
    # The scheduler still holds every plan (nothing expired): an open resend fills every hole;
    # a stage that never heard of the epoch gets the scheduler's republished plans instead.
    if seq.epoch:
        out += seq.settle("e", n, [(i, i) for i in range(seq.next_id, n)])
    else:
        for i in range(n):
            out += seq.offer("e", i, i)
    assert out == list(range(n))
    assert seq.gap() is None and seq.num_held == 0 and seq.num_skipped == 0


@given(lossy_arrivals(), st.sets(st.integers(0, 39)))
def test_expired_plans_are_skipped_and_the_rest_run_in_order(
    case: tuple[int, list[int]], expired: set[int]
) -> None:
    n, arrivals = case
    seq: PlanSequencer[int] = PlanSequencer()
    out: list[int] = []
    for i in arrivals:
        out += seq.offer("e", i, i)
    if not arrivals:
        return  # the stage never heard of the epoch: nothing to settle
    resent = [(i, i) for i in range(n) if i not in expired]
    out += seq.settle("e", n, resent)
    expected = sorted((set(range(n)) - expired) | set(arrivals))
    assert out == expected
    gone_after_first = [i for i in range(n) if i not in expected and expected and i > expected[0]]
    assert seq.num_skipped == len(gone_after_first)


def test_a_hole_holds_later_plans_until_the_resend() -> None:
    seq: PlanSequencer[str] = PlanSequencer()
    assert seq.offer("e", 0, "p0") == ["p0"]
    assert seq.offer("e", 2, "p2") == [] and seq.offer("e", 3, "p3") == []
    assert seq.gap() == (1, 2)
    assert seq.offer("e", 2, "p2 again") == [] and seq.num_duplicates == 1
    assert seq.settle("e", 2, [(1, "p1")]) == ["p1", "p2", "p3"]
    assert seq.offer("e", 1, "late p1") == [] and seq.num_duplicates == 2


def test_a_new_epoch_starts_over_and_asks_for_what_came_before_its_first_plan() -> None:
    seq: PlanSequencer[str] = PlanSequencer()
    seq.offer("old", 0, "a")
    assert seq.offer("new", 1_000, "b") == []
    assert seq.gap() == (0, 1_000)
    # Nothing of the new epoch came before 1000: the resend settles the gap without a skip.
    assert seq.settle("new", 1_000, []) == ["b"]
    assert seq.num_skipped == 0
    assert seq.settle("old", 5, [(1_001, "x")]) == [], "a reply for another epoch is ignored"


def test_flush_held_runs_what_a_dead_epoch_left() -> None:
    seq: PlanSequencer[str] = PlanSequencer()
    seq.offer("e", 0, "a")
    seq.offer("e", 3, "d")
    seq.offer("e", 2, "c")
    assert seq.flush_held() == ["c", "d"] and seq.next_id == 4 and seq.num_skipped == 1


def test_negative_id_is_refused() -> None:
    with pytest.raises(ValueError, match="microbatch_id"):
        PlanSequencer().offer("e", -1, "x")


def test_ledger_counts_each_stage_once_and_forgets_complete_plans() -> None:
    ledger: PlanLedger[str] = PlanLedger(3)
    ledger.published(10, "p10", ["a", "b"])
    ledger.published(11, "p11", ["b"])
    assert ledger.report(10, 0) is Report.FIRST
    assert ledger.report(10, 0) is Report.DUPLICATE
    assert ledger.report(10, 1) is Report.FIRST
    assert ledger.owners(10) == ["a", "b"]
    assert ledger.report(10, 2) is Report.LAST
    assert ledger.report(10, 2) is Report.UNKNOWN and 10 not in ledger
    assert ledger.resend(0) == [(11, "p11")]
    with pytest.raises(ValueError, match="rank"):
        ledger.report(11, 3)
    with pytest.raises(ValueError, match="must exceed"):
        ledger.published(11, "again", [])


def test_ledger_finds_done_messages_lost_before_a_later_one() -> None:
    ledger: PlanLedger[int] = PlanLedger(2)
    for mb in range(5):
        ledger.published(mb, mb, ["r"])
    ledger.report(0, 1)
    # rank 1 reports 3 next: its reports of 1 and 2 were lost on the way.
    ledger.report(3, 1)
    assert ledger.missing_before(1, 3) == [1, 2]
    assert ledger.unreported(1) == [1, 2, 4]
    assert ledger.resend(1, 3) == [(1, 1), (2, 2)]
    ledger.drop(2)
    assert ledger.report(2, 0) is Report.UNKNOWN
    assert ledger.clear() == [0, 1, 3, 4] and len(ledger) == 0
