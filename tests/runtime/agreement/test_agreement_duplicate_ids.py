"""One agreement per request id at a time: a second agreement of an id that is agreeing or
admitted on the controller is refused before it reaches a stage.

Otherwise two agreements of one id in one round with different prompt lengths would admit the
first and have the stages answer the second INVALID ("already reserved with
num_total_blocks=..."), and the round's release of the second would free the first's reservation
on every stage: an admitted ticket holding nothing, whose plan fails on every stage with every
other request of its micro-batch. And a second agreement of an admitted id (same length) would
be admitted again on the same reservation: two tickets, one release freeing both.
"""

from __future__ import annotations

import asyncio

import pytest
from agreement_support import local_stages

from wavepp.runtime.agreement import AgreementController
from wavepp.runtime.agreement.coordinator import AgreementRefused
from wavepp.runtime.kv import StageKVManager
from wavepp.runtime.request import PromptRequest

BLOCK = 4


def _controller() -> tuple[AgreementController, list[StageKVManager]]:
    managers, controller = local_stages([64, 64], block_size=BLOCK, model_id="dup")
    return controller, managers


async def test_a_second_agreement_of_an_agreeing_id_in_the_same_round_is_refused() -> None:
    controller, managers = _controller()
    first, second = await asyncio.gather(
        controller.agree(PromptRequest("dup", list(range(12)))),
        controller.agree(PromptRequest("dup", list(range(20)))),
        return_exceptions=True,
    )
    assert first is not None and not isinstance(first, BaseException)
    assert isinstance(second, AgreementRefused)
    assert "request_id" in str(second) and "dup" in str(second)
    # the admitted one still holds its whole reservation on every stage
    for manager in managers:
        assert manager.request_ids() == ["dup"]
        assert len(manager.block_table("dup")) == 3
    assert controller.live_request_ids == frozenset({"dup"})


async def test_a_second_agreement_of_an_admitted_id_is_refused_until_released() -> None:
    controller, managers = _controller()
    assert await controller.agree(PromptRequest("dup", list(range(12)))) is not None
    with pytest.raises(AgreementRefused, match="request_id"):
        await controller.agree(PromptRequest("dup", list(range(12))))
    for manager in managers:
        assert manager.request_ids() == ["dup"]
    await controller.release(["dup"])
    assert all(not m.request_ids() for m in managers)
    # released: the id may be agreed again
    assert await controller.agree(PromptRequest("dup", list(range(20)))) is not None
    for manager in managers:
        assert len(manager.block_table("dup")) == 5


async def test_an_id_whose_agreement_failed_may_be_agreed_again() -> None:
    controller, managers = _controller()
    with pytest.raises(AgreementRefused):
        await controller.agree(PromptRequest("empty", []))
    assert await controller.agree(PromptRequest("empty", [1, 2, 3])) is not None
