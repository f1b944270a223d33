"""The stages' process group, re-formable in place: an epoch rendezvous in a NATS KV bucket.

A torch.distributed group cannot be rejoined once a member died. So the stages of a replica form
one group per *epoch*, each over its own ``PrefixStore`` of the rank-0 ``TCPStore`` (``--dist-url``),
and a stage process that comes back (same rank, same args: a kubelet or ``wavepp up`` restart)
starts a new epoch that the survivors join without restarting::

    KV bucket WAVEPP_RDZV_{ns}_{pipeline} (api.subjects.rendezvous_bucket)
      epoch          -> "E"     the epoch being formed or served
      join.E.r       -> ""      rank r joined epoch E
      alive.E.r      -> "n"     rank r's beat in epoch E (a counter, put every PEER_BEAT_S)

    a fresh process of rank r:  E = epoch (created as 1 when absent)
                                join.E.r exists?  a former process of r was in E: bump E -> E+1
                                put join.E.r, wait for join.E.0..S-1, form the group of E
    a running stage:            watches ``epoch``; a higher one -> drop its group (its peers'
                                blocked receives fail at once), join and form the new epoch

With a bus key the store's keys live under a secret namespace, ``wavepp/{HMAC(bus key,
pipeline, epoch)}/epoch/{E}/`` (:func:`epoch_prefix`), and every value carries a tag
(``storekey``). torch's ``TCPStore`` has no authentication, so a process that reaches
``--dist-url`` could write junk under the names the next epoch will use and fail (or crash) its
re-form; without the key it cannot name them ahead of time (each epoch's namespace is new, so
listing one epoch's keys, which the store allows, tells nothing of the next), and junk written
once it sees them is not read. Without a bus key the prefix stays ``wavepp/epoch/{E}/``. What a
client of the store can still do is in docs/reliability.md ("The stages' store").

Nothing polls the bucket: every stage keeps one KV watch of it (:class:`BucketView`, an ordered
push consumer of the bucket's stream), and waits for an epoch, a join or a beat on what that
watch delivered. A stage of epoch E publishes ``alive.E.{rank}`` (a KV put without the
acknowledgement: a lost beat is replaced by the next) and reads its peers' beats from its
watch; a peer whose beat has not changed for ``PEER_SILENCE_S`` (by the reader's own clock: no clock is compared across hosts)
is gone, and with it the group (:class:`PeerPresence`, pure): the stage's readiness turns false
(its ``/readyz`` 503) at most ``PEER_SILENCE_S`` + 2 x ``PEER_BEAT_S`` after a peer dies.

The rules are :func:`decide_join` (pure). Without JetStream (``LocalPipeline``'s plain
nats-server) there is no bucket: the stages form epoch 0 once (a dead stage then
needs every stage restarted, ``LocalPipeline.restart_stages``).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import torch.distributed as dist
from nats.js.api import KeyValueConfig
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError

from wavepp.api.signing import BusKey
from wavepp.api.subjects import kv_key_subject, rendezvous_bucket
from wavepp.runtime.stage.storekey import guarded_store, store_prefix

log = logging.getLogger(__name__)

EPOCH_KEY = "epoch"
# A bucket watch that delivered nothing for REWATCH_S is replaced by a new one (seconds): a
# serving stage's own beat comes back through it every PEER_BEAT_S, so only a lost watch (a
# server restart) or an idle bucket goes this long without an update.
REWATCH_S = 2.0
# A watch's close cancels its task again after this long while it has not ended (BucketView.close).
CLOSE_RETRY_S = 0.05


MAX_EPOCH = 2**31
# A stage beats every PEER_BEAT_S; a peer silent for PEER_SILENCE_S is gone (seconds).
PEER_BEAT_S = 0.25
PEER_SILENCE_S = 1.2


def alive_key(epoch: int, rank: int) -> str:
    """Rank ``rank``'s beat in epoch ``epoch`` (pure)."""
    return f"alive.{epoch}.{rank}"


class PeerPresence:
    """Which peers of one epoch still beat (pure: the caller passes the time).

    Args:
        peers: the other ranks of the group.
        now: monotonic seconds at the epoch's start (every peer counts as just seen).
        silence_s: a peer whose beat has not changed for longer is gone (> 0).

    Raises:
        ValueError: ``silence_s`` <= 0.
    """

    def __init__(self, peers: list[int], now: float, silence_s: float = PEER_SILENCE_S) -> None:
        if not silence_s > 0:
            raise ValueError(f"silence_s={silence_s}: must be > 0")
        self.silence_s = silence_s
        self._last: dict[int, tuple[bytes | None, float]] = {r: (None, now) for r in peers}

    def observe(self, rank: int, beat: bytes | None, now: float) -> None:
        """``rank``'s beat read at ``now`` (None: no beat yet); a changed value counts as seen."""
        value, _ = self._last[rank]
        if beat is not None and beat != value:
            self._last[rank] = (beat, now)

    def missing(self, now: float) -> list[int]:
        """The peers silent for longer than ``silence_s`` at ``now``, ascending."""
        return sorted(r for r, (_, seen) in self._last.items() if now - seen > self.silence_s)


def epoch_of(value: bytes | None, revision: int) -> int:
    """The epoch an ``epoch`` entry says (pure). A value that is not an integer in
    [1, ``MAX_EPOCH``) was not written by a stage (a client holding a stage's NATS credentials
    can write the bucket): it is read as the entry's revision instead, which is above every epoch
    written before it (each epoch was a write), so the stages move on to a fresh epoch together
    instead of crash-looping on it."""
    try:
        epoch = int((value or b"").decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        epoch = 0
    if 1 <= epoch < MAX_EPOCH:
        return epoch
    log.warning("rendezvous: epoch entry %r is not an epoch; read as revision %d", value, revision)
    return max(1, revision)


def epoch_prefix(bus_key: BusKey | None, pipeline: str, epoch: int) -> str:
    """The prefix of epoch ``epoch``'s stage group: ``wavepp/{secret}/epoch/{E}/`` with a bus
    key (a new secret per epoch and pipeline), ``wavepp/epoch/{E}/`` without one (pure)."""
    return store_prefix(bus_key, pipeline, f"epoch/{epoch}", f"epoch/{epoch}")


def join_key(epoch: int, rank: int) -> str:
    """``join.{epoch}.{rank}``: the KV key a stage puts when it joins an epoch."""
    return f"join.{epoch}.{rank}"


@dataclass(frozen=True)
class JoinDecision:
    """Which epoch a fresh stage process joins, and whether it must start that epoch."""

    epoch: int
    bump: bool


def decide_join(current: int | None, rank_already_joined: bool) -> JoinDecision:
    """The epoch a *fresh* process joins (pure).

    Args:
        current: the bucket's epoch (None: no epoch yet).
        rank_already_joined: ``join.{current}.{rank}`` exists, i.e. a former process of this
            rank was a member of ``current`` (this one replaces it).

    Returns:
        ``current`` when this rank has not joined it (a first start: everyone meets there),
        else ``current + 1`` with ``bump`` (the survivors must leave the broken epoch).
    """
    if current is None:
        return JoinDecision(1, bump=False)
    if rank_already_joined:
        return JoinDecision(current + 1, bump=True)
    return JoinDecision(current, bump=False)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def parse_dist_url(dist_url: str) -> tuple[str, int]:
    """``tcp://host:port`` -> (host, port).

    Raises:
        ValueError: not a ``tcp://host:port`` URL (names ``--dist-url``).
    """
    parsed = urlparse(dist_url)
    if parsed.scheme != "tcp" or not parsed.hostname or parsed.port is None:
        raise ValueError(f"--dist-url {dist_url!r}: must be tcp://HOST:PORT (rank 0's store)")
    return parsed.hostname, parsed.port


class StageGroupFactory:
    """Builds one process group per epoch over the rank-0 TCPStore of ``dist_url``.

    Rank 0 hosts the store for its process's lifetime; the other ranks connect a new client per
    epoch (the host may be a new rank-0 process). Each epoch's keys are under
    :func:`epoch_prefix` of ``bus_key`` and ``pipeline`` (every stage of a replica must be given
    the same two). Blocking: call from a thread.
    """

    def __init__(
        self,
        dist_url: str,
        rank: int,
        num_stages: int,
        backend: str,
        timeout_s: float = 60.0,
        *,
        bus_key: BusKey | None = None,
        pipeline: str = "",
    ) -> None:
        self.host, self.port = parse_dist_url(dist_url)
        self.bus_key = bus_key
        self.pipeline = pipeline
        self.rank = rank
        self.num_stages = num_stages
        self.backend = backend
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._master: dist.TCPStore | None = None

    def _store(self) -> dist.Store:
        if self.rank == 0:
            if self._master is None:
                self._master = self._master_store()
            return self._master
        return dist.TCPStore(self.host, self.port, self.num_stages, False, timeout=self.timeout)

    def _master_store(self) -> dist.TCPStore:
        """Rank 0's store. On a loopback ``--dist-url`` (``wavepp up``, one machine) it listens
        on that loopback address only: torch's store binds every interface and has no
        authentication, so another host could read, grow or poison it (a large write per key,
        or junk under ``wavepp/epoch/*`` that fails the next re-form). On a pod address it
        listens on every interface (the pod's; the pipeline's NetworkPolicies say who may reach
        it)."""

        def listening(**how: Any) -> dist.TCPStore:
            return dist.TCPStore(
                self.host,
                self.port,
                self.num_stages,
                True,
                timeout=self.timeout,
                wait_for_workers=False,
                **how,
            )

        if not _is_loopback(self.host):
            return listening()
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.host, self.port))
        listener.listen(128)
        # detach: the store owns the descriptor for the process's life (a Python socket closed
        # at exit under the store's daemon aborts the process)
        return listening(master_listen_fd=listener.detach(), use_libuv=False)

    def form(self, epoch: int) -> dist.ProcessGroup:
        """The group of ``epoch`` (returns once all ``num_stages`` ranks formed it).

        Raises:
            RuntimeError / DistStoreError: a rank did not arrive within ``timeout_s``.
        """
        prefix = epoch_prefix(self.bus_key, self.pipeline, epoch)
        # NOTE: values are tagged for gloo only: NCCL reads its store from its own threads too,
        # and a Python store under it has not been run on a GPU here (docs/reliability.md)
        tag_key = self.bus_key if self.backend == "gloo" else None
        store = dist.PrefixStore(prefix, guarded_store(self._store(), tag_key, self.timeout))
        if self.backend == "nccl":
            return dist.ProcessGroupNCCL(store, self.rank, self.num_stages)
        return dist.ProcessGroupGloo(store, self.rank, self.num_stages, self.timeout)


class ViewClosed(RuntimeError):
    """A :meth:`BucketView.wait_for` whose view was closed before its predicate held."""


class BucketView:
    """The latest value and revision of every key of one KV bucket, kept by one watch.

    The watch (``KeyValue.watch(">")``, an ordered push consumer) first delivers each key's last
    value, then every put as it happens; :meth:`wait_for` wakes on each. A watch that delivers
    nothing for ``rewatch_s`` seconds is stopped and made anew (it starts again from each key's
    last value), so a watch lost to a server restart or a reconnect costs at most that long.
    Deleted or purged keys leave the view. Call from one event loop; :meth:`close` ends it and
    wakes every :meth:`wait_for`.

    Raises:
        ValueError: ``rewatch_s`` <= 0.
    """

    def __init__(self, kv, rewatch_s: float = REWATCH_S) -> None:  # noqa: ANN001 - KeyValue
        if not rewatch_s > 0:
            raise ValueError(f"rewatch_s={rewatch_s}: must be > 0")
        self.kv = kv
        self.rewatch_s = rewatch_s
        self.num_watches = 0  # watches made (1 + the lost or idle ones replaced)
        self._values: dict[str, tuple[bytes, int]] = {}
        self._changed: asyncio.Condition | None = None
        self._synced: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    def get(self, key: str) -> tuple[bytes, int] | None:
        """``key``'s last (value, revision) the watch delivered, or None (absent or deleted)."""
        return self._values.get(key)

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        """Return once ``predicate()`` (which reads :meth:`get`) holds; it is evaluated after
        the watch's first snapshot and after every update. Starts the watch on first use.

        Raises:
            ViewClosed: :meth:`close` was called before ``predicate()`` held (at once if it
                was called before this call).
        """
        if self._task is None and not self._closing:
            self._changed, self._synced = asyncio.Condition(), asyncio.Event()
            self._task = asyncio.create_task(self._follow())
        if self._changed is not None and self._synced is not None:
            await self._synced.wait()
            async with self._changed:
                await self._changed.wait_for(lambda: self._closing or predicate())
        if not predicate():
            raise ViewClosed("the rendezvous view was closed while waiting")

    async def close(self) -> None:
        """Stop the watch (idempotent) and wake every :meth:`wait_for` (they raise
        :class:`ViewClosed` unless their predicate holds); returns once the watch has ended.

        The task is cancelled again until it ends: on Python 3.11 ``asyncio.wait_for`` (under
        ``KeyWatcher.updates``) drops a cancellation that arrives as an update does, and the
        watch would then go on, with this call waiting on it for ever.
        """
        task = self._task
        self._closing = True
        while task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=CLOSE_RETRY_S)
        if task is not None and not task.cancelled():
            with contextlib.suppress(Exception):
                task.result()  # retrieved: a watch that failed is not logged as unretrieved
        if self._changed is not None and self._synced is not None:
            self._synced.set()  # waiters before the first snapshot wake too
            async with self._changed:
                self._changed.notify_all()

    async def _follow(self) -> None:
        assert self._changed is not None and self._synced is not None
        while not self._closing:
            try:
                watcher = await self.kv.watch(">")
            except Exception as exc:  # noqa: BLE001 - a reconnecting server: try again
                log.debug("rendezvous: watch: %r", exc)
                await asyncio.sleep(self.rewatch_s)
                continue
            self.num_watches += 1
            try:
                while not self._closing:
                    try:
                        entry = await watcher.updates(timeout=self.rewatch_s)
                    except TimeoutError:
                        break  # silent: make the watch anew
                    if entry is None:  # the snapshot of every key's last value is complete
                        self._synced.set()
                    elif entry is watcher.STOP_ITER:  # stopped under us
                        break
                    elif entry.operation in (None, "PUT"):
                        self._values[entry.key] = (entry.value or b"", entry.revision)
                    else:
                        self._values.pop(entry.key, None)
                    async with self._changed:
                        self._changed.notify_all()
            finally:
                with contextlib.suppress(Exception):
                    await watcher.stop()


class EpochRendezvous:
    """The epoch protocol of the module docstring over one replica's KV bucket.

    A fresh process's first read (:meth:`first_epoch`) and :meth:`current` ask the server;
    :meth:`join`, :meth:`wait_newer` and :meth:`peer_beats` read the bucket's watch
    (:class:`BucketView`) and never poll.

    Args:
        kv: the bucket (``open_rendezvous``).
        rank: this stage's rank.
        num_stages: S.
        nc: the NATS connection the beats are published on, to the bucket's key subject
            (None: beats are acknowledged puts through ``kv``).
        bucket: the bucket's name (needed with ``nc``).
        rewatch_s: the view's ``rewatch_s``.
    """

    def __init__(  # noqa: ANN001 - KeyValue, NATS client
        self,
        kv,
        rank: int,
        num_stages: int,
        *,
        nc=None,
        bucket: str = "",
        rewatch_s: float = REWATCH_S,
    ) -> None:
        if nc is not None and not bucket:
            raise ValueError("bucket: required with nc (the beats' subject names it)")
        self.kv = kv
        self.rank = rank
        self.num_stages = num_stages
        self.nc = nc
        self.bucket = bucket
        self.view = BucketView(kv, rewatch_s)

    async def close(self) -> None:
        """Stop the bucket's watch."""
        await self.view.close()

    def _view_epoch(self) -> int | None:
        entry = self.view.get(EPOCH_KEY)
        return None if entry is None else epoch_of(*entry)

    async def current(self) -> int | None:
        """The bucket's epoch, or None when no stage started one yet."""
        try:
            entry = await self.kv.get(EPOCH_KEY)
        except KeyNotFoundError:
            return None
        return epoch_of(entry.value, entry.revision)

    async def first_epoch(self) -> int:
        """The epoch a fresh process joins (:func:`decide_join`); starts it when it must."""
        while True:
            try:
                entry = await self.kv.get(EPOCH_KEY)
            except KeyNotFoundError:
                with contextlib.suppress(KeyWrongLastSequenceError):
                    await self.kv.create(EPOCH_KEY, b"1")
                continue
            current = epoch_of(entry.value, entry.revision)
            decision = decide_join(current, await self._has_joined(current, self.rank))
            if not decision.bump:
                return decision.epoch
            try:
                await self.kv.update(EPOCH_KEY, str(decision.epoch).encode(), last=entry.revision)
                log.warning(
                    "stage %d: replaces its former process: epoch %d -> %d",
                    self.rank,
                    current,
                    decision.epoch,
                )
                return decision.epoch
            except KeyWrongLastSequenceError:
                continue  # another rank bumped meanwhile: read again

    async def join(self, epoch: int) -> bool:
        """Put ``join.{epoch}.{rank}``, wait for every rank's.

        Returns:
            True once all S joined; False when a later epoch started meanwhile (join that).
        """
        await self.kv.put(join_key(epoch, self.rank), b"")

        def moved_on() -> bool:
            current = self._view_epoch()
            return current is not None and current > epoch

        def all_joined() -> bool:
            return all(self.view.get(join_key(epoch, r)) for r in range(self.num_stages))

        await self.view.wait_for(lambda: moved_on() or all_joined())
        return not moved_on()

    async def beat(self, epoch: int, count: int) -> None:
        """Publish this rank's beat ``count`` for ``epoch`` (unacknowledged with ``nc``)."""
        key, value = alive_key(epoch, self.rank), str(count).encode()
        if self.nc is None:
            await self.kv.put(key, value)
        else:
            await self.nc.publish(kv_key_subject(self.bucket, key), value)

    async def peer_beats(self, epoch: int) -> dict[int, bytes | None]:
        """Every other rank's last beat in ``epoch`` the watch delivered (None: none yet)."""
        beats: dict[int, bytes | None] = {}
        for rank in range(self.num_stages):
            if rank != self.rank:
                entry = self.view.get(alive_key(epoch, rank))
                beats[rank] = None if entry is None else entry[0]
        return beats

    async def wait_newer(self, epoch: int) -> int:
        """Return the bucket's epoch once the watch delivers one above ``epoch``."""

        def newer() -> bool:
            current = self._view_epoch()
            return current is not None and current > epoch

        await self.view.wait_for(newer)
        current = self._view_epoch()
        assert current is not None
        return current

    async def _has_joined(self, epoch: int, rank: int) -> bool:
        try:
            await self.kv.get(join_key(epoch, rank))
        except KeyNotFoundError:
            return False
        return True


async def open_rendezvous(  # noqa: ANN001
    nc, pipeline: str, rank: int, num_stages: int, *, namespace: str
) -> EpochRendezvous | None:
    """The replica's rendezvous bucket ``WAVEPP_RDZV_{ns}_{pipeline}`` (created if absent), or
    None without JetStream."""
    js = nc.jetstream(timeout=2.0)  # a server without JetStream (or a user without it): fast
    bucket = rendezvous_bucket(pipeline, namespace=namespace)
    kv = None
    for _ in range(3):
        try:
            kv = await js.key_value(bucket)
            break
        except BucketNotFoundError:
            try:
                kv = await js.create_key_value(KeyValueConfig(bucket=bucket, history=1))
                break
            except Exception as exc:  # noqa: BLE001 - another rank created it meanwhile
                log.info("stage %d: creating %s: %r; binding again", rank, bucket, exc)
        except Exception as exc:  # noqa: BLE001 - no JetStream here (or not for this user)
            log.warning("stage %d: no rendezvous bucket %s (%r); forming once", rank, bucket, exc)
            return None
    if kv is None:
        log.warning("stage %d: rendezvous bucket %s unavailable; forming once", rank, bucket)
        return None
    return EpochRendezvous(kv, rank, num_stages, nc=nc, bucket=bucket)
