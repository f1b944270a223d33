"""A replica's stage KV managers and the agreement controller over them, for the agreement and
scheduling tests: in this process (``LocalStageClient``) or served over NATS
(``serve_stage_kv``, the stage process's own handlers)."""

from __future__ import annotations

from typing import Any

from nats.aio.client import Client as NATS

from wavepp.api.signing import BusKey
from wavepp.runtime.agreement import AgreementController, LocalStageClient
from wavepp.runtime.agreement.nats_client import NatsStageClient, serve_stage_kv
from wavepp.runtime.kv import BlockPool, StageKVManager
from wavepp.runtime.transport.natsio import flush_in_order


def local_stages(
    capacities: list[int], *, block_size: int, model_id: str, **controller: Any
) -> tuple[list[StageKVManager], AgreementController]:
    """One manager per stage of ``capacities[r]`` blocks of ``block_size`` tokens, and a
    controller over them in this process; ``controller``: more ``AgreementController``
    arguments (``lease_s``, ``max_batch``, ``bus_key``, ...)."""
    managers = [StageKVManager(BlockPool(c, block_size)) for c in capacities]
    return managers, AgreementController(
        [LocalStageClient(m, rank) for rank, m in enumerate(managers)],
        block_size=block_size,
        model_id=model_id,
        **controller,
    )


async def served_stages(
    nc: NATS,
    prefix: str,
    capacities: list[int],
    *,
    block_size: int,
    model_id: str,
    timeout_s: float,
    bus_key: BusKey | None = None,
    fanout: bool = True,
) -> tuple[list[StageKVManager], AgreementController]:
    """As :func:`local_stages`, each manager served on ``nc`` under subject ``prefix``
    (flushed: the subscriptions exist before the first round) and the controller a NATS client
    of them, signing with ``bus_key``. ``fanout``: clients of one whole replica (a round is one
    publish, ``NatsStageClient.for_replica``); False: one client per rank (a publish per
    stage)."""
    managers = [StageKVManager(BlockPool(c, block_size)) for c in capacities]
    for rank, manager in enumerate(managers):
        await serve_stage_kv(nc, prefix, rank, manager, bus_key=bus_key)
    await flush_in_order(nc)
    if fanout:
        clients = NatsStageClient.for_replica(nc, prefix, len(managers), timeout_s=timeout_s)
    else:
        clients = [
            NatsStageClient(nc, prefix, r, timeout_s=timeout_s) for r in range(len(managers))
        ]
    controller = AgreementController(
        clients, block_size=block_size, model_id=model_id, bus_key=bus_key
    )
    return managers, controller
