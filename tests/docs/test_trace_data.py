"""The trace in data/traces/ is upstream's file byte for byte, and ships with its licence and a
README that states the same checksum."""

from __future__ import annotations

import hashlib
import json

from trace_data import TRACE, TRACE_BYTES, TRACE_RECORDS, TRACE_SHA256


def test_trace_matches_its_checksum_and_size() -> None:
    data = TRACE.read_bytes()
    assert len(data) == TRACE_BYTES
    assert hashlib.sha256(data).hexdigest() == TRACE_SHA256


def test_trace_records_have_the_documented_shape() -> None:
    lines = TRACE.read_text().splitlines()
    assert len(lines) == TRACE_RECORDS
    for line in (lines[0], lines[-1]):
        record = json.loads(line)
        assert set(record) == {"timestamp", "input_length", "output_length", "hash_ids"}
        assert len(record["hash_ids"]) == -(-record["input_length"] // 512)
        assert record["hash_ids"][0] == 0


def test_readme_states_source_licence_and_checksum() -> None:
    readme = (TRACE.parent / "README.md").read_text()
    assert TRACE_SHA256 in readme and f"{TRACE_BYTES:,}" in readme
    assert "kvcache-ai/Mooncake" in readme and "3cca71daccf2a7afb8fe3f0295358f70e3a69fdb" in readme
    assert "Apache License 2.0" in readme and "USENIX" in readme
    licence = (TRACE.parent / "LICENSE").read_text()
    assert "Apache License" in licence and "Version 2.0, January 2004" in licence
