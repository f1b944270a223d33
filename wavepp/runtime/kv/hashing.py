"""Block hashing: chained sha256 over a canonical byte encoding.

``root_block_hash``, ``hash_block_tokens``, ``hash_prompt_blocks``: every stage (and every process)
computes the same block hashes for the same tokens, model and cache salt. Pure: no I/O, no torch.
Ideas follow vLLM (vllm/v1/core/kv_cache_utils.py); no code is copied.
"""

from __future__ import annotations

import hashlib
import operator
import struct
import sys
from array import array
from collections.abc import Sequence

BlockHash = bytes


"""A 32-byte sha256 digest naming a full block and, through the chain, its whole prefix."""


BLOCK_HASH_NUM_BYTES = 32


# NOTE: domain tags keep a root hash from ever equalling a block hash of some token sequence,
# and version the encoding: changing the encoding must change the tag.
_ROOT_TAG = b"wavepp.root_block_hash.v1\x00"


_MAX_TOKEN_ID = 2**32 - 1


def _encode_str(value: str) -> bytes:
    data = value.encode("utf-8")
    return struct.pack("<I", len(data)) + data


def _is_token_id(value: object) -> bool:
    try:
        return 0 <= operator.index(value) <= _MAX_TOKEN_ID  # type: ignore[arg-type]
    except TypeError:
        return False


def check_block_hash(value: object, field: str) -> None:
    if not isinstance(value, bytes) or len(value) != BLOCK_HASH_NUM_BYTES:
        got = f"{len(value)} bytes" if isinstance(value, bytes) else type(value).__name__
        raise ValueError(
            f"{field} must be a {BLOCK_HASH_NUM_BYTES}-byte sha256 digest (BlockHash), got {got}; "
            "compute it with root_block_hash/hash_block_tokens"
        )


def root_block_hash(model_id: str, cache_salt: str) -> BlockHash:
    """Hash h_{-1} that seeds a prompt's block hash chain (docs/design.md, "block hash").

    Encoding (all integers little-endian)::

        sha256(b"wavepp.root_block_hash.v1\\x00"
               || u32 len(model_id_utf8) || model_id_utf8
               || u32 len(cache_salt_utf8) || cache_salt_utf8)

    Independent of the process (no Python ``hash()``, no random seed), so all stages agree.

    Args:
        model_id: Model name or path; part of the seed so two models never share blocks.
        cache_salt: Per-tenant salt; ``""`` means the shared (unsalted) namespace.

    Returns:
        32-byte digest.

    Raises:
        ValueError: if ``model_id`` is empty or either argument is not a str.
    """
    if not isinstance(model_id, str) or not model_id:
        raise ValueError(f"model_id must be a non-empty str, got {model_id!r}")
    if not isinstance(cache_salt, str):
        raise ValueError(f'cache_salt must be a str ("" for none), got {cache_salt!r}')
    return hashlib.sha256(_ROOT_TAG + _encode_str(model_id) + _encode_str(cache_salt)).digest()


def hash_block_tokens(parent_block_hash: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Hash h_i = sha256(h_{i-1} || tokens of block i) (docs/design.md, "block hash").

    Encoding (little-endian)::

        sha256(parent_block_hash (32 bytes) || u32 num_tokens || num_tokens x u32 token id)

    Args:
        parent_block_hash: h_{i-1}; for the first block, ``root_block_hash(model_id, salt)``.
        token_ids: The block's token ids, each in [0, 2**32). Length is normally
            ``block_size``; it is part of the encoding, so any length hashes unambiguously.

    Returns:
        32-byte digest.

    Raises:
        ValueError: if ``parent_block_hash`` is not 32 bytes or a token id is not an int in
            [0, 2**32).
    """
    check_block_hash(parent_block_hash, "parent_block_hash")
    num_tokens = len(token_ids)
    try:
        encoded = struct.pack(f"<I{num_tokens}I", num_tokens, *token_ids)
    except struct.error:
        for position, token_id in enumerate(token_ids):
            if not _is_token_id(token_id):
                raise ValueError(
                    f"token_ids[{position}] = {token_id!r} must be an int in [0, {_MAX_TOKEN_ID}]"
                ) from None
        raise
    return hashlib.sha256(parent_block_hash + encoded).digest()


def hash_prompt_blocks(
    token_ids: Sequence[int], block_size: int, model_id: str, cache_salt: str = ""
) -> list[BlockHash]:
    """Chained hashes of a prompt's full blocks; the trailing partial block is not hashed.

    Layout (block_size = 4, 10 tokens)::

        tokens  [t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9]
        hashes   h0            h1            (none: partial)
        h0 = hash_block_tokens(root_block_hash(model_id, cache_salt), t0..t3)
        h1 = hash_block_tokens(h0, t4..t7)

    Args:
        token_ids: The prompt's token ids.
        block_size: Tokens per block, > 0.
        model_id: Model name, seeds the chain (see ``root_block_hash``).
        cache_salt: Per-tenant salt, seeds the chain.

    Returns:
        ``len(token_ids) // block_size`` hashes, block order.

    Raises:
        ValueError: if ``block_size <= 0`` or a hashing argument is invalid.
    """
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be an int > 0, got {block_size!r}")
    parent = root_block_hash(model_id, cache_salt)
    num_blocks = len(token_ids) // block_size
    encoded = _encode_tokens(token_ids, num_blocks * block_size)
    if encoded is None:  # not plain ints in range: the per-block path names the bad token
        block_hashes: list[BlockHash] = []
        for start in range(0, num_blocks * block_size, block_size):
            parent = hash_block_tokens(parent, token_ids[start : start + block_size])
            block_hashes.append(parent)
        return block_hashes
    # Same bytes as hash_block_tokens, encoded once for the whole prompt, not once per block.
    header = struct.pack("<I", block_size)
    width = 4 * block_size
    sha256 = hashlib.sha256
    hashes = []
    for start in range(0, num_blocks * width, width):
        parent = sha256(parent + header + encoded[start : start + width]).digest()
        hashes.append(parent)
    return hashes


class PromptHasher:
    """``hash_prompt_blocks`` for one model and block size, remembering recent prompts: the full
    blocks a prompt shares with the latest one that began with the same block (same salt, the
    same token ids) are not hashed again; only the rest is. Exact: a block's hash is a function
    of the salt and every token up to its end, and those bytes are compared.

    Agentic and chat prompts share thousands of tokens with the one before and add a few
    hundred, so the cost is one encoding of the prompt's token ids to u32 bytes
    (``array("I")``), a binary search for the shared blocks and one sha256 per new block
    (timings: docs/bench/cadence.md, "Prompt hashing").

    Args:
        block_size: Tokens per block, > 0.
        model_id: Model name (the chain's seed, with the salt).
        max_prompts: Prefix roots remembered (the latest prompt of each; oldest dropped).
    """

    def __init__(self, block_size: int, model_id: str, *, max_prompts: int = 64) -> None:
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be an int > 0, got {block_size!r}")
        self.block_size = block_size
        self.model_id = model_id
        self.max_prompts = max_prompts
        # (salt, first block's bytes) -> (the latest such prompt's full-block bytes, hashes)
        self._recent: dict[tuple[str, bytes], tuple[bytes, list[BlockHash]]] = {}

    def __call__(self, token_ids: Sequence[int], cache_salt: str = "") -> list[BlockHash]:
        """The prompt's full-block hashes, as ``hash_prompt_blocks``; raises as it does."""
        block_size = self.block_size
        num_blocks = len(token_ids) // block_size
        encoded = _encode_tokens(token_ids, num_blocks * block_size)
        if encoded is None or num_blocks == 0 or not isinstance(cache_salt, str):
            return hash_prompt_blocks(token_ids, block_size, self.model_id, cache_salt)
        width = 4 * block_size
        key = (cache_salt, encoded[:width])
        latest = self._recent.pop(key, None)
        num_known = 0
        hashes: list[BlockHash] = []
        if latest is not None:
            known_bytes, known_hashes = latest
            # prefix equality is monotone: binary search the longest equal run of whole blocks
            lo, hi = 1, min(num_blocks, len(known_hashes))  # block 0 is equal (the key)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if encoded[: mid * width] == known_bytes[: mid * width]:
                    lo = mid
                else:
                    hi = mid - 1
            num_known = lo
            hashes = known_hashes[:num_known]
        parent = hashes[-1] if hashes else root_block_hash(self.model_id, cache_salt)
        header = struct.pack("<I", block_size)
        sha256 = hashlib.sha256
        for start in range(num_known * width, num_blocks * width, width):
            parent = sha256(parent + header + encoded[start : start + width]).digest()
            hashes.append(parent)
        self._recent[key] = (encoded, hashes)
        if len(self._recent) > self.max_prompts:
            del self._recent[next(iter(self._recent))]
        return list(hashes)


def _encode_tokens(token_ids: Sequence[int], num_tokens: int) -> bytes | None:
    """The first ``num_tokens`` ids as little-endian u32 bytes; None unless every one is an int
    in [0, 2**32)."""
    try:
        # the whole sequence, then cut: slicing first would copy every token once more
        encoded = array("I", token_ids)
    except (TypeError, OverflowError, ValueError):
        return None
    del encoded[num_tokens:]
    if encoded.itemsize != 4:  # pragma: no cover - no such platform in use
        return None
    if sys.byteorder != "little":  # pragma: no cover
        encoded.byteswap()
    return encoded.tobytes()
