"""``SchedulerCore.withdraw``: a request its caller gave up on stops being served.

Over the pure cores (``forgery_support.MiniPipeline``: agreement controller, scheduler core and
two stage cores, stepped by hand): a queued request leaves at once; an admitted request with
chunks left gets no further chunk planned, its micro-batch in flight runs to its end and its
pins are released on every stage when the last stage reports it, once; the other request of
that micro-batch is answered as usual; withdrawing an unknown, finished or fully planned id
does nothing; a re-form forgets a withdrawn request still live.
"""

from __future__ import annotations

import pytest
from forgery_support import MiniPipeline, admit_by_hand, first_token, prompt

from wavepp.runtime.request import PromptRequest
from wavepp.runtime.scheduling.core import WITHDRAWN_ERROR, ScheduledMicroBatch

LONG_TOKENS = 96  # six chunks of chunk_tokens=16


@pytest.fixture
def pipe():  # noqa: ANN201
    pipe = MiniPipeline(None)
    yield pipe
    pipe.close()


def _plan(pipe: MiniPipeline) -> ScheduledMicroBatch | None:
    """Plan one micro-batch and run it on every stage; its dones wait in ``pending_dones``."""
    scheduled = pipe.core.schedule(more_work_queued=False, planning_started_s=0.0)
    if scheduled is None:
        return None
    plan, _ = pipe.core.encoded_plan_of(scheduled)
    for rank in range(pipe.num_stages):
        pipe.deliver_plan(rank, plan)
    return scheduled


def _report(pipe: MiniPipeline) -> list[str]:
    """Deliver the pending dones (releasing what they name); the ids released."""
    released: list[str] = []
    dones, pipe.pending_dones = pipe.pending_dones, []
    for done in dones:
        update = pipe.core.update_from_done(done)
        released.extend(update.to_release)
        if update.to_release:
            pipe.loop.run_until_complete(pipe.controller.release(update.to_release))
            pipe.core.released(update.to_release)
    pipe._collect()
    return released


def _held_on_stages(pipe: MiniPipeline, request_id: str) -> list[bool]:
    return [request_id in stage.manager.request_ids() for stage in pipe.stages]


def test_a_queued_request_is_answered_at_once_and_never_admitted(pipe: MiniPipeline) -> None:
    core = pipe.core
    record = core.add_request(PromptRequest("q", prompt(1, 32)), waiter=None)
    assert core.num_open == 1
    assert core.withdraw("q")
    assert core.num_open == 0 and core.num_withdrawn == 1
    assert record.status.is_finished
    [finished] = core.take_finished()
    assert finished is record and finished.outcome is not None
    assert finished.outcome.error == WITHDRAWN_ERROR
    assert not core.withdraw("q")  # answered already: nothing more
    assert core.take_finished() == [] and core.take_releasable() == []
    # a strategy that took it from its queue meanwhile finds it finished; admitted nowhere
    core.activate([record])
    assert core.active == [] and not core.is_live("q")


def test_an_admitted_request_gets_no_more_chunks_and_is_released_after_its_microbatch(
    pipe: MiniPipeline,
) -> None:
    core = pipe.core
    short = admit_by_hand(pipe, "short", 1, 8)
    long = admit_by_hand(pipe, "long", 2, LONG_TOKENS)
    scheduled = _plan(pipe)
    assert scheduled is not None
    assert {c.request_id for c in scheduled.chunks} == {"short", "long"}
    assert not any(c.is_last for c in scheduled.chunks if c.request_id == "long")
    assert long.num_inflight_microbatches == 1

    assert core.withdraw("long")
    [withdrawn] = [r for r in core.take_finished() if r.request_id == "long"]
    assert withdrawn.outcome is not None and withdrawn.outcome.error == WITHDRAWN_ERROR
    assert core.take_releasable() == []  # a micro-batch of it is in flight: not yet
    assert core.is_live("long") and _held_on_stages(pipe, "long") == [True, True]
    assert _plan(pipe) is None  # nothing left to plan: no further chunk of it

    released = _report(pipe)  # its micro-batch ends: released with the short one, once
    assert sorted(released) == ["long", "short"]
    assert _held_on_stages(pipe, "long") == [False, False]
    assert not core.is_live("long") and not core.withdraw("long")
    assert pipe.answers["short"] == (first_token("short"), "")  # its neighbour: unaffected
    assert "long" not in pipe.answers  # answered once, at the withdrawal (taken above)
    assert short.status.is_finished and core.num_open == 0
    for stage in pipe.stages:
        assert stage.manager.request_ids() == []


def test_a_withdrawn_request_with_nothing_in_flight_is_handed_over_for_release_once(
    pipe: MiniPipeline,
) -> None:
    """Withdrawn between its micro-batches: of its 96 tokens only the first micro-batch's
    were ever planned, and it leaves ``live`` at once for the driver to release."""
    core = pipe.core
    admit_by_hand(pipe, "short", 1, 8)
    long = admit_by_hand(pipe, "long", 2, LONG_TOKENS)
    scheduled = _plan(pipe)
    assert scheduled is not None
    planned = sum(c.num_tokens for c in scheduled.chunks if c.request_id == "long")
    assert 0 < planned < LONG_TOKENS
    assert _report(pipe) == ["short"]  # the long one has chunks left: still live
    assert long.num_inflight_microbatches == 0 and core.is_live("long")

    assert core.withdraw("long")
    assert not core.is_live("long") and _plan(pipe) is None
    assert core.take_releasable() == ["long"] and core.take_releasable() == []
    assert _held_on_stages(pipe, "long") == [True, True]  # until the driver releases it
    pipe.loop.run_until_complete(pipe.controller.release(["long"]))
    core.released(["long"])
    assert _held_on_stages(pipe, "long") == [False, False]
    assert core.num_withdrawn == 1 and core.num_open == 0


def test_unknown_finished_and_fully_planned_ids_are_not_withdrawn(pipe: MiniPipeline) -> None:
    core = pipe.core
    assert not core.withdraw("nobody")
    whole = admit_by_hand(pipe, "whole", 3, 12)  # one chunk: planned whole in the first micro-batch
    scheduled = _plan(pipe)
    assert scheduled is not None and [c.is_last for c in scheduled.chunks] == [True]
    assert not core.withdraw("whole")  # its last chunk is on the stages: it ends as usual
    assert _report(pipe) == ["whole"]
    assert pipe.answers["whole"] == (first_token("whole"), "")
    assert not core.withdraw("whole") and whole.outcome is not None and not whole.outcome.error
    assert core.num_withdrawn == 0 and core.take_releasable() == []


def test_a_reform_forgets_a_withdrawn_request_with_a_microbatch_in_flight(
    pipe: MiniPipeline,
) -> None:
    core = pipe.core
    admit_by_hand(pipe, "short", 1, 8)
    admit_by_hand(pipe, "long", 2, LONG_TOKENS)
    assert _plan(pipe) is not None
    assert core.withdraw("long")
    readmitted = core.reform([])
    assert [r.request_id for r in readmitted] == ["short"]  # the long one: answered already
    assert not core.is_live("long") and core.live == {}
