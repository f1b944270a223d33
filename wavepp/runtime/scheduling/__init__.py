"""Wave scheduling: admitted requests -> planned micro-batches -> stages, and plan delivery.

scheduler       WaveScheduler: the asyncio driver (intake, loops, timers) around the parts below
core            SchedulerCore: I/O-free decisions; RequestRecord, one per request, owns its state
admission/      AdmissionStrategy: intake -> planning set; AsyncAdmission (wave), SyncAdmission
transport       PlanTransport protocol; BusPlanTransport over a nats.py-like bus (the simulator's)
nats_transport  NatsPlanTransport (imported only by the serving room: the simulator loads no NATS)
ledger          PlanLedger: the plans of the current epoch, to resend to a stage that missed one
stats           WaveStats: running sums and fixed windows, StageSpan
"""
