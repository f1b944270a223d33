"""``SchedulerCore.withdraw`` meeting the other ways a request ends, over the pure cores
(``forgery_support.MiniPipeline``, stepped by hand): a stage's error on the withdrawn request's
micro-batch in flight, that micro-batch's deadline, and a last stage that reports before a
middle stage (its neighbour's result held). In each the withdrawn request is answered once (at
its withdrawal), released once on every stage when its micro-batch ends, the other request of
the micro-batch ends as it would without the withdrawal, and the population (``num_open``)
counts each request out once.
"""

from __future__ import annotations

import pytest
from forgery_support import MiniPipeline, admit_by_hand, first_token

from wavepp.runtime.scheduling.core import WITHDRAWN_ERROR

LONG_TOKENS = 96  # six chunks of chunk_tokens=16


@pytest.fixture
def pipe():  # noqa: ANN201
    pipe = MiniPipeline(None)
    yield pipe
    pipe.close()


def _plan_with_long_in_flight(pipe: MiniPipeline) -> int:
    """``short`` (its one chunk) and ``long`` (a first chunk) in one micro-batch, run on every
    stage, its done messages pending; ``long`` then withdrawn. The micro-batch's id."""
    core = pipe.core
    admit_by_hand(pipe, "short", 1, 8)
    admit_by_hand(pipe, "long", 2, LONG_TOKENS)
    scheduled = core.schedule(more_work_queued=False, planning_started_s=0.0)
    assert scheduled is not None
    assert {c.request_id for c in scheduled.chunks} == {"short", "long"}
    plan, _ = core.encoded_plan_of(scheduled)
    for rank in range(pipe.num_stages):
        pipe.deliver_plan(rank, plan)
    assert core.withdraw("long")
    [withdrawn] = core.take_finished()
    assert withdrawn.request_id == "long" and withdrawn.outcome is not None
    assert withdrawn.outcome.error == WITHDRAWN_ERROR
    assert core.num_open == 1 and core.take_releasable() == []
    return scheduled.microbatch_id


def _release(pipe: MiniPipeline, request_ids: list[str], released: list[str]) -> None:
    released.extend(request_ids)
    if request_ids:
        pipe.loop.run_until_complete(pipe.controller.release(request_ids))
        pipe.core.released(request_ids)


def _held(pipe: MiniPipeline) -> list[list[str]]:
    return [stage.manager.request_ids() for stage in pipe.stages]


def test_a_stage_error_on_a_withdrawn_requests_microbatch(pipe: MiniPipeline) -> None:
    """Stage 0 reports an error: the short request fails with it; the withdrawn one is not
    answered again; both are released once, at the last stage's report."""
    core = pipe.core
    _plan_with_long_in_flight(pipe)
    first, last = pipe.pending_dones
    pipe.pending_dones = []
    released: list[str] = []
    update = core.update_from_done(first.model_copy(update={"error": "stage 0: out of memory"}))
    _release(pipe, update.to_release, released)
    assert released == [] and core.is_live("long")  # the last stage has not reported
    update = core.update_from_done(last)
    _release(pipe, update.to_release, released)
    assert sorted(released) == ["long", "short"]
    [failed] = core.take_finished()
    assert failed.request_id == "short" and failed.outcome is not None
    assert failed.outcome.error == "stage 0: out of memory"
    assert core.live == {} and core.num_open == 0 and core.num_withdrawn == 1
    assert _held(pipe) == [[], []]


def test_a_withdrawn_requests_microbatch_past_its_deadline(pipe: MiniPipeline) -> None:
    """The micro-batch expires: the short request fails by the deadline, the withdrawn one is
    not answered again; both are released once; the late done messages change nothing."""
    core = pipe.core
    microbatch_id = _plan_with_long_in_flight(pipe)
    pipe.clock.now_s += pipe.config.microbatch_deadline_s + 1.0
    assert core.overdue() == [microbatch_id]
    released: list[str] = []
    _release(pipe, core.expire(microbatch_id), released)
    assert sorted(released) == ["long", "short"]
    [failed] = core.take_finished()
    assert failed.request_id == "short" and failed.outcome is not None
    assert "microbatch_deadline_s" in failed.outcome.error
    for done in pipe.pending_dones:  # the stages report it after all: too late
        update = core.update_from_done(done)
        assert not update.counted and update.to_release == []
    assert core.take_finished() == [] and core.live == {} and core.num_open == 0
    assert _held(pipe) == [[], []]


def test_a_withdrawn_requests_neighbour_whose_result_waits_for_a_middle_stage(
    pipe: MiniPipeline,
) -> None:
    """The last stage reports first: the short request's result waits for stage 0's report;
    both are released at the last stage's report, once; stage 0's report answers the short
    request with its result and completes the ledger."""
    core = pipe.core
    microbatch_id = _plan_with_long_in_flight(pipe)
    first, last = pipe.pending_dones
    pipe.pending_dones = []
    released: list[str] = []
    update = core.update_from_done(last)
    assert update.held
    _release(pipe, update.to_release, released)
    assert sorted(released) == ["long", "short"]
    assert core.take_finished() == []  # the short one's result waits for stage 0
    update = core.update_from_done(first)
    _release(pipe, update.to_release, released)
    assert sorted(released) == ["long", "short"]  # nothing released twice
    [answered] = core.take_finished()
    assert answered.request_id == "short" and answered.outcome is not None
    assert (answered.outcome.first_token_id, answered.outcome.error) == (first_token("short"), "")
    assert microbatch_id not in core.ledger  # every stage reported it
    assert core.num_open == 0 and core.num_withdrawn == 1
    assert _held(pipe) == [[], []]


def test_a_withdrawn_request_leaves_the_closed_loop_population_once(pipe: MiniPipeline) -> None:
    """``num_open`` counts the withdrawn request out at its withdrawal; a second withdrawal and
    a re-form do not count it out again; its unplanned tokens leave the admission lookahead at
    once (its micro-batch still in flight)."""
    core = pipe.core
    _plan_with_long_in_flight(pipe)
    assert core.num_open == 1 and core.is_live("long")
    assert core.unplanned_tokens() == 0  # the short one is planned whole; the long one left
    assert not core.withdraw("long") and core.num_open == 1
    readmitted = core.reform([])
    assert [r.request_id for r in readmitted] == ["short"]
    assert core.num_open == 1 and not core.is_live("long")
