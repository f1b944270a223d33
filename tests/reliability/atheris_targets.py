"""atheris (libFuzzer, coverage-guided) harnesses; run as ``python atheris_targets.py
-runs=N``. A target raising anything but the documented errors is a crash (exit code != 0)."""

from __future__ import annotations

import sys

import atheris

# Only the modules whose code the targets run: with the default (every module imported here:
# numpy, asyncio, opentelemetry, email...) instrumenting took ~15 s of CPU, now ~4 s. With seed 1
# the 4000 runs find the same coverage, features and corpus either way.
with atheris.instrument_imports(include=["wavepp", "json", "pydantic"]):
    from wavepp.api.kv_reply import decode_reply
    from wavepp.api.spec import check_spec
    from wavepp.bench.trace import parse_trace_line
    from wavepp.gateway.validation import BadRequest, PromptLimits, parse_prefill
    from wavepp.runtime.agreement import handle_kv_request
    from wavepp.runtime.agreement.stage_handler import handle_kv_batch
    from wavepp.runtime.kv import BlockPool, StageKVManager

import json

LIMITS = PromptLimits(vocab_size=256, max_prompt_tokens=64, tenants=frozenset({"a"}))


def kv(data: bytes) -> None:
    manager = StageKVManager(BlockPool(8, 4))
    for payload in data.split(b"\n")[:8]:
        reply = handle_kv_request(manager, 0, payload)
        assert reply.ok or reply.error
    manager.pool.check_invariants()


def kv_batch(data: bytes) -> None:
    """A binary round (the bytes after a ``WKB`` header's magic): a reply that decodes, a
    sound pool."""
    manager = StageKVManager(BlockPool(8, 4))
    reply = decode_reply(handle_kv_batch(manager, 0, b"WKB" + data))
    assert reply.rank == 0
    if reply.error:
        assert manager.num_requests == 0
    manager.pool.check_invariants()


def trace(data: bytes) -> None:
    parse_trace_line(data.decode("utf-8", errors="replace"), 1)


def _json(data: bytes) -> object:
    try:
        return json.loads(data.decode("utf-8", errors="replace"))
    except ValueError:
        return None


def spec(data: bytes) -> None:
    raw = _json(data)
    if isinstance(raw, dict):
        check_spec(raw)


def http(data: bytes) -> None:
    try:
        parse_prefill(_json(data), LIMITS)
    except BadRequest:
        pass


TARGETS = [kv, kv_batch, trace, spec, http]


def all_targets(data: bytes) -> None:
    """The first byte picks the target (one process: instrumenting the imports is its start-up cost)."""
    if data:
        TARGETS[data[0] % len(TARGETS)](data[1:])


if __name__ == "__main__":
    atheris.Setup(sys.argv, all_targets)
    atheris.Fuzz()
