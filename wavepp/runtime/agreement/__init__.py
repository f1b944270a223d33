"""Cross-stage prefix agreement: probe-and-pin, L* = min over stages, commit, release.

    stage_handler  the stage side: a pure handler over one stage's StageKVManager
    coordinator    the admission side (AdmissionController): agree, pin, reserve, renew, release
    clients        StageClient protocol, LocalStageClient (in-process), StageUnavailableError
    nats_client    NatsStageClient (not re-exported here: importing this package loads no NATS)

"Admission" here is request admission into the pipeline, not a Kubernetes admission controller.
"""

from wavepp.runtime.agreement.clients import (
    LocalStageClient,
    StageClient,
    StageUnavailableError,
)
from wavepp.runtime.agreement.coordinator import AdmissionController, AgreementRefused, Ticket
from wavepp.runtime.agreement.stage_handler import handle_kv_request

__all__ = [
    "AdmissionController",
    "AgreementRefused",
    "LocalStageClient",
    "StageClient",
    "StageUnavailableError",
    "Ticket",
    "handle_kv_request",
]
