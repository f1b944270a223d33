"""NATS decentralised auth: a trust root (operator, account, system account) and user ``.creds``.

The nats-server runs in operator mode with a memory resolver that preloads the one WavePP account
(JetStream enabled) and the system account; each component gets a user JWT signed by the account
key, carrying that component's permissions from ``wavepp.api.permissions``, in a ``.creds`` file
(the format ``nsc`` writes; ``nats.connect(user_credentials=...)`` reads it). A client without a
user JWT of that account is refused (``Authorization Violation``).

Formats: JWT v2 claims, header ``{"typ": "JWT", "alg": "ed25519-nkey"}``, signed with the
issuer's nkey (the ``nkeys`` package). Seeds are the secret; keep files holding them mode 0600.
No I/O here except randomness for new keys.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import time
from dataclasses import dataclass
from typing import Any

import nkeys

from wavepp.api.permissions import NatsUser

# The account's limits: unlimited within the server's own (JetStream: the server's max store).
_ACCOUNT_LIMITS: dict[str, Any] = {
    "subs": -1,
    "data": -1,
    "payload": -1,
    "imports": -1,
    "exports": -1,
    "wildcards": True,
    "conn": -1,
    "leaf": -1,
    "mem_storage": -1,
    "disk_storage": -1,
    "streams": -1,
    "consumer": -1,
}
_USER_LIMITS: dict[str, Any] = {"subs": -1, "data": -1, "payload": -1}


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _new_keypair(prefix: int) -> nkeys.KeyPair:
    return nkeys.from_seed(nkeys.encode_seed(os.urandom(32), prefix))


def _jwt(
    issuer: nkeys.KeyPair,
    subject: str,
    name: str,
    nats_claims: dict[str, Any],
    *,
    issued_at: int | None = None,
) -> str:
    header = {"typ": "JWT", "alg": "ed25519-nkey"}
    claims: dict[str, Any] = {
        "iat": int(time.time()) if issued_at is None else issued_at,
        "iss": issuer.public_key.decode(),
        "name": name,
        "sub": subject,
        "nats": nats_claims | {"version": 2},
    }
    digest = hashlib.sha256(json.dumps(claims, sort_keys=True).encode()).digest()
    claims["jti"] = base64.b32encode(digest).decode().rstrip("=")
    signing_input = f"{_b64(json.dumps(header).encode())}.{_b64(json.dumps(claims).encode())}"
    return f"{signing_input}.{_b64(issuer.sign(signing_input.encode()))}"


def creds_text(user_jwt: str, seed: bytes) -> str:
    """A ``.creds`` file: the user JWT and its nkey seed, in the armour ``nsc`` writes."""
    return (
        "-----BEGIN NATS USER JWT-----\n"
        f"{user_jwt}\n"
        "------END NATS USER JWT------\n\n"
        "-----BEGIN USER NKEY SEED-----\n"
        f"{seed.decode()}\n"
        "------END USER NKEY SEED------\n"
    )


def creds_user_name(text: str) -> str | None:
    """The ``name`` claim of the user JWT in a ``.creds`` file's text (unverified; the server
    verifies), or None when the text holds no readable JWT."""
    lines = [line.strip() for line in text.splitlines()]
    try:
        jwt = lines[lines.index("-----BEGIN NATS USER JWT-----") + 1]
        payload = jwt.split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    except (ValueError, IndexError):
        return None
    name = claims.get("name") if isinstance(claims, dict) else None
    return name if isinstance(name, str) else None


@dataclass(frozen=True)
class TrustRoot:
    """The operator, the WavePP account and the system account, as seeds (secret) and JWTs.

    ``new()`` makes fresh keys; ``server_config()`` is the nats-server config text that trusts
    them; ``user_creds(user)`` mints a component's ``.creds``. Only ``account_seed`` is needed to
    mint users (the operator of a cluster keeps that one; the server needs only the JWTs).
    """

    operator_jwt: str
    account_jwt: str
    account_public: str
    account_seed: str
    system_jwt: str
    system_public: str

    @classmethod
    def new(cls, *, max_store_bytes: int | None = None) -> TrustRoot:
        """Fresh keys. ``max_store_bytes``: the account's JetStream disk limit in bytes (the
        server enforces it on the account, and every user reads it back in its JetStream
        account info's ``limits.max_storage``); None: unlimited within the server's own.

        Raises:
            ValueError: ``max_store_bytes`` is not a positive number of bytes.
        """
        if max_store_bytes is not None and max_store_bytes <= 0:
            raise ValueError(f"max_store_bytes: {max_store_bytes}, must be > 0 (or None)")
        limits = dict(_ACCOUNT_LIMITS)
        if max_store_bytes is not None:
            limits["disk_storage"] = max_store_bytes
        operator = _new_keypair(nkeys.PREFIX_BYTE_OPERATOR)
        account = _new_keypair(nkeys.PREFIX_BYTE_ACCOUNT)
        system = _new_keypair(nkeys.PREFIX_BYTE_ACCOUNT)
        op_public = operator.public_key.decode()
        return cls(
            operator_jwt=_jwt(operator, op_public, "wavepp-operator", {"type": "operator"}),
            account_jwt=_jwt(
                operator,
                account.public_key.decode(),
                "wavepp",
                {"type": "account", "limits": limits},
            ),
            account_public=account.public_key.decode(),
            account_seed=account.seed.decode(),
            system_jwt=_jwt(operator, system.public_key.decode(), "SYS", {"type": "account"}),
            system_public=system.public_key.decode(),
        )

    def auth_config(self) -> str:
        """The auth part of a nats-server config (operator mode, memory resolver): include it
        in a config that sets JetStream, or use ``server_config``."""
        return (
            f"operator: {self.operator_jwt}\n"
            "resolver: MEMORY\n"
            f"system_account: {self.system_public}\n"
            "resolver_preload: {\n"
            f"  {self.account_public}: {self.account_jwt}\n"
            f"  {self.system_public}: {self.system_jwt}\n"
            "}\n"
        )

    def server_config(self, store_dir: str, *, max_file_store_bytes: int | None = None) -> str:
        """A whole nats-server config: this trust root and JetStream on ``store_dir`` (at most
        ``max_file_store_bytes`` on disk when given)."""
        limit = f", max_file_store: {max_file_store_bytes}" if max_file_store_bytes else ""
        return self.auth_config() + f"jetstream: {{ store_dir: {json.dumps(store_dir)}{limit} }}\n"

    def user_creds(self, user: NatsUser) -> str:
        """A ``.creds`` for ``user``: a new user key, a JWT signed by the account with the
        user's permissions."""
        return mint_user_creds(self.account_seed, user)


def derived_user_creds(account_seed: str, user: NatsUser) -> str:
    """A ``.creds`` for ``user`` that is a function of the account seed and the user alone: the
    user key is derived from the seed and the user's name (HMAC-SHA256), the JWT carries a
    fixed issue time, and ed25519 signatures are deterministic. So a controller can render it
    at every reconcile without churn; the text changes only when the permissions do. Whoever
    holds the account seed can mint any user anyway, so the derivation exposes nothing more.

    Raises:
        nkeys.ErrInvalidSeed: ``account_seed`` is not an account nkey seed.
    """
    account = nkeys.from_seed(account_seed.encode())
    raw = hmac.new(account_seed.encode(), f"wavepp-user:{user.name}".encode(), "sha256").digest()
    key = nkeys.from_seed(nkeys.encode_seed(raw, nkeys.PREFIX_BYTE_USER))
    claims = {"type": "user", **_USER_LIMITS, **user.permissions.to_jwt_claims()}
    jwt = _jwt(account, key.public_key.decode(), user.name, claims, issued_at=0)
    return creds_text(jwt, key.seed)


def mint_user_creds(account_seed: str, user: NatsUser) -> str:
    """A ``.creds`` for ``user``, signed by the account whose seed is ``account_seed``.

    Raises:
        nkeys.ErrInvalidSeed: ``account_seed`` is not an account nkey seed.
    """
    account = nkeys.from_seed(account_seed.encode())
    key = _new_keypair(nkeys.PREFIX_BYTE_USER)
    claims = {"type": "user", **_USER_LIMITS, **user.permissions.to_jwt_claims()}
    jwt = _jwt(account, key.public_key.decode(), user.name, claims)
    return creds_text(jwt, key.seed)
