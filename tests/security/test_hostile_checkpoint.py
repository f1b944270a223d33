"""A hostile Hugging Face checkpoint directory: every bad config.json field, shard or index
entry is one ValueError (one line for ``wavepp validate``) naming the field or file and its
limit; no traceback, hang, silent acceptance, or unbounded work or memory."""

from __future__ import annotations

import hashlib
import json
import os
import random
import struct
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from wavepp import cli
from wavepp.runtime import hf_config
from wavepp.runtime.hf_config import load_model_dir, model_config_from_hf, read_hf_config
from wavepp.runtime.model_config import MAX_LAYERS, balanced_partition
from wavepp.runtime.stage.engine import checkpoint as checkpoint_module
from wavepp.runtime.stage.engine.balance import checkpoint_partition
from wavepp.runtime.stage.engine.checkpoint import CheckpointReader

LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 4,
    "vocab_size": 16,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "tie_word_embeddings": False,
}


def _tensors(layers: range) -> dict[str, torch.Tensor]:
    out = {f"model.layers.{i}.mlp.up_proj.weight": torch.ones(4, 2) for i in layers}
    return out | {f"model.layers.{i}.self_attn.q_proj.weight": torch.ones(2, 2) for i in layers}


def _ckpt(root: Path, config: dict[str, Any] | str | bytes = LLAMA, *, index: bool = True) -> Path:
    """A 2-layer llama directory: config.json and two shards with an index (or one
    model.safetensors)."""
    root.mkdir(parents=True, exist_ok=True)
    text = config if isinstance(config, str | bytes) else json.dumps(config)
    (root / "config.json").write_bytes(text if isinstance(text, bytes) else text.encode())
    head = {"model.embed_tokens.weight": torch.ones(16, 2), "model.norm.weight": torch.ones(2)}
    head["lm_head.weight"] = torch.ones(16, 2)
    if not index:
        save_file(_tensors(range(2)) | head, str(root / "model.safetensors"))
        return root
    shards = {"a.safetensors": _tensors(range(1)) | head, "b.safetensors": _tensors(range(1, 2))}
    for name, tensors in shards.items():
        save_file(tensors, str(root / name))
    weight_map = {key: name for name, tensors in shards.items() for key in tensors}
    _index(root, weight_map)
    return root


def _index(root: Path, weight_map: dict[str, Any]) -> None:
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _one_line_error(call: Any, *args: Any, match: str) -> str:
    with pytest.raises(ValueError, match=match) as info:
        call(*args)
    text = str(info.value)
    assert "\n" not in text, text
    return text


def _patched(**fields: Any) -> dict[str, Any]:
    return {**LLAMA, **fields}


# -- #3: size fields are bounded, floats finite --------------------------------------------

BOUNDS = [
    (_patched(num_hidden_layers=10**6), r"num_hidden_layers=1000000 is outside \[1, 1024\]"),
    (_patched(num_hidden_layers=10**12), r"num_hidden_layers=1000000000000 is outside \[1, 1024\]"),
    (_patched(vocab_size=10**15), r"vocab_size=1000000000000000 is outside \[1, 16777216\]"),
    (_patched(hidden_size=10**9), r"hidden_size=1000000000 is outside \[1, 65536\]"),
    (_patched(intermediate_size=10**9), r"intermediate_size=1000000000 is outside \[1, 1048576\]"),
    (_patched(num_attention_heads=2048), r"num_attention_heads=2048 is outside \[1, 1024\]"),
    (_patched(max_position_embeddings=1 << 25), r"max_position_embeddings=33554432 is outside"),
    (_patched(num_hidden_layers=-1), r"num_hidden_layers=-1 is outside \[1, 1024\]"),
    (
        _patched(model_type="deepseek_v3", n_routed_experts=10**5),
        r"n_routed_experts=100000 is outside \[0, 4096\]",
    ),
    # Kimi's aliased name is checked under the name the file uses
    (_patched(model_type="kimi_linear", num_experts=10**5), r"num_experts=100000 is outside"),
    (
        _patched(rope_parameters={"rope_type": "default", "rope_theta": "1e999999"}),
        r"rope_parameters.rope_theta='1e999999' must be a finite number > 0",
    ),
    (_patched(rms_norm_eps=0), r"rms_norm_eps=0 must be a finite number > 0"),
]


@pytest.mark.parametrize(("config", "match"), BOUNDS)
def test_size_fields_are_bounded_naming_field_and_limit(
    tmp_path: Path, config: dict[str, Any], match: str
) -> None:
    root = tmp_path / "m"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(config))
    _one_line_error(read_hf_config, root, match=match)
    _one_line_error(load_model_dir, root, match=match)
    _one_line_error(lambda c: model_config_from_hf(c, name="x"), config, match=match)


def test_an_infinite_rope_theta_literal_is_refused(tmp_path: Path) -> None:
    """``1e999`` parses to inf, refused as rope_theta, naming the field."""
    text = json.dumps(LLAMA)[:-1] + ', "rope_theta": 1e999}'
    root = tmp_path / "m"
    root.mkdir()
    (root / "config.json").write_text(text)
    _one_line_error(load_model_dir, root, match=r"rope_theta=inf must be a finite number > 0")


def test_the_largest_published_shapes_are_inside_the_limits() -> None:
    """The limits are generous: DeepSeek-V3's and Llama-4's real values pass."""
    dsv3 = {
        "model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
        "num_key_value_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1,
        "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3,
        "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 129280,
        "max_position_embeddings": 163840, "rope_theta": 10000, "rms_norm_eps": 1e-6,
        "routed_scaling_factor": 2.5,
    }  # fmt: skip
    model = model_config_from_hf(dsv3, name="dsv3")
    assert (model.num_layers, model.vocab_size, model.head_dim) == (61, 129280, 192)
    llama4 = _patched(max_position_embeddings=10485760, rope_theta=500000.0, vocab_size=202048)
    assert model_config_from_hf(llama4, name="l4").max_position == 10485760


def test_a_million_layer_config_is_refused_by_validate_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """10**6 layers are refused by validate at once (exit 2, well under 30 s), not walked."""
    root = _ckpt(tmp_path / "m", _patched(num_hidden_layers=10**6))
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"model": {"name": "m", "path": str(root)}, "stages": 2}))
    started = time.monotonic()
    assert cli.main(["validate", str(spec)]) == 2
    assert time.monotonic() - started < 30
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert "spec.model.path" in err and "num_hidden_layers=1000000 is outside [1, 1024]" in err
    with pytest.raises(ValueError, match=r"num_hidden_layers=1000000 is outside"):
        checkpoint_partition(root, 2)


def test_the_partition_cost_is_bounded() -> None:
    """balanced_partition refuses more than MAX_LAYERS layers; at the limit it is exact and
    quick (O(S L^2) comparisons, vectorised: was ~33M Python iterations at 1024 x 64)."""
    with pytest.raises(ValueError, match=r"num_layers=1025: at most 1024 layers"):
        balanced_partition([1.0] * (MAX_LAYERS + 1), 2)
    assert balanced_partition([1.0] * MAX_LAYERS, 64) == [16] * 64
    heavy_first = [4.0] + [1.0] * (MAX_LAYERS - 1)
    counts = balanced_partition(heavy_first, 8, last_extra=3.0)
    assert sum(counts) == MAX_LAYERS and counts[0] < counts[1] and counts[-1] < counts[1]


def _reference_partition(
    costs: list[float], stages: int, allowed: list[bool] | None, first: float, last: float
) -> list[int] | None:
    """The plain O(S N^2) dynamic programme balanced_partition vectorises (first minimum)."""
    n, inf = len(costs), float("inf")
    ok = allowed or [True] * n
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    arg = [[-1] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for j in range(s, n + 1):
            for i in range(s - 1, j):
                if best[s - 1][i] == inf or not ok[i]:
                    continue
                cost = prefix[j] - prefix[i] + (first if i == 0 else 0.0)
                cost += last if (s == stages and j == n) else 0.0
                if max(best[s - 1][i], cost) < best[s][j]:
                    best[s][j], arg[s][j] = max(best[s - 1][i], cost), i
    if best[stages][n] == inf:
        return None
    counts, j = [], n
    for s in range(stages, 0, -1):
        counts.append(j - arg[s][j])
        j = arg[s][j]
    return counts[::-1]


def test_the_vectorised_partition_agrees_with_the_plain_programme() -> None:
    rng = random.Random(7)
    for _ in range(400):
        n = rng.randint(1, 12)
        stages = rng.randint(1, n)
        costs = [rng.choice([0.0, 1.0, 2.0, 3.0, rng.random() * 4]) for _ in range(n)]
        allowed = None
        if rng.random() < 0.5:
            allowed = [True] + [rng.random() < 0.7 for _ in range(n - 1)]
        first, last = rng.choice([0.0, 1.5]), rng.choice([0.0, 2.0, 3.7])
        expected = _reference_partition(costs, stages, allowed, first, last)
        if expected is None:
            with pytest.raises(ValueError, match="no split"):
                balanced_partition(
                    costs, stages, allowed_starts=allowed, first_extra=first, last_extra=last
                )
            continue
        got = balanced_partition(
            costs, stages, allowed_starts=allowed, first_extra=first, last_extra=last
        )
        assert got == expected, (costs, stages, allowed, first, last)


# -- #4: hostile values are one error naming the field, not a traceback -------------------

HOSTILE = [
    (_patched(num_attention_heads=[4]), r"num_attention_heads=\[4\] must be an integer in"),
    (_patched(num_attention_heads={}), r"num_attention_heads=\{\} must be an integer in"),
    (
        {k: v for k, v in _patched(num_attention_heads=0).items() if k != "head_dim"},
        r"num_attention_heads=0 is outside \[1, 1024\]",
    ),
    (_patched(hidden_size=float("inf")), r"hidden_size=inf must be an integer in \[1, 65536\]"),
    (_patched(hidden_size=float("nan")), r"hidden_size=nan must be an integer"),
    (_patched(num_hidden_layers=2.7), r"num_hidden_layers=2.7 must be an integer"),
    (_patched(num_hidden_layers=True), r"num_hidden_layers=True must be an integer"),
    (_patched(rope_parameters=[1]), r"rope_parameters=\[1\] must be an object or null"),
    (_patched(rope_parameters="x"), r"rope_parameters='x' must be an object or null"),
    (_patched(rms_norm_eps="x"), r"rms_norm_eps='x' must be a finite number > 0"),
    (_patched(attention_bias="false"), r"attention_bias='false' must be true or false"),
    (_patched(model_type=["llama"]), r"model_type=\['llama'\] must be a string"),
    (
        _patched(model_type="glm_moe_dsa", indexer_types="full"),
        r"indexer_types must be a list of at most 1024 strings",
    ),
]


@pytest.mark.parametrize(("config", "match"), HOSTILE)
def test_hostile_values_are_one_error_naming_the_field(
    tmp_path: Path, config: dict[str, Any], match: str
) -> None:
    root = tmp_path / "m"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(config))
    text = _one_line_error(load_model_dir, root, match=match)
    assert str(root / "config.json") in text


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("[" * 100_000 + "]" * 100_000, "JSON nested too deeply"),
        ('{"a":' * 50_000 + "1" + "}" * 50_000, "JSON nested too deeply"),
        (b"\xff\xfe{}", "not UTF-8"),
        ('{"vocab_size": ' + "9" * 5000 + "}", "not valid JSON"),
        ("[1, 2]", "must hold a JSON object"),
    ],
)
def test_malformed_config_json_is_one_error(tmp_path: Path, text: str | bytes, match: str) -> None:
    root = tmp_path / "m"
    root.mkdir()
    (root / "config.json").write_bytes(text if isinstance(text, bytes) else text.encode())
    _one_line_error(read_hf_config, root, match=match)


def test_a_missing_family_field_is_named_by_the_partition(tmp_path: Path) -> None:
    """A minimax config without num_local_experts is refused in one line naming the field,
    not a traceback from the cost split."""
    cfg = _patched(model_type="minimax_m2", num_experts_per_tok=2)
    root = _ckpt(tmp_path / "m", cfg)
    _one_line_error(
        checkpoint_partition, root, 2, match=r"field 'num_local_experts' is missing; a minimax_m2"
    )


def _truncated(root: Path) -> None:
    shard = root / "b.safetensors"
    shard.write_bytes(shard.read_bytes()[:-7])


def _lying_header(root: Path) -> None:
    shard = root / "b.safetensors"
    shard.write_bytes(struct.pack("<Q", 1 << 40) + shard.read_bytes()[8:])


def _not_safetensors(root: Path) -> None:
    (root / "notes.txt").write_text("root:x:0:0:root:/root:/bin/bash\n")
    weight_map = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
    _index(root, {**weight_map, "model.layers.1.mlp.up_proj.weight": "notes.txt"})


@pytest.mark.parametrize("damage", [_truncated, _lying_header, _not_safetensors])
def test_an_unreadable_shard_is_one_error_naming_the_file(tmp_path: Path, damage: Any) -> None:
    """One error naming the file, not a SafetensorError traceback (from validate or a stage's
    load)."""
    root = _ckpt(tmp_path / "m")
    damage(root)
    match = r"(b\.safetensors|notes\.txt): (not a readable safetensors file|cannot read tensor)"
    _one_line_error(checkpoint_partition, root, 2, match=match)
    reader = CheckpointReader(root)
    _one_line_error(reader.read, ["model.layers.1.mlp.up_proj.weight"], match=match)
    _one_line_error(reader.read_part, "model.layers.1.mlp.up_proj.weight", match=match)


def test_an_unreadable_single_file_checkpoint_is_one_error(tmp_path: Path) -> None:
    root = _ckpt(tmp_path / "m", index=False)
    (root / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    _one_line_error(CheckpointReader, root, match=r"model.safetensors: not a readable safetensors")


def test_validate_names_a_truncated_shard_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _ckpt(tmp_path / "m")
    _truncated(root)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"model": {"name": "m", "path": str(root)}, "stages": 2}))
    assert cli.main(["validate", str(spec)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "b.safetensors: not a readable safetensors file" in err


# -- #5: shards stay inside the model directory -------------------------------------------


@pytest.mark.parametrize("entry", ["absolute", "../outside/a.safetensors", "../../etc/passwd"])
def test_an_index_entry_outside_the_directory_is_refused_naming_it(
    tmp_path: Path, entry: str
) -> None:
    """An index entry that is an absolute path or leaves the directory (../../../../etc/passwd)
    is refused, never opened."""
    outside = _ckpt(tmp_path / "outside")
    root = _ckpt(tmp_path / "m")
    target = str(outside / "a.safetensors") if entry == "absolute" else entry
    weight_map = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
    _index(root, {**weight_map, "model.norm.weight": target})
    text = _one_line_error(CheckpointReader, root, match=r"a shard must be a file inside")
    assert "weight_map['model.norm.weight']" in text and target in text
    _one_line_error(checkpoint_partition, root, 2, match=r"weight_map\['model.norm.weight'\]")


def test_a_shard_symlink_leaving_the_directory_is_refused(tmp_path: Path) -> None:
    outside = _ckpt(tmp_path / "outside")
    root = _ckpt(tmp_path / "m")
    (root / "b.safetensors").unlink()
    (root / "b.safetensors").symlink_to(outside / "b.safetensors")
    _one_line_error(CheckpointReader, root, match=r"'b.safetensors' resolves to .*, outside")
    single = _ckpt(tmp_path / "single", index=False)
    (single / "model.safetensors").unlink()
    (single / "model.safetensors").symlink_to(outside / "a.safetensors")
    _one_line_error(CheckpointReader, single, match=r"'model.safetensors' resolves to .*outside")


def test_the_hub_cache_layout_links_into_its_own_blobs(tmp_path: Path) -> None:
    """huggingface_hub's cache: snapshots/<rev>/<file> -> ../../blobs/<hash> is accepted."""
    repo = tmp_path / "models--x--tiny"
    built = _ckpt(tmp_path / "built")
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for file in built.iterdir():
        blob = repo / "blobs" / hashlib.sha256(file.name.encode()).hexdigest()
        blob.write_bytes(file.read_bytes())
        (snapshot / file.name).symlink_to(Path("../../blobs") / blob.name)
    reader = CheckpointReader(snapshot)
    assert reader.read(["model.layers.1.mlp.up_proj.weight"])
    assert checkpoint_partition(snapshot, 2) == [1, 1]


def test_a_fifo_shard_or_index_is_refused_not_waited_on(tmp_path: Path) -> None:
    root = _ckpt(tmp_path / "m")
    (root / "b.safetensors").unlink()
    os.mkfifo(root / "b.safetensors")
    started = time.monotonic()
    _one_line_error(CheckpointReader, root, match=r"b.safetensors is not a regular file")
    (root / "model.safetensors.index.json").unlink()
    os.mkfifo(root / "model.safetensors.index.json")
    _one_line_error(CheckpointReader, root, match=r"index.json: not a regular file")
    assert time.monotonic() - started < 10


@pytest.mark.parametrize(
    ("weight_map", "match"),
    [
        ({"lm_head.weight": 3}, r"weight_map\['lm_head.weight'\] must be a shard file name"),
        ({"lm_head.weight": ""}, r"weight_map\['lm_head.weight'\] must be a shard file name"),
        ({}, r"'weight_map' must be a non-empty object"),
    ],
)
def test_malformed_index_entries_are_named(
    tmp_path: Path, weight_map: dict[str, Any], match: str
) -> None:
    root = _ckpt(tmp_path / "m")
    _index(root, weight_map)
    _one_line_error(CheckpointReader, root, match=match)


# -- #8: config.json (and the index) are bounded, regular, and read once ------------------


def test_an_oversized_config_json_is_refused_before_reading(tmp_path: Path) -> None:
    """A config.json past the size limit is refused from its size, unread. A sparse 17 MiB
    file costs no disk."""
    root = tmp_path / "m"
    root.mkdir()
    with open(root / "config.json", "wb") as handle:
        handle.truncate(17 << 20)
    _one_line_error(read_hf_config, root, match=r"17825792 bytes; at most 16777216 are read")


def test_the_size_caps_can_be_lowered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = _ckpt(tmp_path / "m")
    monkeypatch.setattr(hf_config, "MAX_CONFIG_BYTES", 64)
    _one_line_error(load_model_dir, root, match=r"config.json: \d+ bytes; at most 64 are read")
    monkeypatch.setattr(checkpoint_module, "MAX_INDEX_BYTES", 64)
    _one_line_error(CheckpointReader, root, match=r"index.json: \d+ bytes; at most 64 are read")


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_config_json_that_is_not_a_regular_file(
    tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A config.json that is not a regular file (a FIFO would block a reader) is refused as such,
    not reported as missing."""
    root = _ckpt(tmp_path / "m")
    (root / "config.json").unlink()
    if kind == "fifo":
        os.mkfifo(root / "config.json")
    else:
        (root / "config.json").symlink_to("/dev/zero")
    started = time.monotonic()
    _one_line_error(load_model_dir, root, match=r"config.json: not a regular file")
    spec = tmp_path / "spec.json"
    model = {"name": "m", "path": str(root), "config": {"numLayers": 2}}
    spec.write_text(json.dumps({"model": model, "stages": 2}))
    assert cli.main(["validate", str(spec)]) == 2
    assert "config.json: not a regular file" in capsys.readouterr().err
    assert time.monotonic() - started < 10


def test_the_model_name_hashes_the_bytes_parsed_from_one_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """config.json is read once: the bytes parsed are the bytes hashed into the name, so the
    name cannot describe another file than the one parsed. A second read fails the test."""
    root = _ckpt(tmp_path / "m")
    raw = (root / "config.json").read_bytes()

    def second_read(self: Path, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"{self} read a second time")

    monkeypatch.setattr(Path, "read_bytes", second_read)
    monkeypatch.setattr(Path, "read_text", second_read)
    model = load_model_dir(root)
    assert model.name == f"m-{hashlib.sha256(raw).hexdigest()[:8]}"
    assert model.num_layers == 2


# ---- the gateway's tokenizer.json (read whole into memory) ---------------------------------


def test_a_tokenizer_file_that_is_too_large_or_not_a_regular_file_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from wavepp.gateway import http

    big = tmp_path / "tokenizer.json"
    big.write_bytes(b" " * 2048)
    monkeypatch.setattr(http, "MAX_TOKENIZER_BYTES", 1024)
    with pytest.raises(ValueError, match=r"2048 bytes, over the limit of 1024"):
        http.load_tokenizer(str(tmp_path))  # the directory's tokenizer.json
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    started = time.monotonic()
    with pytest.raises(ValueError, match="not a regular file"):
        http.load_tokenizer(str(fifo))  # not handed to transformers, which would read the FIFO
    assert time.monotonic() - started < 5.0
