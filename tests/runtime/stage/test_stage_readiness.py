"""A stage's ``/readyz`` means serving with its group: two real ``wavepp stage`` processes (a
nats-server with JetStream for their rendezvous bucket, the emulated engine), both ready; one
SIGKILLed: the survivor answers ``/readyz`` 503 within 2 s (``rendezvous.PeerPresence``), while
``/healthz`` stays 200 (the process is fine: it waits for the next epoch). ``PeerPresence``'s
rules are checked on their own first."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from http_support import http_status
from stage_support import emulated_two_stages

from wavepp.runtime.stage.rendezvous import PEER_BEAT_S, PEER_SILENCE_S, PeerPresence
from wavepp.runtime.transport.natsio import EmbeddedNatsServer, free_port

READY_LOST_WITHIN_S = 2.0


def test_peer_presence_counts_a_peer_gone_only_after_its_beat_stops_changing() -> None:
    presence = PeerPresence([0, 2], now=100.0, silence_s=1.0)
    assert presence.missing(100.9) == []  # a grace period from the epoch's start
    presence.observe(0, b"1", 100.5)
    presence.observe(2, None, 100.5)  # no beat yet: not seen
    assert presence.missing(101.2) == [2]
    presence.observe(0, b"1", 101.6)  # the same value again: not a beat
    assert presence.missing(101.6) == [0, 2]
    presence.observe(0, b"2", 101.7)
    presence.observe(2, b"1", 101.7)
    assert presence.missing(102.6) == []
    with pytest.raises(ValueError, match="silence_s"):
        PeerPresence([1], now=0.0, silence_s=0)
    assert PEER_SILENCE_S + 2 * PEER_BEAT_S < READY_LOST_WITHIN_S


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.timeout(180)
def test_stage_whose_group_is_gone_answers_readyz_503_within_2_s(tmp_path: Path) -> None:
    config = tmp_path / "runtime-config.json"
    config.write_text(emulated_two_stages("ready").model_dump_json())
    dist_url = f"tcp://127.0.0.1:{free_port()}"
    health = [free_port(), free_port()]
    procs: list[subprocess.Popen[bytes]] = []
    with EmbeddedNatsServer(jetstream=True) as server:
        try:
            for rank in range(2):
                log = (tmp_path / f"stage{rank}.log").open("wb")
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "wavepp.cli", "stage", "--runtime-config",
                         str(config), "--rank", str(rank), "--nats-url", server.url,
                         "--dist-url", dist_url, "--health-port", str(health[rank]),
                         "--health-host", "127.0.0.1"],
                        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                    )
                )  # fmt: skip
            deadline = time.monotonic() + 120
            while not all(http_status(f"http://127.0.0.1:{p}/readyz") == 200 for p in health):
                assert all(p.poll() is None for p in procs), (tmp_path / "stage0.log").read_text()
                assert time.monotonic() < deadline, (tmp_path / "stage1.log").read_text()
                time.sleep(0.2)
            time.sleep(2 * PEER_SILENCE_S)  # ready stays ready: no peer counted gone meanwhile
            assert http_status(f"http://127.0.0.1:{health[0]}/readyz") == 200
            os.kill(procs[1].pid, signal.SIGKILL)
            killed = time.monotonic()
            while http_status(f"http://127.0.0.1:{health[0]}/readyz") != 503:
                assert time.monotonic() - killed < 10, "stage 0 stayed ready"
                time.sleep(0.05)
            lost_s = time.monotonic() - killed
            print(f"stage 0 /readyz 503 {lost_s:.2f} s after stage 1's SIGKILL")
            assert lost_s < READY_LOST_WITHIN_S
            assert http_status(f"http://127.0.0.1:{health[0]}/healthz") == 200
            assert "group gone" in (tmp_path / "stage0.log").read_text()
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in procs:
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
