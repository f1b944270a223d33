"""The stages' torch.distributed stores under the bus key: a secret namespace and tagged values.

torch's ``TCPStore`` (rank 0's at ``--dist-url``, a TP leader's on loopback) authenticates no
client, and any client may list, read, write and delete any key. With the deployment's bus key
the stages (1) put every key under :func:`store_prefix`, a namespace new per epoch (per TP
store) that a process without the key cannot name ahead of time, and (2) tag every value they
write with an HMAC of its full name and bytes (:class:`SignedStore`): a value without a valid
tag is never handed to gloo/NCCL (which would parse junk as a peer's address and fail with
``std::bad_alloc`` or crash the process); the reader waits for an authentic one until its
timeout instead. Values are tagged for gloo groups only (the CPU): a NCCL group keeps the
namespace but untagged values (a Python store under NCCL's own threads is not yet run on a GPU).
What a client of the store can still do is in docs/reliability.md ("The stages' store").
Without a bus key the stage stores keep their old names and untagged values; a TP leader uses a
fresh random key per launch instead (``tp_launch.tp_key``).
"""

from __future__ import annotations

import collections
import datetime
import hashlib
import hmac
import time

import torch.distributed as dist

from wavepp.api.signing import BusKey

PREFIX_DOMAIN = b"wavepp store namespace"
VALUE_DOMAIN = b"wavepp store value"
TAG_BYTES = 32
POLL_S = 0.01

# NOTE: a Python store passed to torch is reached through its C++ half only: once the Python
# object is collected, every call fails ("Not implemented"). The last few are kept alive here (a
# group forms once per epoch; NCCL may read its store after forming).
_HELD: collections.deque[SignedStore] = collections.deque(maxlen=8)


def store_prefix(bus_key: BusKey | None, pipeline: str, purpose: str, name: str) -> str:
    """The ``PrefixStore`` prefix of one group's keys in an unauthenticated ``TCPStore`` (pure).

    Args:
        bus_key: the deployment's bus key; None (an insecure deployment) keeps the old, guessable
            prefix ``wavepp/{name}/``.
        pipeline: the replica (``RuntimeConfig.pipeline``).
        purpose: what the group is for and which one (e.g. ``"epoch/3"``, ``"tp/1/40123"``);
            a new value gives an unrelated namespace.
        name: the readable part after the secret (``"epoch/3"``, ``"tp"``).

    Returns:
        ``wavepp/{secret}/{name}/`` with ``secret`` the hex HMAC-SHA256 (64 digits) of the
        pipeline and purpose under the key: a process without the key cannot compute it.
    """
    if bus_key is None:
        return f"wavepp/{name}/"
    # the pipeline as its 32-byte digest: no two (pipeline, purpose) pairs give the same bytes
    payload = hashlib.sha256(pipeline.encode()).digest() + purpose.encode()
    return f"wavepp/{bus_key.mac_bytes(PREFIX_DOMAIN, payload).hex()}/{name}/"


def _as_bytes(value: bytes | str | list[int]) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class SignedStore(dist.Store):
    """``inner`` with each value written as ``tag || value`` and checked when read.

    ``tag`` is the 32-byte HMAC-SHA256 under ``bus_key`` of the key's full name (as ``inner``
    sees it: wrap this in the ``PrefixStore``, not the other way round, so that a value cannot
    be copied from one epoch's names to another's) and the value. ``get`` of a value without a
    valid tag (junk, a value moved from another name) waits for an authentic one, polling every
    ``POLL_S``, and raises ``RuntimeError`` after ``timeout``. ``add``, ``check``,
    ``delete_key``, ``num_keys`` and ``wait`` pass through unchecked (counters and existence).

    Args:
        inner: the store (a ``TCPStore``).
        bus_key: the deployment's bus key.
        timeout: how long ``get`` waits for an authentic value.
    """

    def __init__(self, inner: dist.Store, bus_key: BusKey, timeout: datetime.timedelta) -> None:
        super().__init__()
        self._inner = inner
        self._key = bus_key
        self._timeout_s = timeout.total_seconds()

    def _tag(self, key: str, value: bytes) -> bytes:
        return self._key.mac_bytes(VALUE_DOMAIN, key.encode() + b"\0" + value)

    def set(self, key: str, value: bytes | str | list[int]) -> None:  # noqa: D102
        data = _as_bytes(value)
        self._inner.set(key, self._tag(key, data) + data)

    def get(self, key: str) -> bytes:
        """The authentic value of ``key`` (waits for one; see the class docstring).

        Raises:
            RuntimeError: no authentic value within the timeout.
        """
        deadline = time.monotonic() + self._timeout_s
        while True:
            raw = self._inner.get(key)
            tag, data = raw[:TAG_BYTES], raw[TAG_BYTES:]
            if len(raw) >= TAG_BYTES and hmac.compare_digest(tag, self._tag(key, data)):
                return data
            if time.monotonic() >= deadline:
                raise RuntimeError(f"store key {key!r}: no value with a valid tag (junk?)")
            time.sleep(POLL_S)

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """Refused: no stage uses it, and a tagged compare-and-set needs the stored tag.

        Raises:
            RuntimeError: always.
        """
        raise RuntimeError("SignedStore: compare_set is not supported")

    def add(self, key: str, amount: int) -> int:  # noqa: D102
        return self._inner.add(key, amount)

    def check(self, keys: list[str]) -> bool:  # noqa: D102
        return self._inner.check(keys)

    def delete_key(self, key: str) -> bool:  # noqa: D102
        return self._inner.delete_key(key)

    def num_keys(self) -> int:  # noqa: D102
        return self._inner.num_keys()

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:  # noqa: D102
        if timeout is None:
            self._inner.wait(keys)
        else:
            self._inner.wait(keys, timeout)

    def clone(self) -> SignedStore:  # noqa: D102
        return guarded_store(
            self._inner.clone(), self._key, datetime.timedelta(seconds=self._timeout_s)
        )

    def has_extended_api(self) -> bool:  # noqa: D102
        return False  # multi_get/multi_set go through get/set, one key at a time


def guarded_store(
    store: dist.Store, bus_key: BusKey | None, timeout: datetime.timedelta
) -> dist.Store:
    """``store`` as the stages use it: a :class:`SignedStore` over it with a bus key (kept alive
    for the process, see ``_HELD``), ``store`` itself without one."""
    if bus_key is None:
        return store
    signed = SignedStore(store, bus_key, timeout)
    _HELD.append(signed)
    return signed
