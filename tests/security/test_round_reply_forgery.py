"""A batched agreement round's replies are tagged: the stages of a replica answer one fan-out on
one reply subject, which anyone who hears the round learns, so without NATS auth (``wavepp up
--insecure-nats`` keeps the bus key) a client could answer first for every rank with a forged
hit. With the bus key a stage tags its reply for the batch (owner, seq) and its rank
(``kv_reply_tag.tag_reply``); the controller drops any other reply and waits for the stage's
own."""

from __future__ import annotations

import asyncio
import logging

import pytest
from kv_wire_support import chain, warm

from wavepp.api.kv_batch import (
    BatchOp,
    KVBatch,
    KVWireError,
    ReserveEntry,
    decode_batch,
    encode_batch,
)
from wavepp.api.kv_reply import (
    EntryResult,
    EntryStatus,
    KVBatchReply,
    decode_reply,
    encode_reply,
    reply_rank,
)
from wavepp.api.messages import PROTOCOL_VERSION
from wavepp.api.signing import BusKey
from wavepp.runtime.agreement import AgreementController
from wavepp.runtime.agreement.clients import StageUnavailableError
from wavepp.runtime.agreement.nats_client import NatsStageClient, serve_stage_kv
from wavepp.runtime.agreement.stage_handler import handle_kv_batch
from wavepp.runtime.kv import BlockPool, StageKVManager
from wavepp.runtime.request import PromptRequest
from wavepp.runtime.transport.natsio import connect, flush_in_order

BLOCK = 4
MODEL_ID = "reply-tags"
PREFIX = "wavepp.default.p0"
FORGED_HIT = 5


def _chain(n: int) -> tuple[bytes, ...]:
    return chain(n, root=0)


# --------------------------------------------------------------------------- the tag


def test_a_tagged_reply_verifies_only_for_its_batch_rank_and_body() -> None:
    from wavepp.api import kv_reply_tag

    key = BusKey.generate().for_replica("p0")
    reply = KVBatchReply(
        BatchOp.PROBE_RESERVE,
        2,
        10,
        64,
        (EntryResult(EntryStatus.OK, 3), EntryResult(EntryStatus.REFUSED, 0, "no room")),
    )
    plain = encode_reply(reply)
    prefix = kv_reply_tag.reply_tag_prefix("adm", 7)
    tagged = kv_reply_tag.tag_reply(plain, key, prefix)
    assert plain[3] == tagged[3] == PROTOCOL_VERSION  # one reply version, tagged or not
    assert plain[-32:] == bytes(32) and len(tagged) == len(plain)  # untagged: a zero tag
    assert decode_reply(tagged) == reply  # the controller decodes it as before
    assert reply_rank(tagged) == 2
    assert kv_reply_tag.verify_reply(tagged, key, prefix, 2)

    refused = {
        "another rank": kv_reply_tag.verify_reply(tagged, key, prefix, 1),
        "another seq": kv_reply_tag.verify_reply(
            tagged, key, kv_reply_tag.reply_tag_prefix("adm", 8), 2
        ),
        "another owner": kv_reply_tag.verify_reply(
            tagged, key, kv_reply_tag.reply_tag_prefix("adn", 7), 2
        ),
        "another replica's key": kv_reply_tag.verify_reply(
            tagged, BusKey.generate().for_replica("p0"), prefix, 2
        ),
        "untagged": kv_reply_tag.verify_reply(plain, key, prefix, 2),
        "tag cut short": kv_reply_tag.verify_reply(tagged[:-1], key, prefix, 2),
        "empty": kv_reply_tag.verify_reply(b"", key, prefix, 2),
    }
    assert not any(refused.values()), refused
    for at in range(len(tagged)):  # any byte changed, the tag's own included
        tampered = bytearray(tagged)
        tampered[at] ^= 0x01
        assert not kv_reply_tag.verify_reply(bytes(tampered), key, prefix, 2), at
    with pytest.raises(KVWireError, match="tag"):
        decode_reply(tagged[: 17 + 4 + 16])  # header and count, no room for the tag


def test_the_controller_reads_the_tag_prefix_from_its_own_batch() -> None:
    from wavepp.api import kv_reply_tag

    key = BusKey.generate()
    batch = KVBatch(BatchOp.RELEASE, ("a", "b"), owner="0123456789abcdef", seq=2**40 + 3)
    for signer in (key, None):
        assert kv_reply_tag.batch_reply_tag_prefix(
            encode_batch(batch, signer)
        ) == kv_reply_tag.reply_tag_prefix("0123456789abcdef", 2**40 + 3)
    for short in (b"", b"WKB", encode_batch(batch)[:20]):
        assert kv_reply_tag.batch_reply_tag_prefix(short) is None


def test_a_keyed_stage_tags_its_reply_to_a_signed_batch_only() -> None:
    from wavepp.api import kv_reply_tag

    key = BusKey.generate().for_replica("p0")
    manager = StageKVManager(BlockPool(64, BLOCK), max_lease_s=30.0)
    batch = KVBatch(
        BatchOp.PROBE_RESERVE, (ReserveEntry("r", _chain(3), 4),), 5.0, owner="adm", seq=1
    )
    prefix = kv_reply_tag.reply_tag_prefix("adm", 1)
    signed = encode_batch(batch, key)
    reply = handle_kv_batch(manager, 3, signed, bus_key=key)
    assert kv_reply_tag.verify_reply(reply, key, prefix, 3)
    assert decode_reply(reply).results == (EntryResult(EntryStatus.OK, 0),)
    # the same batch again: refused as a repeat, and that answer is the stage's (tagged)
    repeat = handle_kv_batch(manager, 3, signed, bus_key=key)
    assert kv_reply_tag.verify_reply(repeat, key, prefix, 3)
    assert "repeated" in decode_reply(repeat).error
    # a batch it did not sign (a forger asking for a refusal to send later): not tagged
    forged = encode_batch(KVBatch(BatchOp.RELEASE, ("r",), owner="adm", seq=2), BusKey.generate())
    refusal = handle_kv_batch(manager, 3, forged, bus_key=key)
    assert refusal[-32:] == bytes(32) and "mac" in decode_reply(refusal).error
    assert not kv_reply_tag.verify_reply(refusal, key, kv_reply_tag.reply_tag_prefix("adm", 2), 3)
    # no key: untagged
    keyless = StageKVManager(BlockPool(64, BLOCK), max_lease_s=30.0)
    assert handle_kv_batch(keyless, 0, encode_batch(batch), bus_key=None)[-32:] == bytes(32)


# --------------------------------------------------------------------------- over NATS


class _Forger:
    """An anonymous client on ``subject`` (the fan-out ``{p}.stages.kvb``, or a stage's own
    ``.kvb``): answers every round first, for every rank, OK with ``FORGED_HIT`` per entry,
    untagged and with a made-up tag."""

    def __init__(self, num_stages: int, subject: str = f"{PREFIX}.stages.kvb") -> None:
        self.num_stages = num_stages
        self.subject = subject
        self.sent: dict[bytes, asyncio.Event] = {}
        self.num_rounds = 0

    def event(self, payload: bytes) -> asyncio.Event:
        return self.sent.setdefault(payload, asyncio.Event())

    async def start(self, url: str) -> None:
        self.nc = await connect(url, name="forger", anonymous_ok=True)
        await self.nc.subscribe(self.subject, cb=self._on_round)
        await flush_in_order(self.nc)

    async def _on_round(self, msg) -> None:  # noqa: ANN001
        batch = decode_batch(msg.data)  # the batch is signed, not secret
        results = tuple(EntryResult(EntryStatus.OK, FORGED_HIT) for _ in batch.entries)
        for rank in range(self.num_stages):
            plain = encode_reply(KVBatchReply(batch.op, rank, 64, 64, results))
            await self.nc.publish(msg.reply, plain)
            await self.nc.publish(msg.reply, plain[:-32] + bytes([1]) * 32)
        # at the server (routed to the controller) before any stage's: nats-py's one flush
        # would PING ahead of the PUBs still pending
        await flush_in_order(self.nc)
        self.num_rounds += 1
        self.event(msg.data).set()


async def _serve_after_forger(
    nc, manager: StageKVManager, rank: int, key: BusKey | None, forger: _Forger
) -> None:  # noqa: ANN001
    """A stage's real handler on the forger's subject that answers once the forger has: the
    forger always wins the race (what it did most times end to end)."""

    async def on_round(msg) -> None:  # noqa: ANN001
        await forger.event(msg.data).wait()
        await msg.respond(handle_kv_batch(manager, rank, msg.data, bus_key=key))

    await nc.subscribe(forger.subject, cb=on_round)


async def test_forged_first_replies_are_dropped_and_the_true_l_star_agreed(
    nats_server, caplog: pytest.LogCaptureFixture
) -> None:  # noqa: ANN001
    num_stages = 3
    key = BusKey.generate().for_replica("p0")
    managers = [StageKVManager(BlockPool(64, BLOCK), max_lease_s=30.0) for _ in range(num_stages)]
    forger = _Forger(num_stages)
    await forger.start(nats_server.url)
    stage_nc = await connect(nats_server.url, name="stages", anonymous_ok=True)
    for rank, manager in enumerate(managers):
        await _serve_after_forger(stage_nc, manager, rank, key, forger)
    await flush_in_order(stage_nc)
    adm = await connect(nats_server.url, name="admission", anonymous_ok=True)
    clients = NatsStageClient.for_replica(adm, PREFIX, num_stages, timeout_s=5.0)
    controller = AgreementController(
        clients, block_size=BLOCK, model_id=MODEL_ID, lease_s=30.0, bus_key=key
    )
    request = PromptRequest("victim", list(range(6 * BLOCK + 1)))
    hashes = controller.block_hashes(request)
    for manager, num_cached in zip(managers, (4, 2, 6), strict=True):
        warm(manager, hashes[:num_cached])
    try:
        with caplog.at_level(logging.WARNING, logger="wavepp.runtime.agreement.nats_client"):
            ticket = await controller.agree(request)
        assert forger.num_rounds == 1
        assert ticket is not None
        assert ticket.num_agreed_blocks == 2  # min of the stages' real hits, not FORGED_HIT
        assert [m.num_hit_blocks("victim") for m in managers] == [4, 2, 6]
        mux = clients[0].batch_mux
        assert mux.num_dropped_replies == 2 * num_stages  # two forgeries per rank
        warnings = [r for r in caplog.records if "did not verify" in r.getMessage()]
        assert len(warnings) == 1  # once per round
        await controller.release(["victim"])  # its round is forged too: the stages still free
        assert forger.num_rounds == 2
        assert mux.num_dropped_replies == 4 * num_stages
        assert all(m.num_requests == 0 and m.pool.num_pinned_blocks == 0 for m in managers)
    finally:
        for client in (adm, stage_nc, forger.nc):
            await client.close()


async def test_a_keyed_controller_names_a_stage_whose_replies_are_untagged(nats_server) -> None:  # noqa: ANN001
    """A stage of an earlier release (or without the key) answers untagged: the round fails at
    its time-out naming that stage and the replies dropped for it, not at once on a forgery."""
    key = BusKey.generate().for_replica("p0")
    nc = await connect(nats_server.url, name="stages-and-admission", anonymous_ok=True)
    try:
        await serve_stage_kv(nc, PREFIX, 0, StageKVManager(BlockPool(64, BLOCK)), bus_key=key)
        await serve_stage_kv(nc, PREFIX, 1, StageKVManager(BlockPool(64, BLOCK)), bus_key=None)
        await flush_in_order(nc)
        clients = NatsStageClient.for_replica(nc, PREFIX, 2, timeout_s=0.5, liveness_check_s=5.0)
        batch = KVBatch(
            BatchOp.PROBE_RESERVE, (ReserveEntry("r", _chain(2), 3),), 5.0, owner="adm", seq=1
        )
        with pytest.raises(StageUnavailableError, match=r"stage 1: no reply .* \(1 dropped: tag"):
            await NatsStageClient.call_batch_all(clients, encode_batch(batch, key), reply_key=key)
        # without a key nothing is checked: both answer (the keyless stage, untagged)
        release = encode_batch(KVBatch(BatchOp.RELEASE, ("r",), owner="adm", seq=2), key)
        replies = await NatsStageClient.call_batch_all(clients, release)
        assert [decode_reply(r).rank for r in replies] == [0, 1]
        with pytest.raises(ValueError, match="not a KV batch"):
            await NatsStageClient.call_batch_all(clients, b"x", reply_key=key)
    finally:
        await nc.close()


async def test_a_forged_reply_on_a_stage_s_own_subject_is_dropped(nats_server) -> None:  # noqa: ANN001
    """A call to one stage (``call_batch``, replies on ``{inbox}.{call}.{index}``) is checked the
    same way: the forger on ``{p}.stage.1.kvb`` answers first and is dropped."""
    key = BusKey.generate().for_replica("p0")
    forger = _Forger(2, subject=f"{PREFIX}.stage.1.kvb")
    await forger.start(nats_server.url)
    nc = await connect(nats_server.url, name="stage-and-admission", anonymous_ok=True)
    try:
        manager = StageKVManager(BlockPool(64, BLOCK), max_lease_s=30.0)
        warm(manager, _chain(2))
        await _serve_after_forger(nc, manager, 1, key, forger)
        await flush_in_order(nc)
        client = NatsStageClient(nc, PREFIX, 1, timeout_s=5.0)
        batch = KVBatch(
            BatchOp.PROBE_RESERVE, (ReserveEntry("r", _chain(4), 5),), 5.0, owner="adm", seq=1
        )
        reply = decode_reply(await client.call_batch(encode_batch(batch, key), reply_key=key))
        assert forger.num_rounds == 1
        assert (reply.rank, reply.results) == (1, (EntryResult(EntryStatus.OK, 2),))
        assert client.batch_mux.num_dropped_replies == 4  # 2 forgeries x 2 ranks (one of them 0)
    finally:
        await nc.close()
        await forger.nc.close()
