"""The agreement controller of a served replica: its stages over NATS, one builder for the
admission service (``service.AdmissionService``) and the in-process pipeline
(``local.LocalPipeline``)."""

from __future__ import annotations

from nats.aio.client import Client as NATS

from wavepp.api.signing import BusKey
from wavepp.runtime.agreement import AgreementController
from wavepp.runtime.agreement.nats_client import NatsStageClient
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.planning import CostModel
from wavepp.runtime.planning.host_load import serving_agreed_blocks


def replica_controller(
    nc: NATS, config: RuntimeConfig, planner_cost_model: CostModel, replica_key: BusKey | None
) -> AgreementController:
    """The agreement controller of ``config``'s replica: its S stages over NATS (each call
    bounded by ``request_timeout_s``), each stage's owner capacity in blocks, the serving L*
    policy (``planning.host_load.serving_agreed_blocks``), rounds signed with ``replica_key``
    (``BusKey.for_replica``; None: unsigned)."""
    stages = NatsStageClient.for_replica(
        nc, config.subject_prefix, config.num_stages, config.request_timeout_s
    )
    return AgreementController(
        stages,
        block_size=config.block_size,
        model_id=config.model_id,
        lease_s=config.lease_s,
        stage_capacities=[config.owner_blocks_of(r) for r in range(config.num_stages)],
        state_interval_blocks=config.state_interval_blocks,
        agreed_blocks=serving_agreed_blocks(config, planner_cost_model),
        bus_key=replica_key,
    )
