"""Serving: the admission service process, the local (in-process) pipeline, spec -> config.

service    AdmissionService (``wavepp admission``): durable intake, scheduler, results
local      LocalPipeline: nats-server + stages + scheduler in one process tree (replay, up)
from_spec  WavePipelineSpec -> per-replica RuntimeConfig (one rule for every process)
lifecycle  child-process environment and exit-with-parent
"""
