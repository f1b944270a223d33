"""The stages' torch.distributed stores have no authentication: their keys live under a namespace
only the bus key names, and their values carry a tag under it (``runtime.stage.storekey``).

An outsider (no bus key) that reaches rank 0's ``--dist-url`` store, or a TP leader's loopback
store, writes junk under the names it can guess (the old ``wavepp/epoch/{E}/`` and
``wavepp/tp/``), and under the names it lists in the store for the epoch formed before
(``TCPStore.list_keys`` shows every key): with a bus key the next group still forms and carries
a tensor; without one the same junk fails it at once (gloo parses the junk as a peer's address:
``std::bad_alloc``, or a segmentation fault of the whole process). That failing rank runs in a
child process, so that a crash fails only the child.
"""

from __future__ import annotations

import datetime
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from wavepp.api.signing import BusKey
from wavepp.runtime.stage.rendezvous import StageGroupFactory, epoch_prefix
from wavepp.runtime.stage.storekey import SignedStore, guarded_store, store_prefix
from wavepp.runtime.stage.tp_launch import (
    _loopback_store,
    follower_env,
    form_tp_group,
    tp_key,
    tp_prefix,
)
from wavepp.runtime.transport.buskey import BUS_KEY_ENV, BUS_KEY_FILE_ENV
from wavepp.runtime.transport.natsio import free_port

pytestmark = pytest.mark.timeout(60)

KEY = BusKey(bytes(range(32)))
OTHER = BusKey(bytes(range(1, 33)))
TIMEOUT = datetime.timedelta(seconds=10)


def _outsider(port: int) -> dist.TCPStore:
    """A client of the store that knows only its address."""
    return dist.TCPStore("127.0.0.1", port, 2, False, timeout=TIMEOUT)


def _together(*targets: Callable[[], None]) -> list[BaseException]:
    """Run ``targets`` in threads (each rank blocks until the others arrive); their errors."""
    errors: list[BaseException] = []

    def guarded(target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(t,)) for t in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return errors


def _fails_at_once(code: str) -> None:
    """Run ``code`` (a rank forming a group whose peers never come, 30 s timeout) in a child:
    it must fail (an exception or a signal) well before that timeout, i.e. on the junk."""
    started = time.monotonic()
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    last = child.stderr.strip().splitlines()[-1:] or [b""]
    # killed by a signal (a segmentation fault), or gloo's error on the junk (std::bad_alloc
    # here with torch 2.13), not a failure to start
    assert child.returncode < 0 or last[0].startswith((b"MemoryError", b"RuntimeError")), last
    assert b"FORMED" not in child.stdout
    assert time.monotonic() - started < 25, child.stderr[-2000:]


def _exchange(sender: dist.ProcessGroup, receiver: dist.ProcessGroup, src: int, dst: int) -> float:
    got = torch.zeros(4)
    errors = _together(
        lambda: sender.send([torch.full((4,), 7.0)], dst, 0).wait(),
        lambda: receiver.recv([got], src, 0).wait(),
    )
    assert not errors, errors
    return float(got.sum())


def test_the_namespace_is_secret_per_pipeline_key_and_purpose() -> None:
    prefixes = {
        epoch_prefix(key, pipeline, epoch)
        for key in (KEY, OTHER)
        for pipeline in ("p-r0", "p-r1")
        for epoch in (1, 2)
    }
    assert len(prefixes) == 8  # each key, pipeline and epoch its own
    prefix = epoch_prefix(KEY, "p-r0", 3)
    secret = prefix.split("/")[1]
    assert prefix == f"wavepp/{secret}/epoch/3/" and len(secret) == 64
    assert epoch_prefix(KEY, "p-r0", 3) == prefix  # every stage of the replica names the same
    assert KEY.hex() not in prefix and "p-r0" not in prefix
    # without a bus key (an insecure deployment): the old, guessable names
    assert epoch_prefix(None, "p-r0", 3) == "wavepp/epoch/3/"
    assert tp_prefix(None, "p-r0", 1, 4000) == "wavepp/tp/"
    tp = {tp_prefix(KEY, "p-r0", r, port) for r in (0, 1) for port in (4000, 4001)}
    assert len(tp) == 4 and all(p.endswith("/tp/") for p in tp)  # per stage rank and start
    # (pipeline, purpose) pairs cannot be shifted into each other
    assert store_prefix(KEY, "a", "bc", "x") != store_prefix(KEY, "ab", "c", "x")


@pytest.mark.parametrize("keyed", [True, False], ids=["bus-key", "no-key"])
def test_outsider_junk_under_the_names_it_can_know_does_not_fail_the_reform(keyed: bool) -> None:
    bus_key = KEY if keyed else None
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    factories = [
        StageGroupFactory(url, rank, 2, "gloo", timeout_s=10, bus_key=bus_key, pipeline="p-r0")
        for rank in range(2)
    ]
    groups: list[dist.ProcessGroup | None] = [None, None]

    def form(rank: int, epoch: int) -> Callable[[], None]:
        def run() -> None:
            groups[rank] = factories[rank].form(epoch)

        return run

    assert not _together(form(0, 1), form(1, 1))
    outsider = _outsider(port)
    listed = outsider.list_keys()  # the store shows every key to every client
    assert len(listed) == 2 and all("/epoch/1/" in k for k in listed)
    junk = ["wavepp/epoch/2//0/0", "wavepp/epoch/2//0/1"]  # the old names of epoch 2's keys
    junk += [k.replace("/epoch/1/", "/epoch/2/") for k in listed]  # the listed ones, renamed
    for name in junk:
        outsider.set(name, "junk")
    groups[0] = groups[1] = None  # the stages leave epoch 1 (as a re-form does)
    if not keyed:  # rank 1 reads the junk as rank 0's address at once: the re-form fails
        _fails_at_once(
            "from wavepp.runtime.stage.rendezvous import StageGroupFactory\n"
            f"StageGroupFactory({url!r}, 1, 2, 'gloo', timeout_s=30).form(2)\n"
            "print('FORMED')"
        )
        return
    assert not _together(form(0, 2), form(1, 2))
    assert groups[0] is not None and groups[1] is not None
    assert _exchange(groups[0], groups[1], 0, 1) == 28.0
    new = set(outsider.list_keys()) - set(listed) - set(junk)
    assert new and all(k.startswith(epoch_prefix(KEY, "p-r0", 2)) for k in new)


@pytest.mark.parametrize("keyed", [True, False], ids=["bus-key", "no-key"])
def test_local_junk_in_a_tp_leaders_store_does_not_fail_its_group(keyed: bool) -> None:
    bus_key = KEY if keyed else None
    store = _loopback_store(2, TIMEOUT)
    outsider = _outsider(store.port)
    for name in ("wavepp/tp//0/0", "wavepp/tp//0/1"):  # the old names of the TP group's keys
        outsider.set(name, "junk")
    if not keyed:  # a follower reads the junk as the leader's address at once
        _fails_at_once(
            "import datetime, torch.distributed as dist\n"
            "from wavepp.runtime.stage.tp_launch import form_tp_group\n"
            "t = datetime.timedelta(seconds=30)\n"
            f"store = dist.TCPStore('127.0.0.1', {store.port}, 2, False, timeout=t)\n"
            "form_tp_group(store, 1, 2, 'cpu', t, None, 'p-r0', 0)\n"
            "print('FORMED')"
        )
        return
    follower_store = dist.TCPStore("127.0.0.1", store.port, 2, False, timeout=TIMEOUT)
    env = follower_env({BUS_KEY_FILE_ENV: "/elsewhere", "PATH": "/bin"}, bus_key)
    follower_key = BusKey.from_hex(env[BUS_KEY_ENV])  # what the follower's main reads
    assert follower_key.hex() == KEY.hex() and BUS_KEY_FILE_ENV not in env
    tps: list = [None, None]

    def leader() -> None:
        tps[0] = form_tp_group(store, 0, 2, "cpu", TIMEOUT, bus_key, "p-r0", 0)

    def follower() -> None:
        tps[1] = form_tp_group(follower_store, 1, 2, "cpu", TIMEOUT, follower_key, "p-r0", 0)

    assert not _together(leader, follower)
    assert _exchange(tps[0].pg, tps[1].pg, 0, 1) == 28.0
    prefix = tp_prefix(KEY, "p-r0", 0, store.port)
    assert {k for k in outsider.list_keys() if k.startswith(prefix)}  # its keys were there


def test_junk_written_by_an_outsider_watching_a_formation_fails_it_cleanly() -> None:
    """The namespace hides the names only until the first rank writes: an outsider polling
    ``list_keys`` overwrites rank 0's key before rank 1 reads it. Untagged, gloo would parse it
    (a segmentation fault, seen by hand); tagged, rank 1 never reads it: it fails the epoch
    with an error after its timeout (3 s), and the next epoch forms. (Rank 0's write is made
    here through the same tagged store, not by a forming rank 0: a real one connects to rank
    1's address and waits for gloo's own connect timeout, 3 to 15 s.)"""
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    factories = [
        StageGroupFactory(url, rank, 2, "gloo", timeout_s=3, bus_key=KEY, pipeline="p-r0")
        for rank in range(2)
    ]
    host = factories[0]._store()  # noqa: SLF001 - rank 0 hosts the store
    prefix = epoch_prefix(KEY, "p-r0", 1)
    guarded_store(host, KEY, TIMEOUT).set(prefix + "/0/0", b"rank 0's address")
    outsider = _outsider(port)
    seen = outsider.list_keys()
    assert seen == [prefix + "/0/0"]  # the new namespace, as soon as a rank wrote in it
    outsider.set(seen[0], "junk")
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="no value with a valid tag"):
        factories[1].form(1)
    assert time.monotonic() - started < 10
    groups: list[dist.ProcessGroup | None] = [None, None]
    assert not _together(
        lambda: groups.__setitem__(0, factories[0].form(2)),
        lambda: groups.__setitem__(1, factories[1].form(2)),
    )
    assert _exchange(groups[0], groups[1], 0, 1) == 28.0  # type: ignore[arg-type]


def test_a_signed_store_reads_only_values_tagged_for_their_name() -> None:
    inner = dist.HashStore()
    signed = SignedStore(inner, KEY, datetime.timedelta(seconds=0.05))
    signed.set("a", b"\x00address")
    signed.set("s", "text")
    assert signed.get("a") == b"\x00address" and signed.get("s") == b"text"
    inner.set("b", inner.get("a"))  # an authentic value moved to another name
    inner.set("c", "junk")
    inner.set("d", b"")
    SignedStore(inner, OTHER, datetime.timedelta(seconds=1)).set("e", b"x")  # another key's
    for name in ("b", "c", "d", "e"):
        with pytest.raises(RuntimeError, match="no value with a valid tag"):
            signed.get(name)
    assert guarded_store(inner, None, TIMEOUT) is inner  # no key: values as they are


def test_a_follower_of_a_leader_without_a_key_has_none() -> None:
    env = follower_env({BUS_KEY_ENV: KEY.hex(), BUS_KEY_FILE_ENV: "/k", "HOME": "/h"}, None)
    assert BUS_KEY_ENV not in env and BUS_KEY_FILE_ENV not in env and env["HOME"] == "/h"


def test_without_a_bus_key_an_outsider_cannot_take_a_followers_seat() -> None:
    """Without a bus key (``--insecure-nats``) the TP leader makes a fresh key per launch
    (``tp_key``) and hands it to its followers only, so a local process that joins the store
    first as TP rank 1 (under the fixed ``wavepp/tp/`` names, untagged) cannot take the
    follower's seat (read the prompts, change the all-reduces)."""
    key = tp_key(None)
    assert key.hex() != tp_key(None).hex() and tp_key(KEY) is KEY
    store = _loopback_store(2, TIMEOUT)
    env = follower_env({"PATH": "/bin"}, key)
    follower_key = BusKey.from_hex(env[BUS_KEY_ENV])  # what the follower's main reads
    short = datetime.timedelta(seconds=2)
    tps: list = [None, None]
    outsider_error: list[BaseException] = []

    def outsider() -> None:  # the attack's join, and one with another random key
        for guess in (None, tp_key(None)):
            try:
                form_tp_group(_outsider(store.port), 1, 2, "cpu", short, guess, "p-r0", 0)
            except RuntimeError as exc:
                outsider_error.append(exc)

    def leader() -> None:
        tps[0] = form_tp_group(store, 0, 2, "cpu", TIMEOUT, key, "p-r0", 0)

    def follower() -> None:
        time.sleep(0.5)  # after the outsider's first try
        tps[1] = form_tp_group(_outsider(store.port), 1, 2, "cpu", TIMEOUT, follower_key, "p-r0", 0)

    assert not _together(outsider, leader, follower)
    assert len(outsider_error) == 2, outsider_error  # neither guess formed a group
    assert _exchange(tps[0].pg, tps[1].pg, 0, 1) == 28.0


def test_start_followers_hands_its_followers_the_launch_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``start_followers`` without a bus key: the followers' environment carries the key the
    leader's group uses (process spawning and the group are recorded, not run: a real follower
    builds a model; ``tests/runtime/stage/test_tensor_parallel.py`` runs those)."""
    from wavepp.runtime.config import RuntimeConfig
    from wavepp.runtime.stage import tp_launch

    spawned: list[dict] = []
    used: list[BusKey] = []

    class _Proc:
        def __init__(self, command: list[str], stdin: int, env: dict[str, str]) -> None:
            assert BUS_KEY_ENV not in " ".join(command)
            spawned.append(env)
            self.stdin = __import__("io").BytesIO()

        def poll(self) -> int:
            return 0

    def formed(store, tp_rank, size, device, timeout, bus_key, pipeline, rank):  # noqa: ANN001, ANN202
        used.append(bus_key)
        return "group"

    monkeypatch.setattr(tp_launch.subprocess, "Popen", _Proc)
    monkeypatch.setattr(tp_launch, "form_tp_group", formed)
    monkeypatch.delenv(BUS_KEY_ENV, raising=False)
    config = RuntimeConfig(pipeline="p-r0", num_stages=1, tensor_parallel_size=4)
    followers = tp_launch.start_followers(config, 0, timeout_s=5, bus_key=None)
    assert followers.tp == "group" and len(spawned) == 3 and used[0] is not None
    assert {env[BUS_KEY_ENV] for env in spawned} == {used[0].hex()}
