"""Decentralised NATS auth for tests: operator, account and user JWTs signed with nkeys.

Writes a nats-server config (operator mode, memory resolver with the account preloaded,
JetStream on for the account) and user ``.creds`` files, as ``nsc`` would. Nothing secret is
committed: keys are made at test time. JWT v2 claims (alg ``ed25519-nkey``), as documented for
NATS decentralised JWT authentication."""

from __future__ import annotations

import base64
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nkeys


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _keypair(prefix: int) -> nkeys.KeyPair:
    return nkeys.from_seed(nkeys.encode_seed(os.urandom(32), prefix))


def _jwt(issuer: nkeys.KeyPair, subject: str, name: str, nats: dict[str, Any]) -> str:
    header = {"typ": "JWT", "alg": "ed25519-nkey"}
    claims = {
        "jti": _b64(os.urandom(16)),
        "iat": int(time.time()),
        "iss": issuer.public_key.decode(),
        "name": name,
        "sub": subject,
        "nats": nats | {"version": 2},
    }
    signing_input = f"{_b64(json.dumps(header).encode())}.{_b64(json.dumps(claims).encode())}"
    return f"{signing_input}.{_b64(issuer.sign(signing_input.encode()))}"


def _creds(user_jwt: str, seed: bytes) -> str:
    return (
        "-----BEGIN NATS USER JWT-----\n"
        f"{user_jwt}\n"
        "------END NATS USER JWT------\n\n"
        "-----BEGIN USER NKEY SEED-----\n"
        f"{seed.decode()}\n"
        "------END USER NKEY SEED------\n"
    )


@dataclass(frozen=True)
class AuthFiles:
    server_config: str  # nats-server -c
    creds: str  # a user of the trusted account: may publish/subscribe anything
    limited_creds: str  # a user allowed only wavepp.p1.> and _INBOX.>
    foreign_creds: str  # a user signed by an account the server does not know


_UNLIMITED = {"subs": -1, "data": -1, "payload": -1}


def make_auth_files(folder: Path, store_dir: Path) -> AuthFiles:
    """Operator -> account (JetStream allowed) -> users; plus a stranger account's user."""
    folder.mkdir(parents=True, exist_ok=True)
    operator = _keypair(nkeys.PREFIX_BYTE_OPERATOR)
    account = _keypair(nkeys.PREFIX_BYTE_ACCOUNT)
    stranger = _keypair(nkeys.PREFIX_BYTE_ACCOUNT)
    system = _keypair(nkeys.PREFIX_BYTE_ACCOUNT)  # the server's own account (JetStream needs it)
    operator_jwt = _jwt(
        operator, operator.public_key.decode(), "test-operator", {"type": "operator"}
    )
    limits = {
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
    account_jwt = _jwt(
        operator, account.public_key.decode(), "wavepp", {"type": "account", "limits": limits}
    )
    system_jwt = _jwt(operator, system.public_key.decode(), "SYS", {"type": "account"})

    def user(issuer: nkeys.KeyPair, name: str, perms: dict[str, Any]) -> str:
        key = _keypair(nkeys.PREFIX_BYTE_USER)
        jwt = _jwt(issuer, key.public_key.decode(), name, {"type": "user", **_UNLIMITED, **perms})
        path = folder / f"{name}.creds"
        path.write_text(_creds(jwt, key.seed))
        return str(path)

    creds = user(account, "stage", {"pub": {}, "sub": {}})
    limited = user(
        account,
        "tenant-p1",
        {
            "pub": {"allow": ["wavepp.p1.>", "_INBOX.>"]},
            "sub": {"allow": ["wavepp.p1.>", "_INBOX.>"]},
        },
    )
    foreign = user(stranger, "intruder", {"pub": {}, "sub": {}})
    config = folder / "server.conf"
    config.write_text(
        f"operator: {operator_jwt}\n"
        "resolver: MEMORY\n"
        f"system_account: {system.public_key.decode()}\n"
        f"resolver_preload: {{\n  {account.public_key.decode()}: {account_jwt}\n"
        f"  {system.public_key.decode()}: {system_jwt}\n}}\n"
        f"jetstream: {{ store_dir: {json.dumps(str(store_dir))} }}\n"
    )
    return AuthFiles(str(config), creds, limited, foreign)
