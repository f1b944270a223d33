"""Block hashing (wavepp.runtime.kv.hashing): the documented encoding of the root and block
hashes, the chain over full blocks, salts and model ids, equality across processes, PromptHasher
against the per-block definition, and the errors of bad arguments."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wavepp.runtime.kv import (
    PromptHasher,
    hash_block_tokens,
    hash_prompt_blocks,
    root_block_hash,
)

MODEL_ID = "tiny-llama"


# ---- hashing --------------------------------------------------------------------------------


def test_root_hash_matches_documented_encoding() -> None:
    def encode(text: str) -> bytes:
        data = text.encode()
        return struct.pack("<I", len(data)) + data

    expected = hashlib.sha256(
        b"wavepp.root_block_hash.v1\x00" + encode("m\u00e9") + encode("tenant")
    ).digest()
    assert root_block_hash("m\u00e9", "tenant") == expected


def test_block_hash_matches_documented_encoding() -> None:
    parent = root_block_hash(MODEL_ID, "")
    expected = hashlib.sha256(parent + struct.pack("<4I", 3, 7, 0, 2**32 - 1)).digest()
    assert hash_block_tokens(parent, [7, 0, 2**32 - 1]) == expected


def test_prompt_hashes_are_a_chain_of_full_blocks_only() -> None:
    token_ids = list(range(100, 111))  # 11 tokens, block_size 4: 2 full blocks, 3 left over
    block_hashes = hash_prompt_blocks(token_ids, 4, MODEL_ID, "s")
    root = root_block_hash(MODEL_ID, "s")
    h0 = hash_block_tokens(root, token_ids[0:4])
    h1 = hash_block_tokens(h0, token_ids[4:8])
    assert block_hashes == [h0, h1]
    assert all(len(block_hash) == 32 for block_hash in block_hashes)
    # the partial block does not count: changing it changes nothing, extending it adds a hash
    assert hash_prompt_blocks(token_ids[:8] + [1, 2, 3], 4, MODEL_ID, "s") == block_hashes
    longer = hash_prompt_blocks(token_ids + [5], 4, MODEL_ID, "s")
    assert longer[:2] == block_hashes and len(longer) == 3
    assert hash_prompt_blocks(token_ids[:3], 4, MODEL_ID, "s") == []


def test_changing_an_early_token_changes_every_later_hash() -> None:
    token_ids = list(range(12))
    changed = [99] + token_ids[1:]
    a = hash_prompt_blocks(token_ids, 4, MODEL_ID)
    b = hash_prompt_blocks(changed, 4, MODEL_ID)
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_cache_salt_and_model_separate_hashes() -> None:
    token_ids = list(range(8))
    plain = hash_prompt_blocks(token_ids, 4, MODEL_ID)
    assert plain == hash_prompt_blocks(token_ids, 4, MODEL_ID, "")
    salted = hash_prompt_blocks(token_ids, 4, MODEL_ID, "tenant-a")
    other_salt = hash_prompt_blocks(token_ids, 4, MODEL_ID, "tenant-b")
    other_model = hash_prompt_blocks(token_ids, 4, "other-model")
    for block_hashes in (salted, other_salt, other_model):
        assert not set(block_hashes) & set(plain)
    assert not set(salted) & set(other_salt)
    # the length prefixes keep ("ab", "c") and ("a", "bc") apart
    assert root_block_hash("ab", "c") != root_block_hash("a", "bc")


_SUBPROCESS_SNIPPET = (
    "from wavepp.runtime.kv import hash_prompt_blocks;"
    "print(','.join(h.hex() for h in hash_prompt_blocks(list(range(40)), 16, 'm', 'salt')))"
)


def test_hashes_are_equal_across_processes_and_hash_seeds() -> None:
    outputs = []
    for seed in ("1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run(
            [sys.executable, "-c", _SUBPROCESS_SNIPPET],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        outputs.append(result.stdout.strip())
    here = ",".join(h.hex() for h in hash_prompt_blocks(list(range(40)), 16, "m", "salt"))
    assert outputs[0] == outputs[1] == here
    assert len(here.split(",")) == 2


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: hash_prompt_blocks([1, 2], 0, MODEL_ID), "block_size must be an int > 0, got 0"),
        (lambda: hash_prompt_blocks([1, 2], -4, MODEL_ID), "block_size"),
        (lambda: root_block_hash("", "s"), "model_id must be a non-empty str"),
        (lambda: hash_block_tokens(b"short", [1]), "parent_block_hash must be a 32-byte"),
        (lambda: hash_block_tokens(b"\0" * 32, [1, -1]), r"token_ids\[1\] = -1"),
        (lambda: hash_block_tokens(b"\0" * 32, [2**32]), r"token_ids\[0\]"),
        (lambda: hash_block_tokens(b"\0" * 32, [1.5]), r"token_ids\[0\] = 1.5"),
    ],
)
def test_hashing_rejects_bad_arguments(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


_SHARED_TOKENS = [list(range(100 + 40 * i, 140 + 40 * i)) for i in range(2)]


@settings(max_examples=200, deadline=None)
@given(
    prompts=st.lists(
        st.tuples(
            st.integers(0, 1),  # which shared prefix
            st.integers(0, 40),  # how much of it
            st.lists(st.integers(0, 3), max_size=12),  # then new tokens
            st.sampled_from(["", "tenant"]),
        ),
        min_size=1,
        max_size=12,
    )
)
def test_a_prompt_hasher_hashes_as_hash_prompt_blocks(prompts: list) -> None:
    """Prompts sharing prefixes of every length (also mid-block, and with other salts): the
    hasher that reuses a recent prompt's blocks answers exactly as hashing from scratch."""
    hasher = PromptHasher(4, MODEL_ID, max_prompts=2)
    for which, length, tail, salt in prompts:
        token_ids = _SHARED_TOKENS[which][:length] + tail
        assert hasher(token_ids, salt) == hash_prompt_blocks(token_ids, 4, MODEL_ID, salt)


def _reference_chain(token_ids: list[int], block_size: int, salt: str) -> list[bytes]:
    """The chain by its definition: ``hash_block_tokens`` (one ``struct.pack`` per block)."""
    parent, chain = root_block_hash(MODEL_ID, salt), []
    for start in range(0, len(token_ids) // block_size * block_size, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        chain.append(parent)
    return chain


@settings(max_examples=150, deadline=None)
@given(
    base=st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=70),
    edits=st.lists(
        st.tuples(st.integers(0, 69), st.sampled_from([0, 1, 2**31, 2**32 - 1])), max_size=3
    ),
    cut=st.integers(0, 70),
    block_size=st.sampled_from([1, 3, 8]),
)
def test_hashes_are_byte_identical_to_the_per_block_definition(
    base: list[int], edits: list, cut: int, block_size: int
) -> None:
    """``hash_prompt_blocks`` (one vectorised encoding of the prompt) and ``PromptHasher``
    (the first differing token found by a vectorised compare against the latest prompt) give
    exactly the hashes of the per-block definition, over the whole u32 range, for prompts that
    differ from the one before at any position (or not at all, or are cut short)."""
    hasher = PromptHasher(block_size, MODEL_ID)
    edited = list(base)
    for position, value in edits:
        if position < len(edited):
            edited[position] = value
    for token_ids in (base, edited, edited[:cut], base, base + [7] * block_size):
        assert hash_prompt_blocks(token_ids, block_size, MODEL_ID) == _reference_chain(
            token_ids, block_size, ""
        )
        assert hasher(token_ids) == _reference_chain(token_ids, block_size, "")


def test_prompt_hashes_keep_their_values() -> None:
    """The encoding is a wire contract between processes and versions: the first two hashes of
    a fixed prompt (values from before the vectorised encoder; a change here changes every
    stored block's name)."""
    token_ids = [0, 1, 2**32 - 1, 70000, *range(12)]
    assert [h.hex()[:16] for h in hash_prompt_blocks(token_ids, 8, "m", "salt")] == [
        "63161e300df79f77",
        "ec41e21a33e8b2fc",
    ]


def test_a_prompt_hasher_refuses_what_hash_prompt_blocks_refuses() -> None:
    hasher = PromptHasher(4, MODEL_ID)
    with pytest.raises(ValueError, match="token_ids"):
        hasher([1, 2, -3, 4])
    with pytest.raises(ValueError, match="model_id"):
        PromptHasher(4, "")([1, 2, 3, 4])
