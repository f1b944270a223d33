"""NATS decentralised auth (operator / account / user JWTs, .creds files) with a real server.

``--nats-creds`` connects to a real server: nats-py signs the server's nonce with the ``nkeys``
package, an optional extra, so the dependency is ``nats-py[nkeys]``; a test that replaced
``nats.connect`` could not see it missing."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from nats_auth_support import AuthFiles, make_auth_files  # noqa: E402

from wavepp.runtime.transport.natsio import EmbeddedNatsServer, connect, flush_in_order  # noqa: E402


@pytest.fixture(scope="module")
def auth_files(tmp_path_factory: pytest.TempPathFactory) -> AuthFiles:
    folder = tmp_path_factory.mktemp("auth")
    return make_auth_files(folder, folder / "js")


async def _round_trip(url: str, creds: str | None, subject: str = "wavepp.p1.echo") -> str:
    """'ok' after a request-reply round trip on ``subject``, else the error's text."""
    try:
        nc = await asyncio.wait_for(
            connect(url, name="auth-test", creds=creds, allow_reconnect=False, connect_timeout=2),
            timeout=10,
        )
    except Exception as exc:  # noqa: BLE001 - the refusal is the result
        return str(exc)
    try:

        async def echo(msg) -> None:  # noqa: ANN001
            await msg.respond(msg.data)

        await nc.subscribe(subject, cb=echo)
        reply = await nc.request(subject, b"ping", timeout=2)
        return "ok" if reply.data == b"ping" else "bad reply"
    finally:
        await nc.close()


async def test_only_users_of_the_trusted_account_get_in(
    auth_files: AuthFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WAVEPP_NATS_CREDS", raising=False)
    with EmbeddedNatsServer(config_file=auth_files.server_config) as server:
        assert await _round_trip(server.url, auth_files.creds) == "ok"
        no_creds = await _round_trip(server.url, None)
        foreign = await _round_trip(server.url, auth_files.foreign_creds)
    assert "Authorization Violation" in no_creds, no_creds
    assert "Authorization Violation" in foreign, foreign


async def test_subject_permissions_confine_a_user_to_its_pipeline(auth_files: AuthFiles) -> None:
    """A user allowed only ``wavepp.p1.>`` works there; its publish to another pipeline's plan
    subject is refused by the server and never reaches that pipeline's stages."""
    with EmbeddedNatsServer(config_file=auth_files.server_config) as server:
        assert await _round_trip(server.url, auth_files.limited_creds) == "ok"
        errors: list[str] = []

        async def on_error(exc: Exception) -> None:
            errors.append(str(exc))

        other = await connect(server.url, name="p2-stage", creds=auth_files.creds)
        got: list[bytes] = []

        async def on_plan(msg) -> None:  # noqa: ANN001
            got.append(msg.data)

        await other.subscribe("wavepp.p2.plan", cb=on_plan)
        await flush_in_order(other)
        limited = await connect(
            server.url, name="p1-scheduler", creds=auth_files.limited_creds, error_cb=on_error
        )
        await limited.publish("wavepp.p2.plan", b"forged plan")
        await flush_in_order(limited)
        await asyncio.sleep(0.3)
        await limited.close()
        await other.close()
    assert got == []
    assert any("permissions violation" in e and "wavepp.p2.plan" in e for e in errors), errors


async def test_nats_auth_files_carry_the_accounts_store_limit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``wavepp nats-auth files DIR --jetstream-max-bytes N``: a server including its
    ``auth.conf`` reports N as the account's disk limit to a user minted from its
    ``account.seed`` (what the gateway exports); a negative N is refused, naming the flag."""
    from wavepp.api.natsauth import mint_user_creds
    from wavepp.api.permissions import gateway_user
    from wavepp.cli import main

    limit = 3 * 2**20
    assert (
        main(["nats-auth", "files", str(tmp_path / "auth"), "--jetstream-max-bytes", str(limit)])
        == 0
    )
    assert main(["nats-auth", "files", str(tmp_path / "bad"), "--jetstream-max-bytes", "-1"]) == 2
    assert "--jetstream-max-bytes: -1: must be >= 0" in capsys.readouterr().err
    seed = (tmp_path / "auth" / "account.seed").read_text().strip()
    creds = tmp_path / "gateway.creds"
    creds.write_text(mint_user_creds(seed, gateway_user("p", ["p-r0"], namespace="local")))
    config = tmp_path / "server.conf"
    config.write_text(
        (tmp_path / "auth" / "auth.conf").read_text()
        + f"jetstream: {{ store_dir: {json.dumps(str(tmp_path / 'js'))} }}\n"
    )
    with EmbeddedNatsServer(config_file=str(config)) as server:
        nc = await connect(server.url, name="gateway", creds=str(creds), allow_reconnect=False)
        try:
            info = await nc.jetstream().account_info()
        finally:
            await nc.close()
    assert info.limits.max_storage == limit
