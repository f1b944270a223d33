"""Hostile input to `wavepp up` and `wavepp validate`: a forged epoch entry, key files that are
FIFOs or huge, YAML alias bombs and deep nesting, the stages' store on a loopback URL. Each is
refused in one line or read harmlessly; none hangs, crashes or listens beyond loopback."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from wavepp.api.spec import SpecFileError, read_spec_mapping
from wavepp.gateway.auth import KeyFileError, authenticator_for
from wavepp.runtime.stage.rendezvous import epoch_of


def test_a_forged_epoch_entry_is_read_as_a_fresh_epoch_not_a_crash() -> None:
    """A holder of a stage's NATS credentials wrote `epoch=abc` into the rendezvous bucket:
    every restarted stage crash-looped on int('abc') until wavepp up gave up on the service."""
    assert epoch_of(b"3", revision=40) == 3
    for forged in (b"abc", b"-1", b"0", b"99999999999", b"\xff", b"", None):
        assert epoch_of(forged, revision=40) == 40  # above every epoch written before it


def _authenticator(files: dict[str, str]) -> object:
    return authenticator_for(
        files,
        poll_s=1.0,
        failure_burst=1,
        failures_per_s=1.0,
        clock=time.monotonic,
        wall_clock=time.time,
    )


def test_a_key_file_that_is_a_fifo_is_refused_not_waited_on(tmp_path: Path) -> None:
    """A FIFO swapped in for a key file froze the gateway's event loop (every route timed out);
    at start it hung wavepp up."""
    fifo = tmp_path / "acme.keys"
    os.mkfifo(fifo)
    started = time.monotonic()
    with pytest.raises(KeyFileError, match="not a regular file"):
        _authenticator({"acme": str(fifo)})
    assert time.monotonic() - started < 5


def test_a_huge_key_file_is_refused(tmp_path: Path) -> None:
    big = tmp_path / "acme.keys"
    big.write_text("sha256:" + "0" * 64 + "\n" * (1 << 17))
    with pytest.raises(KeyFileError, match="at most"):
        _authenticator({"acme": str(big)})


def test_a_yaml_alias_bomb_and_deep_nesting_are_one_line_errors(tmp_path: Path) -> None:
    """`wavepp validate` refuses a 9 x 9 alias bomb (~4 x 10**8 values) without walking it, and
    100,000 nested lists, in one line each (no RecursionError traceback)."""
    lines = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    for level in range(1, 9):
        refs = ", ".join([f"*a{level - 1}"] * 9)
        lines.append(f"a{level}: &a{level} [{refs}]")
    lines.append("engineOptions: {bomb: *a8}")
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(lines))
    started = time.monotonic()
    with pytest.raises(SpecFileError, match="alias"):
        read_spec_mapping(bomb)
    assert time.monotonic() - started < 5
    deep = tmp_path / "deep.yaml"
    deep.write_text("[" * 100_000)
    with pytest.raises(SpecFileError):
        read_spec_mapping(deep)


def _listening_addresses(port: int) -> set[str]:
    """Local addresses with a socket listening on ``port`` (IPv4, from /proc/net/tcp)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
            found.add(".".join(str(int(address[i : i + 2], 16)) for i in (6, 4, 2, 0)))
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="Linux /proc/net/tcp")
def test_the_stages_store_on_a_loopback_url_listens_on_loopback_only() -> None:
    """torch's TCPStore (rank 0's --dist-url) listened on every interface, unauthenticated:
    another host could grow it by 8 MiB a key or poison the next re-form's keys."""
    import datetime

    from wavepp.runtime.stage.rendezvous import StageGroupFactory
    from wavepp.runtime.transport.natsio import free_port

    port = free_port()
    factory = StageGroupFactory(f"tcp://127.0.0.1:{port}", 0, 2, "gloo", timeout_s=5.0)
    store = factory._store()  # noqa: SLF001 - the store rank 0 hosts
    store.set("k", "v")
    assert _listening_addresses(port) == {"127.0.0.1"}
    import torch.distributed as dist

    client = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=5))
    assert client.get("k") == b"v"
