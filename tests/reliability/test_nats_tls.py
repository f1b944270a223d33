"""NATS over TLS (mutual): a real nats-server that requires and verifies client certificates."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from nats_tls_support import TLSFiles, make_tls_files  # noqa: E402

from wavepp.api.spec import CONFIG_EXIT_CODE
from wavepp.cli import main as cli_main  # noqa: E402
from wavepp.runtime.transport.natsio import TLS_ENV, EmbeddedNatsServer, NatsTLS, connect  # noqa: E402


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TLSFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


async def _try_connect(url: str, tls: NatsTLS | None) -> str:
    """'ok' after a request-reply round trip, else the error's type name."""
    try:
        nc = await asyncio.wait_for(
            connect(url, name="tls-test", tls=tls, allow_reconnect=False, connect_timeout=2),
            timeout=10,
        )
    except Exception as exc:  # noqa: BLE001 - the kind of failure is the result
        return type(exc).__name__
    try:

        async def echo(msg) -> None:  # noqa: ANN001
            await msg.respond(msg.data)

        await nc.subscribe("echo", cb=echo)
        reply = await nc.request("echo", b"ping", timeout=2)
        return "ok" if reply.data == b"ping" else "bad reply"
    finally:
        await nc.close()


async def test_only_clients_with_a_certificate_of_the_ca_get_in(
    tls_files: TLSFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in TLS_ENV.values():
        monkeypatch.delenv(name, raising=False)
    f = tls_files
    with EmbeddedNatsServer(tls=(f.server_cert, f.server_key, f.ca)) as server:
        plain_url = f"nats://127.0.0.1:{server.port}"
        assert await _try_connect(server.url, NatsTLS(f.ca, f.client_cert, f.client_key)) == "ok"
        # The environment the --nats-tls-* flags set works the same way.
        monkeypatch.setenv(TLS_ENV["ca"], f.ca)
        monkeypatch.setenv(TLS_ENV["cert"], f.client_cert)
        monkeypatch.setenv(TLS_ENV["key"], f.client_key)
        assert await _try_connect(server.url, None) == "ok"
        for name in TLS_ENV.values():
            monkeypatch.delenv(name)
        refused = {
            "plain TCP": await _try_connect(plain_url, None),
            "TLS without a client cert": await _try_connect(server.url, NatsTLS(f.ca)),
            "client cert of another CA": await _try_connect(
                server.url, NatsTLS(f.ca, f.rogue_client_cert, f.rogue_client_key)
            ),
            "server not trusted": await _try_connect(
                server.url, NatsTLS(f.rogue_ca, f.client_cert, f.client_key)
            ),
        }
    assert all(result != "ok" for result in refused.values()), refused


@pytest.mark.parametrize("in_operator_pod", [False, True])
def test_tls_flags_are_checked_before_anything_starts(
    tls_files: TLSFiles,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    in_operator_pod: bool,
) -> None:
    """A bad TLS flag is a config error: exit 2 from a shell, CONFIG_EXIT_CODE (78) in the
    operator's pods (their $WAVEPP_CONFIG_EXIT_CODE)."""
    expected_code = CONFIG_EXIT_CODE if in_operator_pod else 2
    if in_operator_pod:
        monkeypatch.setenv("WAVEPP_CONFIG_EXIT_CODE", str(CONFIG_EXIT_CODE))
    else:
        monkeypatch.delenv("WAVEPP_CONFIG_EXIT_CODE", raising=False)
    base = [
        "stage",
        "--runtime-config",
        str(tmp_path / "unused.json"),
        "--nats-url",
        "tls://127.0.0.1:1",
        "--dist-url",
        "tcp://127.0.0.1:1",
        "--rank",
        "0",
    ]
    (tmp_path / "unused.json").write_text(
        '{"model": {"name": "tiny-llama"}, "engine": "torch", "num_stages": 1}'
    )
    cases = {
        "--nats-tls-ca": ["--nats-tls-cert", tls_files.client_cert],
        "no such file": ["--nats-tls-ca", str(tmp_path / "missing.crt")],
        "go together": ["--nats-tls-ca", tls_files.ca, "--nats-tls-cert", tls_files.client_cert],
        "cannot load": [
            "--nats-tls-ca",
            tls_files.ca,
            "--nats-tls-cert",
            tls_files.client_cert,
            "--nats-tls-key",
            tls_files.rogue_client_key,
        ],
    }
    for expected, flags in cases.items():
        assert cli_main([*base, *flags]) == expected_code, flags
        assert expected in capsys.readouterr().err, flags


def test_env_without_a_ca_is_an_error() -> None:
    assert NatsTLS.from_env({}) is None
    with pytest.raises(ValueError, match=TLS_ENV["ca"]):
        NatsTLS.from_env({TLS_ENV["cert"]: "c.crt", TLS_ENV["key"]: "c.key"})
    tls = NatsTLS.from_env({TLS_ENV["ca"]: "ca.crt"})
    assert tls == NatsTLS("ca.crt") and tls.to_env() == {TLS_ENV["ca"]: "ca.crt"}
