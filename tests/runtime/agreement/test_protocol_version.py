"""One protocol version on the wire: a stage of another version is refused at start, in one
line naming both versions, before any round; a batch or reply of another version does not
decode."""

from __future__ import annotations

import logging

import pytest

from wavepp.api.kv_batch import BatchOp, KVBatch, KVWireError, ReserveEntry, decode_batch
from wavepp.api.kv_batch import encode_batch as encode
from wavepp.api.kv_reply import KVBatchReply, decode_reply, encode_reply
from wavepp.api.messages import PROTOCOL_VERSION, KVReply, KVRequestMessage
from wavepp.api.subjects import ReplicaSubjects
from wavepp.runtime.agreement import AgreementController, LocalStageClient, StageVersionError
from wavepp.runtime.agreement.nats_client import serve_stage_kv
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.kv import BlockPool, StageKVManager
from wavepp.runtime.planning import CostModel
from wavepp.runtime.request import PromptRequest
from wavepp.runtime.serving.service import AdmissionService
from wavepp.runtime.transport.natsio import flush_in_order

OTHER = PROTOCOL_VERSION + 1


class _OtherBuild(LocalStageClient):
    """A stage of another build: its health reply names version ``OTHER``; counts the rounds
    it was sent."""

    num_batches = 0

    async def call(self, msg: KVRequestMessage) -> KVReply:
        reply = await super().call(msg)
        return KVReply.model_validate({**reply.model_dump(), "v": OTHER})

    async def call_batch(self, payload: bytes) -> bytes:
        self.num_batches += 1
        return await super().call_batch(payload)


def _refusal_line(text: str) -> None:
    """The refusal is one line naming the stage and both versions."""
    assert "\n" not in text
    assert f"version {OTHER}" in text and f"version {PROTOCOL_VERSION}" in text
    assert "stage 1" in text


async def test_a_stage_of_another_version_is_refused_by_the_health_probe_before_any_round() -> None:
    managers = [StageKVManager(BlockPool(16, 4)) for _ in range(2)]
    other = _OtherBuild(managers[1], 1)
    controller = AgreementController(
        [LocalStageClient(managers[0], 0), other], block_size=4, model_id="m"
    )
    with pytest.raises(StageVersionError) as refused:
        await controller.health()
    _refusal_line(str(refused.value))
    assert other.num_batches == 0 and not any(m.num_requests for m in managers)
    # stages of this build pass
    same = AgreementController(
        [LocalStageClient(m, r) for r, m in enumerate(managers)], block_size=4, model_id="m"
    )
    assert all(reply.v == PROTOCOL_VERSION for reply in await same.health())
    assert await same.agree(PromptRequest("r", list(range(9)))) is not None


async def test_the_admission_refuses_at_start_with_one_line_and_sends_no_round(
    nc,  # noqa: ANN001
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Over a real nats-server: stage 0 of this build (``serve_stage_kv``), stage 1 of another
    (its health reply names version ``OTHER``). ``wait_formed`` fails at once, long before its
    start-up deadline, with one error line naming both versions; stage 1 sees no round."""
    config = RuntimeConfig(pipeline="vcheck", num_stages=2, block_size=4, num_kv_blocks=[16])
    subjects = ReplicaSubjects(config.subject_prefix)
    await serve_stage_kv(nc, config.subject_prefix, 0, StageKVManager(BlockPool(16, 4)))
    rounds: list[bytes] = []

    async def other_health(msg) -> None:  # noqa: ANN001
        await msg.respond(b'{"v": %d, "rank": 1, "ok": true}' % OTHER)

    async def other_round(msg) -> None:  # noqa: ANN001
        rounds.append(msg.data)

    await nc.subscribe(subjects.stage_kv(1), cb=other_health)
    await nc.subscribe(subjects.stage_kv_batch(1), cb=other_round)
    await flush_in_order(nc)
    cost = CostModel(c=1e-3, g=1e-7, b=1e-4, a=0.0, label="derived", source="version test")
    service = AdmissionService(config, nc, cost, pool="p", startup_timeout_s=60.0)
    caplog.set_level(logging.ERROR, logger="wavepp.runtime.serving.service")
    with pytest.raises(StageVersionError) as refused:
        await service.wait_formed()
    _refusal_line(str(refused.value))
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1
    _refusal_line(errors[0])
    assert not rounds and service.controller.num_rounds == 0


def test_a_batch_or_a_reply_of_another_version_does_not_decode() -> None:
    batch = encode(KVBatch(BatchOp.PROBE_RESERVE, (ReserveEntry("r", (b"h" * 32,), 2),), 5.0))
    assert decode_batch(batch).entries[0].request_id == "r"
    other = batch[:3] + bytes([OTHER]) + batch[4:]
    with pytest.raises(KVWireError, match=f"version: {OTHER}; .*version {PROTOCOL_VERSION}"):
        decode_batch(other)
    reply = encode_reply(KVBatchReply(BatchOp.PROBE_RESERVE, 0, 1, 2))
    assert decode_reply(reply).rank == 0
    with pytest.raises(KVWireError, match=f"version: {OTHER}; .*version {PROTOCOL_VERSION}"):
        decode_reply(reply[:3] + bytes([OTHER]) + reply[4:])


def test_json_messages_follow_the_protocol_version(monkeypatch: pytest.MonkeyPatch) -> None:
    """``v`` of every JSON message is ``PROTOCOL_VERSION`` as it stands, not a copy of its
    number: after a version change a build's own messages still decode, and the old version's
    are refused; ``KVReply`` (a health answer) decodes any version so it can be named."""
    from wavepp.api import messages

    monkeypatch.setattr(messages, "PROTOCOL_VERSION", PROTOCOL_VERSION + 1)
    renew = messages.Renew(request_ids=["r"], lease_s=5)
    assert renew.v == PROTOCOL_VERSION + 1
    assert messages.Renew.model_validate_json(renew.model_dump_json()) == renew
    with pytest.raises(ValueError, match="v"):
        messages.Renew.model_validate({"v": PROTOCOL_VERSION, "request_ids": ["r"], "lease_s": 5})
    assert KVReply.model_validate({"v": PROTOCOL_VERSION, "rank": 0}).v == PROTOCOL_VERSION


async def test_local_pipeline_refuses_a_stage_of_another_version() -> None:
    """``LocalPipeline.wait_formed`` (``wavepp replay``, ``bench grid``) refuses a stage whose
    health reply names another protocol version, as the admission service does."""
    from types import SimpleNamespace

    from wavepp.runtime.serving import local
    from wavepp.runtime.serving.local import LocalPipeline

    async def answer(_message: object) -> KVReply:
        return KVReply(ok=True, rank=0, v=PROTOCOL_VERSION + 1)

    pipeline = object.__new__(LocalPipeline)
    pipeline.controller = SimpleNamespace(stages=[SimpleNamespace(rank=0, call=answer)])
    pipeline._stage_names = [local._stage_name(0)]
    pipeline.supervisor = SimpleNamespace(
        procs={local._stage_name(0): SimpleNamespace(poll=lambda: None)}
    )
    pipeline.startup_timeout_s = 5.0
    with pytest.raises(
        StageVersionError, match=f"version {PROTOCOL_VERSION + 1}.*version {PROTOCOL_VERSION}"
    ):
        await pipeline.wait_formed()
