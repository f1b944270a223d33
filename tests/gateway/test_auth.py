"""API keys (wavepp.gateway.auth), tenant limits from the spec, and their Kubernetes rendering:
pure units with fake clocks and temporary files (no processes)."""

from __future__ import annotations

import hmac
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
from gateway_support import tiny_gateway_config

from wavepp.api.pod import API_KEYS_DIR
from wavepp.api.spec import SpecError, WavePipelineSpec, check_spec
from wavepp.cmd.api_key import new_key, rotate
from wavepp.gateway import auth as auth_module
from wavepp.gateway.auth import (
    MAX_KEYS_PER_TENANT,
    Authenticator,
    AuthError,
    FailureLimiter,
    KeyFileError,
    KeyStore,
    hash_key,
    key_line,
    parse_key_file,
)
from wavepp.gateway.core import Gateway
from wavepp.gateway.tenants import FairShareQueue, LimitExceeded, TenantPolicy
from wavepp.launch.gateway import gateway_config_from_spec
from wavepp.operator import builders
from wavepp.operator.gateway_builders import build_gateway_deployment
from wavepp.operator.naming import PipelineRef
from wavepp.operator.observe import Observed
from wavepp.operator.reconcile import Defaults, plan

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


class Clocks:
    """A monotonic and a wall clock that tests move by hand."""

    def __init__(self) -> None:
        self.mono = 100.0
        self.wall = NOW.timestamp()

    def advance(self, seconds: float) -> None:
        self.mono += seconds
        self.wall += seconds


def _store(files: dict[str, Path], clocks: Clocks, poll_s: float = 1.0) -> KeyStore:
    return KeyStore(
        {t: str(p) for t, p in files.items()},
        poll_s=poll_s,
        clock=lambda: clocks.mono,
        wall_clock=lambda: clocks.wall,
    )


# ---------------------------------------------------------------------------- key files


def test_key_file_hash_and_raw_lines_are_the_same_key() -> None:
    key = new_key()
    text = f"# acme's keys\n\n{key_line(key)}\n{'r' * 16}  # raw, at least 16 characters\n"
    entries = parse_key_file(text, "acme", now_s=NOW.timestamp())
    assert [e.digest for e in entries] == [hash_key(key), hash_key("r" * 16)]
    assert all(e.tenant == "acme" and e.not_after_s is None for e in entries)


@pytest.mark.parametrize(
    ("line", "text"),
    [
        ("short-key", "at least 16 characters"),
        ("sha256:abcd", "64 hex digits"),
        (f"{'k' * 20} expires=2026-01-01T00:00:00Z", "unknown option 'expires'"),
        (f"{'k' * 20} not-after=tomorrow", "not an ISO 8601 time"),
        (f"{'k' * 20} not-after=2026-12-01T00:00:00", "needs a zone"),
    ],
)
def test_bad_key_file_lines_name_the_line_and_never_the_key(line: str, text: str) -> None:
    with pytest.raises(KeyFileError) as info:
        parse_key_file(f"# header\n{line}\n", "acme", now_s=NOW.timestamp())
    message = str(info.value)
    assert text in message and "line 2" in message and "'acme'" in message
    assert line.split()[0] not in message


def test_at_most_two_valid_keys_per_tenant_expired_ones_do_not_count() -> None:
    past = (NOW - timedelta(hours=1)).isoformat()
    keys = [new_key() for _ in range(3)]
    with pytest.raises(KeyFileError, match=f"3 keys valid now; at most {MAX_KEYS_PER_TENANT}"):
        parse_key_file("\n".join(keys), "acme", now_s=NOW.timestamp())
    text = f"{keys[0]} not-after={past}\n{keys[1]}\n{keys[2]}\n"
    assert len(parse_key_file(text, "acme", now_s=NOW.timestamp())) == 3


def test_lookup_maps_a_key_to_its_tenant_and_compares_every_digest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a_keys, b_key = [new_key(), new_key()], new_key()
    (tmp_path / "a").write_text("\n".join(key_line(k) for k in a_keys))
    (tmp_path / "b").write_text(b_key)
    clocks = Clocks()
    store = _store({"a": tmp_path / "a", "b": tmp_path / "b"}, clocks)
    assert [store.lookup(k) for k in (*a_keys, b_key)] == ["a", "a", "b"]
    assert store.lookup(new_key()) is None and store.lookup("") is None
    calls: list[int] = []
    compare = hmac.compare_digest

    def counting(x: bytes, y: bytes) -> bool:
        calls.append(1)
        return compare(x, y)

    monkeypatch.setattr(auth_module.hmac, "compare_digest", counting)
    for key in (a_keys[0], b_key, new_key()):  # first entry, last entry, none
        calls.clear()
        store.lookup(key)
        assert len(calls) == 3, "every stored digest is compared, whichever matches"


def test_a_key_of_two_tenants_is_refused(tmp_path: Path) -> None:
    key = new_key()
    (tmp_path / "a").write_text(key)
    (tmp_path / "b").write_text(key_line(key))
    with pytest.raises(KeyFileError, match="share a key") as info:
        _store({"a": tmp_path / "a", "b": tmp_path / "b"}, Clocks())
    assert key not in str(info.value)
    with pytest.raises(KeyFileError, match="No such file") as missing:
        _store({"a": tmp_path / "missing"}, Clocks())
    # a missing file names the command that makes one
    assert f"wavepp api-key --append {tmp_path / 'missing'}" in str(missing.value)


def test_rotation_in_the_file_takes_effect_and_the_old_key_ends_after_the_window(
    tmp_path: Path,
) -> None:
    path = tmp_path / "acme.keys"
    old = new_key()
    path.write_text(key_line(old) + "\n")
    clocks = Clocks()
    store = _store({"acme": path}, clocks, poll_s=1.0)
    assert store.lookup(old) == "acme"
    new = new_key()
    rotate(path, new, expire_others_after_s=30.0, now=datetime.fromtimestamp(clocks.wall, UTC))
    assert store.lookup(new) is None  # not yet polled
    clocks.advance(1.0)
    assert store.lookup(new) == "acme" and store.lookup(old) == "acme"  # both in the window
    assert store.num_reloads == 1
    clocks.advance(28.5)  # 29.5 s after the rotation
    assert store.lookup(old) == "acme"
    clocks.advance(0.6)  # past not-after: no edit of the file needed
    assert store.lookup(old) is None and store.lookup(new) == "acme"
    # a third key while two are valid is refused by the tool ...
    with pytest.raises(KeyFileError, match="at most 2"):
        rotate(path, new_key(), None, datetime.fromtimestamp(clocks.wall - 40, UTC))
    # ... and a broken file keeps the previous keys
    path.write_text("garbage\n")
    os.utime(path, ns=(0, 12345))
    clocks.advance(1.0)
    assert store.lookup(new) == "acme" and store.num_reloads == 1
    path.unlink()
    clocks.advance(1.0)
    assert store.lookup(new) == "acme"


def test_a_secret_volume_swap_is_seen(tmp_path: Path) -> None:
    """The kubelet updates a Secret volume by pointing a symlink at a new directory."""
    first, second = tmp_path / "..data1", tmp_path / "..data2"
    first.mkdir()
    second.mkdir()
    old, new = new_key(), new_key()
    (first / "keys").write_text(key_line(old))
    (second / "keys").write_text(key_line(new))
    (tmp_path / "..data").symlink_to(first.name)
    (tmp_path / "keys").symlink_to("..data/keys")
    clocks = Clocks()
    store = _store({"acme": tmp_path / "keys"}, clocks, poll_s=0.0)
    assert store.lookup(old) == "acme"
    (tmp_path / "..data_tmp").symlink_to(second.name)
    (tmp_path / "..data_tmp").replace(tmp_path / "..data")
    assert store.lookup(new) == "acme" and store.lookup(old) is None


# ---------------------------------------------------------------------------- authenticator


def _authenticator(tmp_path: Path, clocks: Clocks) -> tuple[Authenticator, str]:
    key = new_key()
    (tmp_path / "a").write_text(key_line(key))
    store = _store({"a": tmp_path / "a"}, clocks)
    failures = FailureLimiter(burst=3, per_s=0.5, max_clients=2)
    return Authenticator(store, failures, clock=lambda: clocks.mono), key


def test_authenticate_401_403_and_open_mode(tmp_path: Path) -> None:
    clocks = Clocks()
    auth, key = _authenticator(tmp_path, clocks)
    assert auth.enabled and auth.authenticate(f"Bearer {key}", "c1") == "a"
    assert auth.authenticate(f"bearer  {key} ", "c1") == "a"
    for header, reason in [(None, "missing"), ("Basic abc", "invalid"), ("Bearer nope", "invalid")]:
        with pytest.raises(AuthError) as info:
            auth.authenticate(header, f"client-{reason}-{header}")
        assert (info.value.status, info.value.reason) == (401, reason)
        body = info.value.to_json()["error"]
        assert body["type"] == "authentication_error" and "tenant" not in body["message"]
    Authenticator.check_claim("a", None)
    Authenticator.check_claim("a", "a")
    with pytest.raises(AuthError) as info:
        Authenticator.check_claim("a", "b")
    assert (info.value.status, info.value.reason) == (403, "tenant_mismatch")
    open_mode = Authenticator(None, FailureLimiter(burst=1, per_s=1), clock=lambda: 0.0)
    assert not open_mode.enabled and open_mode.authenticate(None, "c") is None


def test_failures_are_rate_limited_per_client(tmp_path: Path) -> None:
    clocks = Clocks()
    auth, key = _authenticator(tmp_path, clocks)
    for _ in range(3):
        with pytest.raises(AuthError) as info:
            auth.authenticate("Bearer wrong-key-xxxxxxxx", "evil")
        assert info.value.status == 401
    with pytest.raises(AuthError) as info:
        auth.authenticate(f"Bearer {key}", "evil")  # even a right guess waits now
    assert (info.value.status, info.value.reason) == (429, "rate_limited")
    assert info.value.retry_after_s == pytest.approx(2.0)
    assert auth.authenticate(f"Bearer {key}", "good") == "a"  # other clients are not affected
    clocks.advance(2.0)
    assert auth.authenticate(f"Bearer {key}", "evil") == "a"  # one failure refilled
    limiter = FailureLimiter(burst=1, per_s=1.0, max_clients=2)
    for client in ("x", "y", "z"):
        limiter.failed(client, 0.0)
    assert limiter.retry_after_s("x", 0.0) == 0.0  # forgotten: at most 2 clients tracked
    assert limiter.retry_after_s("z", 0.0) > 0


# ---------------------------------------------------------------------------- limits in the spec

SPEC = {
    "model": {"name": "tiny-llama"},
    "stages": 2,
    "tenants": [
        {
            "name": "chat",
            "priority": 10,
            "maxConcurrency": 8,
            "maxQueued": 2,
            "tokensPerSecond": 5000,
            "burstTokens": 20000,
            "apiKeySecret": "chat-keys",
        },
        {"name": "batch", "weight": 2},
    ],
}


def test_spec_tenant_limits_reach_the_gateway_config() -> None:
    spec = WavePipelineSpec.model_validate(SPEC).resolved(
        default_image="i", default_nats_url="nats://n"
    )
    config = gateway_config_from_spec(spec, {"pipeline": "p"})
    chat, batch = config.tenants
    assert (chat.priority, chat.max_concurrency, chat.max_queued) == (10, 8, 2)
    assert (chat.tokens_per_s, chat.burst_tokens) == (5000, 20000)
    assert chat.api_keys_file == f"{API_KEYS_DIR}/chat/keys"
    assert (batch.weight, batch.api_keys_file, batch.priority) == (2, None, 0)
    assert spec.to_wire()["tenants"][0]["tokensPerSecond"] == 5000


@pytest.mark.parametrize(
    ("tenants", "field"),
    [
        ([{"name": "a", "apiKeySecret": "s", "apiKeysFile": "f"}], "spec.tenants.apiKeySecret"),
        (
            [{"name": "a", "apiKeySecret": "s"}, {"name": "b", "apiKeySecret": "s"}],
            "spec.tenants.apiKeySecret",
        ),
        ([{"name": "a", "priority": 101}], "spec.tenants[0].priority"),
        ([{"name": "a", "maxQueued": -1}], "spec.tenants[0].maxQueued"),
    ],
)
def test_bad_tenant_specs_name_the_field(tenants: list[dict], field: str) -> None:
    spec, issues = check_spec({**SPEC, "tenants": tenants}, default_image="i", default_nats_url="n")
    assert spec is None and [i.field for i in issues] == [field], issues


def test_operator_refuses_a_key_file_and_gateway_config_too() -> None:
    raw = {**SPEC, "tenants": [{"name": "a", "apiKeysFile": "keys/a"}]}
    body = {"metadata": {"name": "p", "namespace": "ns", "uid": "u"}, "spec": raw}
    result = plan(body, Observed(), 0.0, Defaults(image="i", nats_url="nats://n"))
    assert result.actions == [] and [i.field for i in result.issues] == ["spec.tenants.apiKeysFile"]
    spec = WavePipelineSpec.model_validate(raw).resolved(default_image="i", default_nats_url="n")
    with pytest.raises(SpecError, match="apiKeysFile is for wavepp up"):
        gateway_config_from_spec(spec, {"pipeline": "p"})


def test_operator_refuses_pin_cores_naming_the_field() -> None:
    """``engineOptions.pinCores`` is honoured by ``wavepp up``'s launcher only: the operator
    renders nothing for it and marks the pipeline invalid, naming the field."""
    raw = {**SPEC, "engineOptions": {"pinCores": True}}
    body = {"metadata": {"name": "p", "namespace": "ns", "uid": "u"}, "spec": raw}
    result = plan(body, Observed(), 0.0, Defaults(image="i", nats_url="nats://n"))
    assert result.actions == []
    assert [i.field for i in result.issues] == ["spec.engineOptions.pinCores"]
    assert "pinCores is for wavepp up" in result.issues[0].message
    off = {**SPEC, "engineOptions": {"pinCores": False}}
    body_off = {"metadata": {"name": "p", "namespace": "ns", "uid": "u"}, "spec": off}
    assert plan(body_off, Observed(), 0.0, Defaults(image="i", nats_url="nats://n")).issues == []


def test_only_the_gateway_mounts_the_key_secrets_read_only_without_subpath() -> None:
    spec = WavePipelineSpec.model_validate(SPEC).resolved(
        default_image="i", default_nats_url="nats://n"
    )
    ref = PipelineRef(name="p", namespace="ns", uid="u")
    gateway = build_gateway_deployment(ref, spec, "h")["spec"]["template"]["spec"]
    secrets = [v for v in gateway["volumes"] if "secret" in v]
    assert secrets == [
        {
            "name": "api-keys-chat",
            "secret": {
                "secretName": "chat-keys",
                "items": [{"key": "keys", "path": "keys"}],
                "defaultMode": 0o440,
            },
        }
    ]
    (mount,) = [m for m in gateway["containers"][0]["volumeMounts"] if m["name"] == "api-keys-chat"]
    assert mount == {"name": "api-keys-chat", "mountPath": f"{API_KEYS_DIR}/chat", "readOnly": True}
    others = [
        builders.build_stage_statefulset(ref, spec, "h", 0),
        builders.build_admission_deployment(ref, spec, "h", 0, running=True),
    ]
    for obj in others:
        volumes = obj["spec"]["template"]["spec"]["volumes"]
        assert not any(v.get("secret", {}).get("secretName") == "chat-keys" for v in volumes)


# ---------------------------------------------------------------------------- priority, queue


def test_tenant_priority_is_strict_and_equal_priorities_share_by_weight() -> None:
    queue: FairShareQueue[str] = FairShareQueue(
        {"chat": 1, "batch": 1, "bulk": 1}, {"chat": 5, "batch": 0, "bulk": 0}
    )
    for i in range(4):
        queue.push("batch", f"batch{i}", cost=10)
        queue.push("bulk", f"bulk{i}", cost=10)
    queue.push("chat", "chat0", cost=1000)
    queue.push("chat", "chat1", cost=1000)
    served = [queue.pop()[0] for _ in range(6)]
    assert served[:2] == ["chat", "chat"]  # however much chat already consumed
    assert sorted(served[2:]) == ["batch", "batch", "bulk", "bulk"]


def test_tenant_queue_limit_refuses_only_a_request_that_would_wait() -> None:
    config = tiny_gateway_config(
        model_name="m",
        model_id="m",
        vocab_size=100,
        tenants=[
            TenantPolicy(name="a", cache_salt="a", max_queued=1),
            TenantPolicy(name="b", cache_salt="b"),
        ],
        max_outstanding_per_replica=1,
    )
    # NOTE: the NATS connection is not used by the queue checks; a stand-in with jetstream().
    gateway = Gateway(config, SimpleNamespace(jetstream=lambda **_: None), clock=lambda: 0.0)
    gateway.check_tenant_queue("a")  # a free slot: no wait, never refused
    gateway.num_outstanding = 1  # the slot is taken: a new request waits
    gateway.check_tenant_queue("a")
    gateway.fair.push("a", object(), cost=1)
    with pytest.raises(LimitExceeded) as info:
        gateway.check_tenant_queue("a")
    assert (info.value.field, info.value.limit) == ("max_queued", 1)
    gateway.check_tenant_queue("b")  # no limit for b


@pytest.mark.parametrize("name", ["wavepipeline.yaml", "wavepipeline-gpu.yaml"])
def test_the_wavepipeline_examples_turn_keys_on_and_mount_them_in_the_gateway(name: str) -> None:
    from wavepp.api.spec import load_spec_file

    repo = Path(__file__).resolve().parents[2]
    spec = load_spec_file(repo / "examples" / name).resolved(
        default_image="i", default_nats_url="nats://n"
    )
    # NOTE: the GPU example's checkpoint (its PVC) is not here; the keys do not depend on it
    model = spec.model.model_copy(update={"pvc": None, "path": None})
    spec = spec.model_copy(update={"model": model})
    assert spec.tenants and all(t.api_key_secret for t in spec.tenants)
    ref = PipelineRef(name="tiny", namespace="default", uid="u")
    pod = build_gateway_deployment(ref, spec, "h")["spec"]["template"]["spec"]
    mounted = {v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    assert mounted == {t.api_key_secret for t in spec.tenants}
    assert pod["automountServiceAccountToken"] is False
    config = gateway_config_from_spec(spec, {"pipeline": "tiny"})
    paths = {m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    for policy in config.tenants:  # the gateway reads each key file where the Secret is mounted
        assert policy.api_keys_file is not None
        assert str(Path(policy.api_keys_file).parent) in paths


def test_the_crd_refuses_a_key_file_at_apply_time() -> None:
    """CEL on each tenant (the API server evaluates it; no CEL library here to run it)."""
    from wavepp.operator.crdgen import build_crd

    (version,) = build_crd()["spec"]["versions"]
    tenant = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["tenants"]
    rules = tenant["items"]["x-kubernetes-validations"]
    assert [(r["rule"], r["fieldPath"]) for r in rules] == [
        ("!has(self.apiKeysFile)", ".apiKeysFile")
    ]
    props = tenant["items"]["properties"]
    assert props["apiKeySecret"]["pattern"] and props["tokensPerSecond"]["type"] == "number"
