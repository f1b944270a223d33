"""Cross-stage prefix agreement: probe-reserve, L* = min over stages, release.

    stage_handler  the stage side: a pure handler over one stage's StageKVManager
    coordinator    the controller side (AgreementController): agree, renew, release, health
    rounds         the controller's batched rounds (AgreementRounds)
    clients        StageClient protocol, LocalStageClient (in-process), StageUnavailableError
    nats_client    NatsStageClient (not re-exported here: importing this package loads no NATS)

The agreement controller runs inside the admission (request admission into the pipeline).
"""

from wavepp.runtime.agreement.clients import (
    LocalStageClient,
    StageUnavailableError,
)
from wavepp.runtime.agreement.coordinator import (
    AgreementController,
    AgreementRefused,
    StageVersionError,
    Ticket,
)
from wavepp.runtime.agreement.stage_handler import handle_kv_request

__all__ = [
    "AgreementController",
    "AgreementRefused",
    "LocalStageClient",
    "StageUnavailableError",
    "StageVersionError",
    "Ticket",
    "handle_kv_request",
]
