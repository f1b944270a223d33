"""One pipeline stage: its decisions, the worker process's I/O, plan sequencing, engines.

    core        StageCore: what a stage decides (plan order, block tables, results, done
                messages, caching computed blocks), no I/O; the worker and the simulator drive it
    chunk       ChunkSpec: a chunk as an engine sees it (no torch)
    worker      StageWorker: the stage process's I/O around the core (NATS, plan delivery,
                re-forming) on the asyncio loop thread
    compute     StageCompute: the compute thread (activations over torch.distributed, the engine)
    sequencing  PlanSequencer: plans applied in id order, gaps detected and resent
    engine/     StageEngine backends (torch, emulated) and their shared paged-KV base
    calibrate   measure an engine on an (L, x) grid and fit the cost model

Importing this package imports none of its modules (engines must stay free of NATS).
"""
