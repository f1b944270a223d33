"""``serving.cancels.CancelMemory``: which intake messages count as cancelled, and for how long."""

from __future__ import annotations

import pytest

from wavepp.api.prefill import IntakeCancel, IntakeRequest
from wavepp.runtime.serving.cancels import CancelMemory


def _request(key: str, arrival_s: float) -> IntakeRequest:
    tenant, _, request_id = key.partition(".")
    return IntakeRequest(
        key=key, request_id=request_id, tenant=tenant, cache_salt="", token_ids=[1],
        arrival_s=arrival_s,
    )  # fmt: skip


def test_a_cancel_names_one_message_by_key_and_arrival() -> None:
    memory = CancelMemory()
    memory.add(IntakeCancel(key="t.a", arrival_s=5.0), now_s=0.0)
    assert _request("t.a", 5.0) in memory
    assert _request("t.a", 6.0) not in memory  # a client retry: a new arrival, served
    assert _request("t.b", 5.0) not in memory
    # a later cancel of the same key replaces the earlier one
    memory.add(IntakeCancel(key="t.a", arrival_s=6.0), now_s=1.0)
    assert _request("t.a", 6.0) in memory and _request("t.a", 5.0) not in memory
    assert len(memory) == 1
    memory.discard("t.a")  # a retry of it is served
    memory.discard("t.zz")  # none: nothing happens
    assert _request("t.a", 6.0) not in memory and len(memory) == 0


def test_entries_expire_after_memory_s_and_past_the_cap_oldest_first() -> None:
    memory = CancelMemory(memory_s=10.0, max_entries=2)
    memory.add(IntakeCancel(key="t.a", arrival_s=1.0), now_s=0.0)
    memory.add(IntakeCancel(key="t.b", arrival_s=1.0), now_s=1.0)
    memory.add(IntakeCancel(key="t.c", arrival_s=1.0), now_s=2.0)  # past the cap: a goes
    assert [k for k in "abc" if _request(f"t.{k}", 1.0) in memory] == ["b", "c"]
    memory.add(IntakeCancel(key="t.d", arrival_s=1.0), now_s=11.5)  # b is 10.5 s old: gone
    assert [k for k in "bcd" if _request(f"t.{k}", 1.0) in memory] == ["c", "d"]


@pytest.mark.parametrize(("kw", "field"), [({"memory_s": 0.0}, "memory_s"),
                                           ({"max_entries": 0}, "max_entries")])  # fmt: skip
def test_bad_bounds_are_refused_naming_the_field(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        CancelMemory(**kw)
