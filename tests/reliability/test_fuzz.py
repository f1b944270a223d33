"""Bad-input fuzzing (hypothesis): KV messages (JSON and binary rounds) to a stage, every message model, the trace
loader, the WavePipeline spec and the HTTP request validation.

Each target must answer bad input with a clear error (a field name), never raise anything else,
and leave its state unchanged when it rejects an input.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from wavepp.api import messages as m
from wavepp.api.kv_batch import BatchOp, KVBatch, ReserveEntry, encode_batch
from wavepp.api.kv_reply import decode_reply
from wavepp.api.spec import check_spec
from wavepp.bench.trace import TraceError, TraceRecord, parse_trace_line
from wavepp.gateway.validation import (
    BadRequest,
    ParsedRequest,
    PromptLimits,
    parse_completion_batch,
    parse_prefill,
)
from wavepp.runtime.agreement import handle_kv_request
from wavepp.runtime.agreement.stage_handler import handle_kv_batch
from wavepp.runtime.kv import BlockPool, StageKVManager, hash_prompt_blocks

BLOCK_SIZE = 4
NUM_BLOCKS = 16
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner),
    max_leaves=20,
)


# ------------------------------------------------------------------------------ stage KV ops


def _hashes(seed: int, num_blocks: int) -> tuple[bytes, ...]:
    tokens = [(seed * 7919 + i) % 251 for i in range(num_blocks * BLOCK_SIZE)]
    return tuple(hash_prompt_blocks(tokens, BLOCK_SIZE, "fuzz", ""))


_RIDS = st.sampled_from(["r0", "r1", "r2", "r3"])
_LEASES = st.sampled_from([1.0, 30.0])


def _valid_json_ops() -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(
        st.builds(
            lambda rs, lease_s: {"op": "renew", "request_ids": rs, "lease_s": lease_s},
            st.lists(_RIDS, max_size=3),
            _LEASES,
        ),
        st.just({"op": "health"}),
    )


def _valid_batches() -> st.SearchStrategy[bytes]:
    """Encoded rounds: probe-reserves (with releases riding along) or releases alone."""
    entry = st.builds(
        lambda r, seed, n, extra: ReserveEntry(r, _hashes(seed, n), max(1, n + extra)),
        _RIDS,
        st.integers(0, 2),
        st.integers(0, 6),
        st.integers(0, 1),
    )
    reserve = st.builds(
        lambda entries, lease_s, releases: KVBatch(
            BatchOp.PROBE_RESERVE, tuple(entries), lease_s, releases=tuple(releases)
        ),
        st.lists(entry, max_size=3),
        _LEASES,
        st.lists(_RIDS, max_size=2),
    )
    release = st.builds(
        lambda rs: KVBatch(BatchOp.RELEASE, tuple(rs)), st.lists(_RIDS, min_size=1, max_size=3)
    )
    return st.one_of(reserve, release).map(encode_batch)


@st.composite
def _mutated(draw: st.DrawFn) -> bytes:
    """A valid JSON op with one field replaced, one unknown field added, or the version
    changed; or a valid round with a byte changed, cut short or of another version."""
    if draw(st.booleans()):
        payload = bytearray(draw(_valid_batches()))
        how = draw(st.sampled_from(["flip", "cut", "version"]))
        if how == "flip":
            payload[draw(st.integers(0, len(payload) - 1))] ^= draw(st.integers(1, 255))
        elif how == "cut":
            del payload[draw(st.integers(0, len(payload) - 1)) :]
        else:
            payload[3] = draw(st.integers(0, 255).filter(lambda v: v != m.PROTOCOL_VERSION))
        return bytes(payload)
    op = dict(draw(_valid_json_ops()))
    how = draw(st.sampled_from(["replace", "extra", "version", "drop"]))
    if how == "replace":
        op[draw(st.sampled_from(sorted(op)))] = draw(json_values)
    elif how == "extra":
        op[draw(st.text(min_size=1, max_size=8).filter(lambda k: k not in op))] = 1
    elif how == "version":
        op["v"] = draw(st.integers().filter(lambda v: v != m.PROTOCOL_VERSION) | json_values)
    elif len(op) > 1:
        op.pop(draw(st.sampled_from(sorted(k for k in op if k != "op"))))
    return json.dumps(op).encode()


bad_payloads = st.one_of(
    st.binary(max_size=200),
    st.builds(lambda v: json.dumps(v).encode(), json_values),
    _mutated(),
)
valid_payloads = st.one_of(
    _valid_json_ops().map(lambda o: json.dumps(o).encode()), _valid_batches()
)


def _handle(manager: StageKVManager, rank: int, payload: bytes) -> tuple[int, str]:
    """A payload to the stage's handler of its kind (a round: ``b"WKB"``, else JSON): the
    reply's rank and its refusal of the whole message ("" when applied)."""
    if payload[:3] == b"WKB":
        reply = decode_reply(handle_kv_batch(manager, rank, payload))
        return reply.rank, reply.error
    json_reply = handle_kv_request(manager, rank, payload)
    return json_reply.rank, "" if json_reply.ok else json_reply.error or "refused, unnamed"


def _state(manager: StageKVManager) -> tuple:
    pool = manager.pool
    return (
        pool.num_free_blocks,
        tuple(pool.ref_cnt(i) for i in range(pool.num_blocks)),
        tuple(pool.block_hash(i) for i in range(pool.num_blocks)),
        manager.num_requests,
        {
            rid: (manager.block_hashes(rid), manager.num_agreed_blocks(rid))
            for rid in manager.request_ids()
        },
    )


def _warm_manager() -> StageKVManager:
    """A stage with one request computed and released (cached blocks) and one held."""
    manager = StageKVManager(BlockPool(NUM_BLOCKS, BLOCK_SIZE))
    hashes = _hashes(0, 4)
    for rid in ("warm", "held"):
        batch = KVBatch(BatchOp.PROBE_RESERVE, (ReserveEntry(rid, hashes, 4),), 30.0)
        reply = decode_reply(handle_kv_batch(manager, 0, encode_batch(batch)))
        assert reply.results[0].ok
        if rid == "warm":
            manager.start_chunk(rid, 0)
            manager.mark_computed(rid, 4 * BLOCK_SIZE, manager.block_hashes(rid))
            release = encode_batch(KVBatch(BatchOp.RELEASE, (rid,)))
            assert not decode_reply(handle_kv_batch(manager, 0, release)).error
    return manager


@FUZZ
@given(payload=bad_payloads)
def test_a_rejected_kv_message_changes_nothing(payload: bytes) -> None:
    manager = _warm_manager()
    before = _state(manager)
    rank, error = _handle(manager, 1, payload)
    assert rank == 1
    if not error:
        return  # a mutation that is still a valid op (e.g. another request id): applied
    assert _state(manager) == before, error
    manager.pool.check_invariants()


@FUZZ
@given(ops=st.lists(st.one_of(valid_payloads, bad_payloads), max_size=30))
# a mutated round that still decodes, holding a request of an id no valid op uses
@example(
    ops=[encode_batch(KVBatch(BatchOp.PROBE_RESERVE, (ReserveEntry("\x00\x00", (), 1),), 1.0))]
)
def test_any_sequence_of_kv_messages_keeps_the_pool_sound(ops: list[bytes]) -> None:
    """Valid and invalid ops interleaved: invariants hold after each; releasing every request
    the stage holds (a mutation may still decode, under another id) leaves no pin and no
    reservation behind."""
    manager = StageKVManager(BlockPool(NUM_BLOCKS, BLOCK_SIZE))
    for payload in ops:
        before = _state(manager)
        _, error = _handle(manager, 0, payload)
        manager.pool.check_invariants()
        if error:  # refused as a whole: nothing changed, nothing left held under any id
            assert _state(manager) == before, error
    held = tuple(manager.request_ids())
    release = encode_batch(KVBatch(BatchOp.RELEASE, ("r0", "r1", "r2", "r3", *held)))
    assert _handle(manager, 0, release) == (0, "")
    assert manager.num_requests == 0
    assert manager.pool.num_pinned_blocks == 0
    assert manager.pool.num_free_blocks == NUM_BLOCKS
    manager.pool.check_invariants()


# ------------------------------------------------------------------------------ message models

MESSAGE_MODELS: list[type[BaseModel]] = [
    m.Renew, m.Health, m.PlannedChunk, m.MicroBatchPlan, m.RequestResult, m.MicroBatchDone,
    m.KVEventBatch,
]  # fmt: skip
"""Every message but ``KVReply``, which decodes any version (its sender's) and ignores fields
it does not know, so that an admission can name a stage of another version."""


@pytest.mark.parametrize("model", [*MESSAGE_MODELS, m.KVReply], ids=lambda c: c.__name__)
@settings(max_examples=60, deadline=None)
@given(data=json_values)
def test_every_message_model_rejects_garbage_with_a_validation_error(
    model: type[BaseModel], data: object
) -> None:
    try:
        model.model_validate_json(json.dumps(data))
    except ValidationError as exc:
        assert exc.errors(), "a rejection names its field"


@pytest.mark.parametrize("model", MESSAGE_MODELS, ids=lambda c: c.__name__)
@settings(max_examples=30, deadline=None)
@given(version=st.integers().filter(lambda v: v != m.PROTOCOL_VERSION))
def test_every_message_is_versioned_and_refuses_another_version(
    model: type[BaseModel], version: int
) -> None:
    assert model.model_fields["v"].get_default(call_default_factory=True) == m.PROTOCOL_VERSION
    with pytest.raises(ValidationError) as info:
        model.model_validate({"v": version})
    assert any(err["loc"][:1] == ("v",) for err in info.value.errors())


@pytest.mark.parametrize("model", MESSAGE_MODELS, ids=lambda c: c.__name__)
def test_every_message_refuses_unknown_fields(model: type[BaseModel]) -> None:
    with pytest.raises(ValidationError) as info:
        model.model_validate({"zz_unknown": 1})
    assert any(err["type"] == "extra_forbidden" for err in info.value.errors())


# ------------------------------------------------------------------------------ trace loader

trace_objects = st.fixed_dictionaries(
    {},
    optional={
        "timestamp": json_values | st.sampled_from([float("nan"), float("inf"), -1, 0, 12.5]),
        "input_length": json_values | st.integers(0, 2000),
        "output_length": json_values | st.integers(0, 10),
        "hash_ids": json_values | st.lists(st.integers(-2, 50), max_size=5),
    },
)


@FUZZ
@given(line=st.text(max_size=200) | trace_objects.map(json.dumps) | json_values.map(json.dumps))
def test_parse_trace_line_returns_a_record_or_an_error_naming_the_field(line: str) -> None:
    result = parse_trace_line(line, 7)
    assert isinstance(result, TraceRecord | TraceError)
    if isinstance(result, TraceError):
        assert result.line_no == 7 and result.field and "line 7" in str(result)
    else:
        assert result.input_length >= 1 and all(h >= 0 for h in result.hash_ids)


def test_parse_trace_line_refuses_non_finite_timestamps() -> None:
    """json.loads accepts NaN/Infinity; a trace line with one is refused with a clear error, not
    a ValueError from int(nan)."""
    for value in ("NaN", "Infinity"):
        line = f'{{"timestamp": {value}, "input_length": 1, "hash_ids": [0]}}'
        result = parse_trace_line(line, 1)
        assert isinstance(result, TraceError) and result.field == "timestamp"


# ------------------------------------------------------------------------------ pipeline spec

SPEC_KEYS = ["replicas", "stages", "model", "cache", "scheduler", "tenants", "engineOptions",
             "layerPartition", "nats", "resources", "autoscaling", "rollout", "image"]  # fmt: skip
spec_dicts = st.dictionaries(
    st.sampled_from(SPEC_KEYS) | st.text(max_size=8), json_values, max_size=6
) | st.builds(
    lambda name, stages, extra: {"model": {"name": name}, "stages": stages, **extra},
    st.sampled_from(["tiny-llama", "", "x" * 300]),
    json_values,
    st.dictionaries(st.sampled_from(SPEC_KEYS), json_values, max_size=3),
)


@FUZZ
@given(raw=spec_dicts)
def test_check_spec_never_raises_and_names_the_field(raw: dict[str, Any]) -> None:
    snapshot = json.dumps(raw, sort_keys=True)
    spec, issues = check_spec(raw)
    assert (spec is None) == bool(issues)
    for issue in issues:
        assert issue.field.startswith("spec") and issue.message
    assert json.dumps(raw, sort_keys=True) == snapshot, "check_spec modified its input"


# ------------------------------------------------------------------------------ HTTP bodies

LIMITS = PromptLimits(vocab_size=256, max_prompt_tokens=64, tenants=frozenset({"a", "b"}))
body_keys = st.sampled_from(["tenant", "token_ids", "text", "request_id", "priority", "prompt",
                             "max_tokens", "model", "n", "user"])  # fmt: skip
bodies = json_values | st.dictionaries(
    body_keys,
    json_values | st.sampled_from(["a", "b", 1, [1, 2, 3], [300], [True], "w1 w2"]),
    max_size=6,
)


def _tokenize(text: str) -> list[int]:
    return [len(word) % 256 for word in text.split()]


@FUZZ
@given(body=bodies, with_tokenizer=st.booleans())
def test_http_bodies_parse_or_fail_with_a_field(body: object, with_tokenizer: bool) -> None:
    tokenize = _tokenize if with_tokenizer else None
    for parse in (
        lambda *args: [parse_prefill(*args)],
        lambda *args: parse_completion_batch(*args).prompts,
    ):
        try:
            requests = parse(body, LIMITS, tokenize)
        except BadRequest as exc:
            # the field may be "" when the body's unknown key is "" itself
            assert isinstance(exc.field, str) and exc.message and 400 <= exc.status < 500
            assert exc.to_json()["error"]["field"] == exc.field
            continue
        for parsed in requests:
            assert isinstance(parsed, ParsedRequest)
            assert parsed.tenant in LIMITS.tenants
            assert 1 <= len(parsed.token_ids) <= LIMITS.max_prompt_tokens
            assert all(0 <= t < LIMITS.vocab_size for t in parsed.token_ids)
