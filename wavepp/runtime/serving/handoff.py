"""The prefill side of vLLM's disaggregated-serving protocol: a handed-off request's answer
carries ``kv_transfer_params`` that the decode engine's request consumes.

``kv_transfer_params`` of a WavePP prefill answer::

    {"do_remote_prefill": true, "do_remote_decode": false,
     "wavepp_handoff": HandoffParams.to_json()}   # wavepp.api.kv_handoff

A P/D router passes them unchanged into the decode request, as it does a NixlConnector's; the
decode engine's ``WavePPConnector`` pulls the KV from the stages named there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from wavepp.api.kv_handoff import HANDOFF_DOMAIN, PARAMS_KEY, HandoffParams, StageEndpoint
from wavepp.api.kv_handoff import token_payload as _payload
from wavepp.api.signing import BusKey

__all__ = ["handoff_token", "kv_transfer_params", "stage_endpoints"]


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
