"""The stages' epoch rendezvous reads its bucket through one KV watch, over a real nats-server
with JetStream: a rank that waits finds a peer that arrives late, follows an epoch bump, notices
a peer whose beats stopped, keeps working across a server restart, and sends the server
(almost) nothing while it waits."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import pytest

from wavepp.api.subjects import rendezvous_bucket
from wavepp.runtime.stage.rendezvous import (
    BucketView,
    EpochRendezvous,
    PeerPresence,
    ViewClosed,
    open_rendezvous,
)
from wavepp.runtime.transport.natsio import EmbeddedNatsServer, connect, free_port

pytestmark = pytest.mark.timeout(60)


def _in_msgs(monitor_port: int) -> int:
    """Messages the server received from clients so far (``/varz`` ``in_msgs``)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{monitor_port}/varz", timeout=5) as r:
        return int(json.load(r)["in_msgs"])


async def _ranks(nc, num: int, *, rewatch_s: float) -> list[EpochRendezvous]:  # noqa: ANN001
    opened = [await open_rendezvous(nc, "p-r0", r, num, namespace="t") for r in range(num)]
    bucket = rendezvous_bucket("p-r0", namespace="t")
    return [
        EpochRendezvous(o.kv, o.rank, num, nc=nc, bucket=bucket, rewatch_s=rewatch_s)
        for o in opened
        if o is not None
    ]


async def test_a_waiting_rank_finds_a_late_peer_without_polling_the_server() -> None:
    monitor = free_port()
    with EmbeddedNatsServer(jetstream=True, monitor_port=monitor) as server:
        nc = await connect(server.url, name="test-rdzv-late")
        ranks = await _ranks(nc, 2, rewatch_s=30.0)
        try:
            assert await ranks[0].first_epoch() == 1
            waiting = asyncio.create_task(ranks[0].join(1))
            await asyncio.sleep(0.5)  # the watch is up and has delivered the snapshot
            before = _in_msgs(monitor)
            await asyncio.sleep(1.5)
            idle = _in_msgs(monitor) - before
            # a poll every 0.1 s would be ~15 requests here; the watch sends none
            assert idle <= 2, idle
            assert not waiting.done()
            assert await ranks[1].first_epoch() == 1
            arrived = time.monotonic()
            assert await asyncio.wait_for(ranks[1].join(1), 5) is True
            assert await asyncio.wait_for(waiting, 5) is True
            assert time.monotonic() - arrived < 1.0
        finally:
            for r in ranks:
                await r.close()
            await nc.close()


async def test_an_epoch_bump_ends_a_join_and_wakes_wait_newer() -> None:
    with EmbeddedNatsServer(jetstream=True) as server:
        nc = await connect(server.url, name="test-rdzv-bump")
        ranks = await _ranks(nc, 2, rewatch_s=30.0)
        try:
            await ranks[0].first_epoch()
            waiting = asyncio.create_task(ranks[0].join(1))  # rank 1 never joins epoch 1
            newer = asyncio.create_task(ranks[0].wait_newer(1))
            await asyncio.sleep(0.3)
            entry = await ranks[1].kv.get("epoch")
            await ranks[1].kv.update("epoch", b"2", last=entry.revision)
            assert await asyncio.wait_for(waiting, 5) is False
            assert await asyncio.wait_for(newer, 5) == 2
        finally:
            for r in ranks:
                await r.close()
            await nc.close()


async def test_a_peer_whose_beats_stop_is_noticed_and_beats_come_through_the_watch() -> None:
    with EmbeddedNatsServer(jetstream=True) as server:
        nc = await connect(server.url, name="test-rdzv-beats")
        ranks = await _ranks(nc, 2, rewatch_s=30.0)
        try:
            await asyncio.gather(*(r.first_epoch() for r in ranks))
            await asyncio.gather(*(r.join(1) for r in ranks))
            presence = PeerPresence([1], time.monotonic(), silence_s=0.5)
            for count in range(1, 11):  # rank 1 beats (unacknowledged publishes) for 1 s
                await ranks[1].beat(1, count)
                await asyncio.sleep(0.1)
                beats = await ranks[0].peer_beats(1)
                presence.observe(1, beats[1], time.monotonic())
                assert presence.missing(time.monotonic()) == []
            assert beats[1] is not None and int(beats[1]) >= 8  # the watch kept up
            stopped = time.monotonic()
            while not presence.missing(time.monotonic()):  # rank 1 left: no more beats
                presence.observe(1, (await ranks[0].peer_beats(1))[1], time.monotonic())
                assert time.monotonic() - stopped < 3, "a silent peer was not noticed"
                await asyncio.sleep(0.05)
            assert presence.missing(time.monotonic()) == [1]
        finally:
            for r in ranks:
                await r.close()
            await nc.close()


async def test_the_watch_is_made_anew_after_a_server_restart() -> None:
    with EmbeddedNatsServer(jetstream=True) as server:
        nc = await connect(server.url, name="test-rdzv-restart")
        ranks = await _ranks(nc, 2, rewatch_s=0.5)
        try:
            await asyncio.gather(*(r.first_epoch() for r in ranks))
            await asyncio.gather(*(r.join(1) for r in ranks))
            watches = ranks[0].view.num_watches
            server.restart()  # same port and store: the bucket survives, the watch does not
            newer = asyncio.create_task(ranks[0].wait_newer(1))
            deadline = time.monotonic() + 20
            while True:  # the client reconnects on its own
                try:
                    entry = await ranks[1].kv.get("epoch")
                    await ranks[1].kv.update("epoch", b"2", last=entry.revision)
                    break
                except Exception:  # noqa: BLE001 - not reconnected yet
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.2)
            assert await asyncio.wait_for(newer, 10) == 2
            assert ranks[0].view.num_watches > watches
        finally:
            for r in ranks:
                await r.close()
            await nc.close()


def test_a_view_refuses_a_nonpositive_rewatch_and_a_beat_subject_needs_the_bucket() -> None:
    with pytest.raises(ValueError, match="rewatch_s"):
        BucketView(object(), rewatch_s=0)
    with pytest.raises(ValueError, match="bucket"):
        EpochRendezvous(object(), 0, 2, nc=object())


class _Entry:
    key, value, revision, operation = "epoch", b"1", 1, "PUT"


class _SwallowingWatcher:
    """A watch whose ``updates`` returns an update instead of raising when cancelled: what
    Python 3.11's ``asyncio.wait_for`` does when the cancellation and an update meet."""

    STOP_ITER = object()

    def __init__(self) -> None:
        self.swallowed = 0
        self.stopped = False
        self.released = False  # the test's way out if close() never ends the watch

    async def updates(self, timeout: float) -> object:
        if self.released:
            raise asyncio.CancelledError
        try:
            await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            self.swallowed += 1
        return _Entry()

    async def stop(self) -> None:
        self.stopped = True


class _SwallowingKV:
    def __init__(self) -> None:
        self.watcher = _SwallowingWatcher()

    async def watch(self, keys: str) -> _SwallowingWatcher:
        return self.watcher


async def _closes_before_release(view: BucketView, watcher: _SwallowingWatcher) -> bool:
    """Whether ``view.close()`` returned within 5 s while ``watcher`` still held on; then
    releases the watcher (the test's way out) and lets the close finish."""
    closing = asyncio.create_task(view.close())
    await asyncio.wait({closing}, timeout=5)
    closed = closing.done()
    watcher.released = True
    await asyncio.wait({closing}, timeout=5)
    return closed


async def test_close_ends_a_watch_that_dropped_its_cancellation() -> None:
    kv = _SwallowingKV()
    view = BucketView(kv, rewatch_s=30.0)
    follow = asyncio.create_task(view.wait_for(lambda: False))
    while view.get("epoch") is None:
        await asyncio.sleep(0.01)
    closed = await _closes_before_release(view, kv.watcher)
    follow.cancel()
    # returned before the release: the watch ended although its cancels were lost
    assert closed and kv.watcher.swallowed >= 1 and kv.watcher.stopped


class _RetryingWatcher(_SwallowingWatcher):
    """A watch whose ``updates`` swallows the first cancellation and goes on waiting (a client
    that retries inside the call): only a second cancellation ends it."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = False

    async def updates(self, timeout: float) -> object:
        self.waiting = True
        while not self.released:
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                self.swallowed += 1
                if self.swallowed > 1:
                    raise
        raise asyncio.CancelledError


async def test_close_cancels_again_a_watch_that_went_on_waiting() -> None:
    kv = _SwallowingKV()
    kv.watcher = _RetryingWatcher()
    view = BucketView(kv, rewatch_s=30.0)
    follow = asyncio.create_task(view.wait_for(lambda: False))
    while not kv.watcher.waiting:
        await asyncio.sleep(0.01)
    closed = await _closes_before_release(view, kv.watcher)
    follow.cancel()
    # returned before the release: the second cancellation ended the watch
    assert closed and kv.watcher.swallowed == 2 and kv.watcher.stopped


async def test_a_waiter_is_woken_by_close_and_a_wait_after_close_fails_at_once() -> None:
    kv = _SwallowingKV()
    kv.watcher = _RetryingWatcher()
    view = BucketView(kv, rewatch_s=30.0)
    waiting = asyncio.create_task(view.wait_for(lambda: False))
    while not kv.watcher.waiting:
        await asyncio.sleep(0.01)
    await view.close()
    done, _ = await asyncio.wait({waiting}, timeout=5)
    assert waiting in done
    with pytest.raises(ViewClosed, match="closed"):
        waiting.result()
    with pytest.raises(ViewClosed, match="closed"):
        await asyncio.wait_for(view.wait_for(lambda: False), timeout=5)
    # a predicate that already holds is still answered after close
    await asyncio.wait_for(view.wait_for(lambda: True), timeout=5)
