"""The stage side of prefix agreement: a pure handler over one stage's ``StageKVManager``.

``handle_kv_request`` answers ProbePin, Commit, Release, Renew and Health messages (wire types in
``wavepp.api.messages``); the stage process owns the NATS I/O around it. No I/O here.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import ValidationError

from wavepp.api.messages import (
    KV_REQUEST_ADAPTER,
    Commit,
    Health,
    KVReply,
    ProbePin,
    Release,
    Renew,
)
from wavepp.runtime.kv import StageKVManager


@dataclass
class StageRequest:
    """What a stage remembers of a request between probe and release."""

    block_hashes: list[bytes]
    num_agreed_blocks: int = -1  # L* once committed


def handle_kv_request(
    manager: StageKVManager,
    rank: int,
    payload: bytes,
    requests: dict[str, StageRequest] | None = None,
) -> KVReply:
    """Apply one KV op to a stage's manager and return the reply. Never raises on bad input.

    Args:
        manager: the stage's KV manager (its single owner calls this).
        rank: the stage's rank, echoed in the reply.
        payload: a JSON ``KVRequest``.
        requests: if given, the stage's record of each request (the prompt's block hashes from
            ``probe_pin``, L* from ``commit``) is kept here until ``release``; the stage needs
            the hashes to cache blocks once they are computed.

    Returns:
        ``KVReply`` with ``ok=False`` and ``error`` naming the field for an invalid message or a
        refused reservation; the manager's state is unchanged by a rejected message.
    """
    pool = manager.pool
    try:
        msg = KV_REQUEST_ADAPTER.validate_json(payload)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        return KVReply(rank=rank, ok=False, error=f"invalid KV request: {where}: {first['msg']}")
    try:
        if isinstance(msg, ProbePin):
            hashes = [bytes.fromhex(h) for h in msg.block_hashes]
            num_hit = manager.probe_pin(msg.request_id, hashes, msg.lease_s)
            if requests is not None and msg.request_id not in requests:
                requests[msg.request_id] = StageRequest(block_hashes=hashes)
            return KVReply(
                rank=rank,
                num_hit_blocks=num_hit,
                num_free_blocks=pool.num_free_blocks,
                num_blocks=pool.num_blocks,
            )
        if isinstance(msg, Commit):
            table = manager.commit(
                msg.request_id, msg.num_agreed_blocks, msg.num_total_blocks, msg.lease_s
            )
            if table is None:
                if requests is not None:
                    requests.pop(msg.request_id, None)
                return KVReply(
                    rank=rank,
                    ok=False,
                    error=(
                        f"reservation refused: needs {msg.num_total_blocks - msg.num_agreed_blocks}"
                        f" blocks, {pool.num_free_blocks} free of {pool.num_blocks}"
                    ),
                    num_free_blocks=pool.num_free_blocks,
                    num_blocks=pool.num_blocks,
                )
            if requests is not None and msg.request_id in requests:
                requests[msg.request_id].num_agreed_blocks = msg.num_agreed_blocks
            return KVReply(
                rank=rank,
                num_reserved_blocks=len(table) - msg.num_agreed_blocks,
                num_free_blocks=pool.num_free_blocks,
                num_blocks=pool.num_blocks,
            )
        if isinstance(msg, Release):
            for request_id in msg.request_ids:
                manager.release(request_id)
                if requests is not None:
                    requests.pop(request_id, None)
        elif isinstance(msg, Renew):
            manager.renew(msg.request_ids, msg.lease_s)
        elif isinstance(msg, Health):
            pass
        return KVReply(rank=rank, num_free_blocks=pool.num_free_blocks, num_blocks=pool.num_blocks)
    except (ValueError, KeyError) as exc:
        return KVReply(rank=rank, ok=False, error=f"{type(msg).__name__}: {exc}")
