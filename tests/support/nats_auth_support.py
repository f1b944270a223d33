"""Decentralised NATS auth for tests, made with the product's own trust root
(``wavepp.api.natsauth``): a nats-server config in operator mode (memory resolver, the account
and the system account preloaded, JetStream on) and user ``.creds`` files, as ``nsc`` would
write them. Nothing secret is committed: keys are made at test time."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from wavepp.api.natsauth import TrustRoot, mint_user_creds
from wavepp.api.permissions import NatsUser, Permissions


@dataclass(frozen=True)
class AuthFiles:
    server_config: str  # nats-server -c
    creds: str  # a user of the trusted account: may publish/subscribe anything
    limited_creds: str  # a user allowed only wavepp.p1.> and _INBOX.>
    foreign_creds: str  # a user signed by an account the server does not know


def make_auth_files(folder: Path, store_dir: Path) -> AuthFiles:
    """Operator -> account (JetStream allowed) -> users; plus a stranger account's user."""
    folder.mkdir(parents=True, exist_ok=True)
    root = TrustRoot.new()
    stranger = TrustRoot.new()  # another operator's account: the server does not trust it

    def user(seed: str, name: str, allow: tuple[str, ...]) -> str:
        permissions = Permissions(publish=allow, subscribe=allow, allow_responses=False)
        path = folder / f"{name}.creds"
        path.write_text(mint_user_creds(seed, NatsUser(name, "stage", permissions)))
        return str(path)

    creds = user(root.account_seed, "stage", (">",))
    limited = user(root.account_seed, "tenant-p1", ("wavepp.p1.>", "_INBOX.>"))
    foreign = user(stranger.account_seed, "intruder", (">",))
    config = folder / "server.conf"
    config.write_text(root.server_config(str(store_dir)))
    return AuthFiles(str(config), creds, limited, foreign)
