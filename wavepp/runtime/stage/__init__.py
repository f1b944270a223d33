"""One pipeline stage: the worker process's logic, plan sequencing, engines, calibration.

    worker      StageWorker: plans in, local preparation, engine run, activations on, dones out
    sequencing  PlanSequencer: plans applied in id order, gaps detected and replayed
    engine/     StageEngine backends (torch, emulated) and their shared paged-KV base
    calibrate   measure an engine on an (L, x) grid and fit the cost model

Importing this package imports none of its modules (engines must stay free of NATS).
"""
