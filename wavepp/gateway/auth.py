"""API keys: who a caller is (``Authorization: Bearer <key>`` -> exactly one tenant).

Keys are kept and compared as SHA-256 digests only: a presented key is hashed and compared with
every stored digest by ``hmac.compare_digest`` (no early exit, so the time does not depend on
which entry, if any, matched). No key, raw or hashed, is ever logged or put in a metric.

Key file (one per tenant; the Kubernetes Secret's ``keys`` entry, or ``apiKeysFile`` for
``wavepp up``), one key per line, ``#`` comments and blank lines ignored::

    sha256:<64 hex digits>  [not-after=2026-12-01T00:00:00Z]
    <raw key, >= 16 characters, no spaces>  [not-after=...]

A raw key is hashed when read and never kept. ``not-after`` (ISO 8601, a zone required) ends a
key's validity without another edit of the file: a rotation adds the new key and gives the old
one a ``not-after`` (the rotation window). At most :data:`MAX_KEYS_PER_TENANT` keys of a tenant
are valid at once; a key may belong to one tenant only.

:class:`KeyStore` re-reads a file when its (mtime, inode, size) changed, checked at most every
``poll_s`` seconds; a Kubernetes Secret volume swaps its files by symlink, which changes the
inode. A file that fails to parse keeps the tenant's previous keys (logged, without key text).

:class:`FailureLimiter` counts authentication failures per client address (a token bucket per
client, bounded number of clients): a client past its budget gets 429 before its key is even
looked at, so guessing keys is slow.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from wavepp.gateway.tenants import TokenBucket

log = logging.getLogger(__name__)

MAX_KEYS_PER_TENANT = 2
"""Keys of one tenant valid at the same time: the current one and, during a rotation, its
successor."""
MIN_RAW_KEY_CHARS = 16
_HASH_PREFIX = "sha256:"


MAX_KEY_FILE_BYTES = 64 * 1024  # a tenant's key file: a few hashes, not megabytes


def hash_key(key: str) -> bytes:
    """SHA-256 digest (32 bytes) of a key as presented (UTF-8)."""
    return hashlib.sha256(key.encode()).digest()


def key_line(key: str) -> str:
    """The key file line that stores ``key`` as its hash (what to put in a Secret)."""
    return _HASH_PREFIX + hash_key(key).hex()


class KeyFileError(ValueError):
    """A key file that cannot be used: names the tenant, the line and the rule (never the key)."""


@dataclass(frozen=True)
class KeyEntry:
    """One stored key: its digest, its tenant, and the end of its validity (epoch s; None: none)."""

    digest: bytes
    tenant: str
    not_after_s: float | None = None

    def is_valid(self, now_s: float) -> bool:
        return self.not_after_s is None or now_s < self.not_after_s


def parse_key_file(text: str, tenant: str, *, now_s: float) -> list[KeyEntry]:
    """The keys of ``tenant`` in a key file's ``text`` (format: module docstring).

    Args:
        text: the file's content.
        tenant: whose keys these are.
        now_s: wall clock, epoch seconds (to count the keys valid now).

    Returns:
        The entries, expired ones included (they are refused at lookup).

    Raises:
        KeyFileError: a malformed line, a raw key under :data:`MIN_RAW_KEY_CHARS` characters,
            or more than :data:`MAX_KEYS_PER_TENANT` keys valid at ``now_s``.
    """
    entries: list[KeyEntry] = []
    for number, raw_line in enumerate(text.splitlines(), start=1):
        line = raw_line.split("#", 1)[0].strip()
        if not line:
            continue
        key, *options = line.split()
        not_after_s = None
        for option in options:
            name, _, value = option.partition("=")
            if name != "not-after" or not value:
                raise KeyFileError(
                    f"tenant {tenant!r} key file line {number}: unknown option {name!r}; "
                    "the only option is not-after=<ISO 8601 time with zone>"
                )
            try:
                when = datetime.fromisoformat(value)
            except ValueError as exc:
                raise KeyFileError(
                    f"tenant {tenant!r} key file line {number}: not-after={value!r} is not an "
                    "ISO 8601 time"
                ) from exc
            if when.tzinfo is None:
                raise KeyFileError(
                    f"tenant {tenant!r} key file line {number}: not-after={value!r} needs a "
                    "zone (e.g. Z)"
                )
            not_after_s = when.timestamp()
        if key.startswith(_HASH_PREFIX):
            hex_digest = key[len(_HASH_PREFIX) :]
            try:
                digest = bytes.fromhex(hex_digest)
            except ValueError:
                digest = b""
            if len(digest) != 32:
                raise KeyFileError(
                    f"tenant {tenant!r} key file line {number}: sha256: needs 64 hex digits"
                )
        elif len(key) < MIN_RAW_KEY_CHARS:
            raise KeyFileError(
                f"tenant {tenant!r} key file line {number}: a key has at least "
                f"{MIN_RAW_KEY_CHARS} characters"
            )
        else:
            digest = hash_key(key)
        entries.append(KeyEntry(digest, tenant, not_after_s))
    num_valid = sum(e.is_valid(now_s) for e in entries)
    if num_valid > MAX_KEYS_PER_TENANT:
        raise KeyFileError(
            f"tenant {tenant!r}: {num_valid} keys valid now; at most {MAX_KEYS_PER_TENANT} "
            "(the current key and its successor during a rotation)"
        )
    return entries


def _check_unique(by_tenant: Mapping[str, list[KeyEntry]]) -> None:
    owner: dict[bytes, str] = {}
    for tenant, entries in by_tenant.items():
        for entry in entries:
            other = owner.setdefault(entry.digest, tenant)
            if other != tenant:
                raise KeyFileError(
                    f"tenants {other!r} and {tenant!r} share a key; a key belongs to one tenant"
                )


class KeyStore:
    """The key files of the tenants that have one, re-read when they change (module docstring).

    Args:
        files: tenant -> key file path.
        poll_s: seconds between checks for a changed file (0: check on every lookup).
        clock: monotonic seconds (for ``poll_s``).
        wall_clock: epoch seconds (for ``not-after``).

    Raises:
        KeyFileError: at construction, a file that is missing, malformed, or shares a key with
            another tenant's (the gateway does not start with a broken key file).
    """

    def __init__(
        self,
        files: Mapping[str, str],
        *,
        poll_s: float = 1.0,
        clock: Callable[[], float],
        wall_clock: Callable[[], float],
    ) -> None:
        self.files = {t: Path(p) for t, p in files.items()}
        self.poll_s = poll_s
        self.clock = clock
        self.wall_clock = wall_clock
        self._stamps: dict[str, tuple[int, int, int] | None] = dict.fromkeys(self.files)
        self._entries: dict[str, list[KeyEntry]] = {t: [] for t in self.files}
        self._next_check_s = -float("inf")
        self.num_reloads = 0
        for tenant in self.files:
            self._entries[tenant] = self._read(tenant)
        _check_unique(self._entries)
        self._next_check_s = self.clock() + self.poll_s

    @property
    def tenants(self) -> frozenset[str]:
        return frozenset(self.files)

    def _stamp(self, tenant: str) -> tuple[int, int, int]:
        st = os.stat(self.files[tenant])  # follows the Secret volume's symlinks
        return st.st_mtime_ns, st.st_ino, st.st_size

    def _read(self, tenant: str) -> list[KeyEntry]:
        path = self.files[tenant]
        try:
            st = os.stat(path)  # follows the Secret volume's symlinks
            # A FIFO or device would block the gateway's event loop on open/read (every route
            # would freeze); a huge file would stall every request.
            if not stat.S_ISREG(st.st_mode):
                raise KeyFileError(f"tenant {tenant!r}: key file {path}: not a regular file")
            if st.st_size > MAX_KEY_FILE_BYTES:
                raise KeyFileError(
                    f"tenant {tenant!r}: key file {path}: {st.st_size} bytes; at most "
                    f"{MAX_KEY_FILE_BYTES}"
                )
            stamp = (st.st_mtime_ns, st.st_ino, st.st_size)
            with open(path, "rb") as handle:
                text = handle.read(MAX_KEY_FILE_BYTES + 1).decode("utf-8", errors="replace")
        except FileNotFoundError as exc:
            raise KeyFileError(
                f"tenant {tenant!r}: key file {path}: {exc.strerror} (make a key into it with "
                f"`wavepp api-key --append {path}`)"
            ) from exc
        except OSError as exc:
            raise KeyFileError(f"tenant {tenant!r}: key file {path}: {exc.strerror}") from exc
        entries = parse_key_file(text, tenant, now_s=self.wall_clock())
        self._stamps[tenant] = stamp
        return entries

    def refresh(self) -> None:
        """Re-read the files that changed, if ``poll_s`` passed since the last check.

        A file that is missing or malformed keeps its tenant's previous keys (logged).
        """
        now = self.clock()
        if now < self._next_check_s:
            return
        self._next_check_s = now + self.poll_s
        for tenant in self.files:
            try:
                if self._stamp(tenant) == self._stamps[tenant]:
                    continue
                candidate = {**self._entries, tenant: self._read(tenant)}
                _check_unique(candidate)
            except KeyFileError as exc:
                log.error("API keys not reloaded, previous keys kept: %s", exc)
                continue
            except OSError as exc:
                log.error(
                    "API keys of tenant %r not reloaded, previous keys kept: %s",
                    tenant,
                    exc.strerror,
                )
                continue
            self._entries = candidate
            self.num_reloads += 1
            log.info("API keys of tenant %r reloaded from %s", tenant, self.files[tenant])

    def lookup(self, key: str) -> str | None:
        """The tenant whose valid key ``key`` is, else None (compares digests in constant time)."""
        self.refresh()
        digest = hash_key(key)
        now_s = self.wall_clock()
        found: str | None = None
        for entries in self._entries.values():
            for entry in entries:
                # NOTE: no early exit: every stored digest is compared.
                if hmac.compare_digest(entry.digest, digest) and entry.is_valid(now_s):
                    found = entry.tenant
        return found


class FailureLimiter:
    """Authentication failures per client: ``burst`` at once, then ``per_s`` per second.

    At most ``max_clients`` clients are tracked (the least recently failing are forgotten).
    """

    def __init__(self, *, burst: int, per_s: float, max_clients: int = 4096) -> None:
        self.burst = burst
        self.per_s = per_s
        self.max_clients = max_clients
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()

    def retry_after_s(self, client: str, now_s: float) -> float:
        """0 when ``client`` may try a key now, else seconds until it may (nothing taken)."""
        bucket = self._buckets.get(client)
        if bucket is None:
            return 0.0
        probe = TokenBucket(bucket.rate_per_s, bucket.capacity, bucket.num_tokens, bucket.last_s)
        return probe.try_take(1, now_s)

    def failed(self, client: str, now_s: float) -> None:
        """Count one failure of ``client``."""
        bucket = self._buckets.pop(client, None) or TokenBucket(self.per_s, float(self.burst))
        bucket.try_take(1, now_s)
        self._buckets[client] = bucket
        while len(self._buckets) > self.max_clients:
            self._buckets.popitem(last=False)


class AuthError(Exception):
    """A request refused by authentication.

    ``status``: 401 (no or no valid key), 403 (the request names another tenant than its key's),
    429 (too many failures from this client; ``retry_after_s``). ``reason``: the metric label
    (``missing``, ``invalid``, ``tenant_mismatch``, ``rate_limited``).
    """

    def __init__(self, status: int, reason: str, message: str, retry_after_s: float = 0.0):
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.retry_after_s = retry_after_s

    def to_json(self) -> dict[str, object]:
        kind = {401: "authentication_error", 403: "permission_error"}.get(
            self.status, "rate_limit_error"
        )
        return {
            "error": {
                "type": kind,
                "field": "authorization",
                "param": "authorization",
                "message": str(self),
            }
        }


class Authenticator:
    """Bearer key -> tenant, with failures rate-limited per client. ``store`` None: open mode.

    ``clock`` is monotonic seconds (the failure buckets).
    """

    def __init__(
        self,
        store: KeyStore | None,
        failures: FailureLimiter,
        *,
        clock: Callable[[], float],
    ) -> None:
        self.store = store
        self.failures = failures
        self.clock = clock

    @property
    def enabled(self) -> bool:
        return self.store is not None

    def authenticate(self, authorization: str | None, client: str) -> str | None:
        """The tenant of the request's key; None in open mode (no tenant has keys).

        Raises:
            AuthError: 429 when ``client`` failed too often; 401 when the header is missing,
                not ``Bearer <key>``, or the key is not valid (the failure is counted).
        """
        if self.store is None:
            return None
        now = self.clock()
        wait_s = self.failures.retry_after_s(client, now)
        if wait_s > 0:
            raise AuthError(
                429,
                "rate_limited",
                "too many failed authentications from this client; retry later",
                retry_after_s=wait_s,
            )
        scheme, _, key = (authorization or "").strip().partition(" ")
        key = key.strip()
        if not authorization:
            reason, message = "missing", "missing API key: send Authorization: Bearer <key>"
            tenant = None
        elif scheme.lower() != "bearer" or not key:
            reason, message = "invalid", "malformed Authorization header: use Bearer <key>"
            tenant = None
        else:
            reason, message = "invalid", "invalid API key"
            tenant = self.store.lookup(key)
        if tenant is None:
            self.failures.failed(client, now)
            raise AuthError(401, reason, message)
        return tenant

    @staticmethod
    def check_claim(key_tenant: str, claimed: object) -> None:
        """Refuse a request that names a tenant other than its key's (absent: fine).

        Raises:
            AuthError: 403, without saying whether the named tenant exists.
        """
        if claimed is not None and claimed != key_tenant:
            raise AuthError(
                403, "tenant_mismatch", "the tenant named in the request is not the API key's"
            )


def authenticator_for(
    key_files: Mapping[str, str],
    *,
    poll_s: float,
    failure_burst: int,
    failures_per_s: float,
    clock: Callable[[], float],
    wall_clock: Callable[[], float],
) -> Authenticator:
    """The gateway's authenticator: on when any tenant has a key file (``key_files``: tenant ->
    path), else open mode.

    Raises:
        KeyFileError: a key file that is missing or malformed, or a key shared by two tenants.
    """
    store = None
    if key_files:
        store = KeyStore(key_files, poll_s=poll_s, clock=clock, wall_clock=wall_clock)
    return Authenticator(
        store, FailureLimiter(burst=failure_burst, per_s=failures_per_s), clock=clock
    )
