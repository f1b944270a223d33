"""Wave scheduling: admitted requests -> planned micro-batches -> stages, and plan delivery.

scheduler  WaveScheduler: intake, admission (async | sync), planning, publishing, dones
ledger     PlanLedger: the plans of the current epoch, for replay to a stage that missed one
"""
