"""Serving: the admission service process, the local (in-process) pipeline, local processes.

service    AdmissionService (``wavepp admission``): durable intake, scheduler, heartbeat, drain
results    ResultStore: the results bucket (answers kept, entries trusted), result_from_outcome
local      LocalPipeline: nats-server + stages + scheduler in one process tree (replay, bench)
processes  the one supervisor of local child processes, a stage child's command, a pool's nats-server
lifecycle  child-process environment and exit-with-parent
"""
