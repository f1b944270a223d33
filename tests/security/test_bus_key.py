"""The bus key: tags, per-replica keys, where processes find it, and a bad one at the CLI."""

from __future__ import annotations

from pathlib import Path

import pytest
from gateway_support import tiny_gateway_config
from pydantic import BaseModel

from wavepp.api.messages import MicroBatchPlan, PlannedChunk
from wavepp.api.prefill import Heartbeat
from wavepp.api.signing import BusKey
from wavepp.cli import main as cli_main
from wavepp.gateway.config import ReplicaInfo
from wavepp.gateway.tenants import TenantPolicy
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.model_config import ModelConfig
from wavepp.runtime.transport import buskey
from wavepp.runtime.transport.buskey import BusKeyError, ensure_bus_key, load_bus_key

KEY = BusKey(bytes(range(32)))


def _plan(**update: object) -> MicroBatchPlan:
    plan = MicroBatchPlan(
        microbatch_id=7,
        chunks=[
            PlannedChunk(
                request_id="t.r1@i", chunk_index=0, context_offset=0, token_ids=[1, 2], is_last=True
            )
        ],
        epoch="e" * 16,
    )
    return plan.model_copy(update=update) if update else plan


def test_a_tag_covers_every_field_and_the_message_type() -> None:
    key = KEY.for_replica("p0")
    signed = key.sign(_plan())
    assert key.verify(signed) and len(signed.mac) == 32
    assert key.verify(MicroBatchPlan.model_validate_json(signed.model_dump_json()))  # over the wire
    for update in ({"microbatch_id": 8}, {"epoch": "f" * 16}, {"published_at_s": 1.0}):
        assert not key.verify(signed.model_copy(update=update)), update
    chunk = signed.chunks[0].model_copy(update={"token_ids": [1, 3]})
    assert not key.verify(signed.model_copy(update={"chunks": [chunk]}))
    assert not KEY.for_replica("p1").verify(signed)  # another replica's key
    assert not key.verify(_plan())  # unsigned
    beat = Heartbeat(pipeline="p0", ready=True, num_stages_formed=1, num_inflight=0, instance="i")
    assert key.mac(beat) != key.mac(beat.model_copy(update={"ready": False}))


def test_sign_json_is_the_signed_message_serialised_once() -> None:
    key = KEY.for_replica("p0")
    plan = _plan(traceparent="00-ab-cd-01")
    signed, data = key.sign_json(plan)
    assert signed == key.sign(plan) and key.verify(signed)
    assert data == signed.model_dump_json().encode()  # mac is the plan's last field
    assert key.verify(MicroBatchPlan.model_validate_json(data))

    class MacFirst(BaseModel):
        mac: str = ""
        value: int = 0

    # mac not the last field, or the only one: the JSON still parses to the signed copy.
    signed_first, first_data = key.sign_json(MacFirst(value=3))
    assert MacFirst.model_validate_json(first_data) == signed_first
    assert key.verify(MacFirst.model_validate_json(first_data))

    class OnlyMac(BaseModel):
        mac: str = ""

    signed_empty, empty_data = key.sign_json(OnlyMac())
    assert OnlyMac.model_validate_json(empty_data) == signed_empty and signed_empty.mac


def test_a_key_never_prints_and_must_be_long_enough() -> None:
    assert "00010203" not in repr(KEY) and "00010203" not in str(KEY)
    assert BusKey.from_hex(KEY.hex()).hex() == KEY.hex()
    with pytest.raises(ValueError, match="at least 16"):
        BusKey(b"short")
    with pytest.raises(ValueError, match="not a hex"):
        BusKey.from_hex("zz" * 16)


def test_load_bus_key_from_the_environment(tmp_path: Path) -> None:
    assert load_bus_key({}) is None
    assert load_bus_key({"WAVEPP_BUS_KEY": KEY.hex()}).hex() == KEY.hex()  # type: ignore[union-attr]
    path = tmp_path / "key"
    path.write_text(KEY.hex() + "\n")
    assert load_bus_key({"WAVEPP_BUS_KEY_FILE": str(path)}).hex() == KEY.hex()  # type: ignore[union-attr]
    other = BusKey(b"o" * 32)
    both = {"WAVEPP_BUS_KEY": other.hex(), "WAVEPP_BUS_KEY_FILE": str(path)}
    assert load_bus_key(both).hex() == other.hex()  # type: ignore[union-attr]
    with pytest.raises(BusKeyError, match="WAVEPP_BUS_KEY: bus key: not a hex string"):
        load_bus_key({"WAVEPP_BUS_KEY": "not hex"})
    with pytest.raises(BusKeyError, match="WAVEPP_BUS_KEY: bus key: 2 bytes"):
        load_bus_key({"WAVEPP_BUS_KEY": "abcd"})
    with pytest.raises(BusKeyError, match="WAVEPP_BUS_KEY_FILE=.*nope: cannot read"):
        load_bus_key({"WAVEPP_BUS_KEY_FILE": str(tmp_path / "nope")})


def test_wavepp_up_generates_a_key_its_children_inherit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WAVEPP_BUS_KEY", raising=False)
    monkeypatch.delenv("WAVEPP_BUS_KEY_FILE", raising=False)
    key = ensure_bus_key()
    assert buskey.os.environ["WAVEPP_BUS_KEY"] == key.hex()
    assert ensure_bus_key().hex() == key.hex()  # kept once set


def test_a_bad_bus_key_is_one_line_and_exit_2_for_every_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("WAVEPP_BUS_KEY", "xyz")
    runtime = RuntimeConfig(model=ModelConfig(num_layers=2), num_stages=2)
    runtime_path = tmp_path / "runtime.json"
    runtime_path.write_text(runtime.model_dump_json())
    gateway = tiny_gateway_config(
        pool="pool",
        replicas=[ReplicaInfo(pipeline="pool-0", num_stages=2)],
        model_name="m",
        model_id="m",
        vocab_size=100,
        tenants=[TenantPolicy(name="t", cache_salt="s")],
    )
    gateway_path = tmp_path / "gateway.json"
    gateway_path.write_text(gateway.model_dump_json())
    nats = ["--nats-url", "nats://127.0.0.1:1"]
    commands = {
        "stage": ["stage", "--runtime-config", str(runtime_path), "--rank", "0", *nats,
                  "--dist-url", "tcp://127.0.0.1:1"],
        "admission": ["admission", "--runtime-config", str(runtime_path), *nats, "--pool", "p"],
        "gateway": ["gateway", "--gateway-config", str(gateway_path), *nats, "--port", "8080"],
    }  # fmt: skip
    for name, argv in commands.items():
        assert cli_main(argv) == 2, name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "WAVEPP_BUS_KEY" in err[0] and "hex" in err[0], (name, err)
