"""The handoff wire codec: frames round-trip over a socket, oversize and truncated frames are
refused with the cause, parameters parse or name the bad field, tokens bind request and expiry."""

from __future__ import annotations

import socket

import pytest

from wavepp.api.kv_handoff import (
    HANDOFF_DOMAIN,
    HandoffError,
    HandoffParams,
    StageEndpoint,
    read_frame,
    read_json,
    token_payload,
    write_frame,
    write_json,
)
from wavepp.api.signing import BusKey
from wavepp.runtime.serving.handoff import handoff_token, kv_transfer_params


def test_frames_round_trip_and_limits() -> None:
    a, b = socket.socketpair()
    with a, b:
        write_json(a, {"op": "pull", "n": 3})
        write_frame(a, b"\x00\x01" * 1000)
        assert read_json(b) == {"op": "pull", "n": 3}
        assert bytes(read_frame(b)) == b"\x00\x01" * 1000
        write_frame(a, b"x" * 100)
        with pytest.raises(HandoffError, match="exceeds the limit of 10"):
            read_frame(b, limit=10)
    a, b = socket.socketpair()
    with b:
        a.sendall((50).to_bytes(4, "big") + b"short")
        a.close()
        with pytest.raises(HandoffError, match="closed after 5 of 50 bytes"):
            read_frame(b)
    a, b = socket.socketpair()
    with a, b:
        write_frame(a, b"[1, 2]")
        with pytest.raises(HandoffError, match="not a JSON object"):
            read_json(b)


def test_params_round_trip_and_validation() -> None:
    key = BusKey.generate().for_replica("p")
    stages = (StageEndpoint("127.0.0.1:5", 0, 2), StageEndpoint("127.0.0.1:6", 2, 4))
    ktp = kv_transfer_params(key, "r1", 70, 1234.5678, stages)
    assert ktp["do_remote_prefill"] is True and ktp["do_remote_decode"] is False
    params = HandoffParams.from_json(ktp["wavepp_handoff"])
    assert params.stages == stages and params.num_tokens == 70 and params.expires == 1234.568
    assert params.token == handoff_token(key, "r1", 1234.5678)
    bad = dict(ktp["wavepp_handoff"], stages=[["a:1", 0, 2], ["b:2", 3, 4]])
    with pytest.raises(HandoffError, match="tile"):
        HandoffParams.from_json(bad)
    with pytest.raises(HandoffError, match="malformed"):
        HandoffParams.from_json({"request_id": "r"})
    with pytest.raises(HandoffError, match="num_tokens=0"):
        HandoffParams.from_json(dict(ktp["wavepp_handoff"], num_tokens=0))


def test_token_binds_request_expiry_and_key() -> None:
    key = BusKey.generate().for_replica("p")
    token = handoff_token(key, "r1", 10.0)
    assert token == key.mac_bytes(HANDOFF_DOMAIN, token_payload("r1", 10.0)).hex()
    assert token != handoff_token(key, "r2", 10.0)
    assert token != handoff_token(key, "r1", 11.0)
    assert token != handoff_token(BusKey.generate().for_replica("p"), "r1", 10.0)
