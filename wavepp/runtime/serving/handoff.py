"""The prefill side of vLLM's disaggregated-serving protocol: a handed-off request's answer
carries ``kv_transfer_params`` that the decode engine's request consumes.

``kv_transfer_params`` of a WavePP prefill answer::

    {"do_remote_prefill": true, "do_remote_decode": false,
     "wavepp_handoff": HandoffParams.to_json()}   # wavepp.api.kv_handoff

A P/D router passes them unchanged into the decode request, as it does a NixlConnector's; the
decode engine's ``WavePPConnector`` pulls the KV from the stages named there.

``release_handoff`` ends such a lease on every stage at once (the gateway when the decode
fails, the admission when the gateway cancelled the request) instead of at its expiry;
``release_handoff_report`` also says, per stage, whether it still held the lease or why not,
which the gateway puts into a failed request's error (``describe_release``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from wavepp.api.kv_handoff import (
    HANDOFF_DOMAIN,
    LENGTH_BYTES,
    PARAMS_KEY,
    HandoffError,
    HandoffParams,
    StageEndpoint,
    encode_json,
    expires_text,
    parse_json_frame,
)
from wavepp.api.kv_handoff import token_payload as _payload
from wavepp.api.signing import BusKey

log = logging.getLogger(__name__)


def handoff_token(replica_key: BusKey, request_id: str, expires: float) -> str:
    """The token that lets one decode engine pull (and release) ``request_id``'s KV until
    ``expires`` (``wavepp.api.kv_handoff``); ``replica_key``: ``BusKey.for_replica``."""
    return replica_key.mac_bytes(HANDOFF_DOMAIN, _payload(request_id, expires)).hex()


def stage_endpoints(
    addrs: Sequence[str], layer_ranges: Sequence[tuple[int, int]]
) -> tuple[StageEndpoint, ...]:
    """One endpoint per stage, rank order.

    Raises:
        ValueError: a stage has no transfer server (empty address: ``handoff_listen`` is "").
    """
    if len(addrs) != len(layer_ranges) or not all(addrs):
        raise ValueError(
            f"handoff_listen: every stage needs a KV transfer server; addresses {list(addrs)}"
        )
    return tuple(
        StageEndpoint(a, first, last) for a, (first, last) in zip(addrs, layer_ranges, strict=False)
    )


def kv_transfer_params(
    replica_key: BusKey,
    request_id: str,
    num_tokens: int,
    expires: float,
    endpoints: Sequence[StageEndpoint],
) -> dict[str, Any]:
    """The ``kv_transfer_params`` of a handed-off request's prefill answer (module docstring)."""
    params = HandoffParams(
        request_id=request_id,
        num_tokens=num_tokens,
        expires=expires,
        token=handoff_token(replica_key, request_id, expires),
        stages=tuple(endpoints),
    )
    return {"do_remote_prefill": True, "do_remote_decode": False, PARAMS_KEY: params.to_json()}


async def _release_stage(params: HandoffParams, addr: str, timeout_s: float) -> str:
    host, _, port = addr.rpartition(":")
    ask = {
        "op": "release",
        "request_id": params.request_id,
        "expires": float(expires_text(params.expires)),
        "token": params.token,
    }
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), timeout_s)
    try:
        writer.write(encode_json(ask))
        await writer.drain()
        head = await asyncio.wait_for(reader.readexactly(LENGTH_BYTES), timeout_s)
        body = await asyncio.wait_for(reader.readexactly(int.from_bytes(head, "big")), timeout_s)
        answer = parse_json_frame(body)
        return "" if answer.get("ok") else str(answer.get("error", "refused"))
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def release_handoff_report(
    kv_transfer_params: Mapping[str, object], timeout_s: float = 5.0
) -> list[tuple[str, str]]:
    """End a handoff's lease on every stage now (``wavepp.api.kv_handoff``'s ``release`` op
    with the prefill answer's token). Returns one ``(stage address, outcome)`` per stage, rank
    order: outcome "" when the stage still held the lease (nobody had pulled it; released now),
    else why not, in the stage's words (lease ended, already pulled, pull broken off) or the
    error that kept the stage from answering. A malformed ``kv_transfer_params`` gives []. Never
    raises; each failure is logged."""
    try:
        params = HandoffParams.from_json(kv_transfer_params[PARAMS_KEY])  # type: ignore[arg-type]
    except (KeyError, TypeError, HandoffError) as exc:
        log.warning("handoff not released: %s", exc)
        return []
    outcomes = await asyncio.gather(
        *(_release_stage(params, s.addr, timeout_s) for s in params.stages),
        return_exceptions=True,
    )
    report = []
    for stage, outcome in zip(params.stages, outcomes, strict=True):
        if outcome != "":
            log.info("release of %s on %s: %r", params.request_id, stage.addr, outcome)
        text = outcome if isinstance(outcome, str) else f"unreachable ({outcome!r})"
        report.append((stage.addr, text))
    return report


async def release_handoff(kv_transfer_params: Mapping[str, object], timeout_s: float = 5.0) -> int:
    """``release_handoff_report``'s count of stages that still held the lease and released it."""
    return sum(o == "" for _, o in await release_handoff_report(kv_transfer_params, timeout_s))


def describe_release(report: Sequence[tuple[str, str]]) -> str:
    """One line for a failed request's error: each stage's view of its handoff
    (``release_handoff_report``), e.g. ``"the stages' handoff: 10.0.0.1:7000: held, not pulled
    (released now); 10.0.0.2:7000: expires: the handoff lease of 'r1' ended at ..."``; "" for
    an empty report."""
    if not report:
        return ""
    views = (f"{addr}: {outcome or 'held, not pulled (released now)'}" for addr, outcome in report)
    return "the stages' handoff: " + "; ".join(views)
