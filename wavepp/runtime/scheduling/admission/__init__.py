"""Admission strategies: how a request gets from the intake to the planning set.

contract      AdmissionStrategy (the abstract methods the scheduler calls, the pacing it asks
              of a strategy) and AdmissionHost (what a strategy needs of its scheduler)
asynchronous  AsyncAdmission: WavePP, agreements concurrent with execution
synchronous   SyncAdmission: the baseline, agreement on the critical path (TensorRT-LLM's loop)

``RuntimeConfig.resolved_agreement`` (an ``AgreementMode``) picks one of the two through
``STRATEGIES``, and ``WaveScheduler(admission=...)`` plugs in any other. Both call the agreement
controller (``AgreementController``, over the stage clients) and hand the result to the
scheduler's ``SchedulerCore``; neither touches the transport.
"""

from wavepp.runtime.config import AgreementMode
from wavepp.runtime.scheduling.admission.asynchronous import AsyncAdmission
from wavepp.runtime.scheduling.admission.contract import AdmissionHost, AdmissionStrategy
from wavepp.runtime.scheduling.admission.synchronous import SyncAdmission

__all__ = ["STRATEGIES", "AdmissionHost", "AdmissionStrategy", "AsyncAdmission", "SyncAdmission"]

# The strategy each ``AgreementMode`` (``RuntimeConfig.resolved_agreement``) selects.
STRATEGIES: dict[AgreementMode, type[AdmissionStrategy]] = {
    AgreementMode.ASYNC: AsyncAdmission,
    AgreementMode.SYNC: SyncAdmission,
}
