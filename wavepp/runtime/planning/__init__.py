"""Planning: the cost model, the chunk / micro-batch planner, the derived model catalogue.

    cost_model  CostModel t(L, x) and fit_cost_model (least squares over measured timings)
    progress    RequestProgress (a request's planning state), Chunk (a slice of it)
    planner     ChunkPlanner: cut admitted requests into equal-cost micro-batches;
                planner_for: the replica's planner from its RuntimeConfig
    catalogue   cost models derived from published model shapes at a stated GPU roofline
    calibration measured cost models shipped with the package (JSON)

Pure: no I/O, no torch, no NATS. Measuring a real engine (``wavepp calibrate``) lives in
``wavepp.runtime.stage.calibrate``, beside the engines it runs.
"""

from wavepp.runtime.planning.cost_model import CostModel, fit_cost_model
from wavepp.runtime.planning.planner import ChunkPlanner, planner_for
from wavepp.runtime.planning.progress import Chunk, RequestProgress

__all__ = [
    "Chunk",
    "ChunkPlanner",
    "CostModel",
    "RequestProgress",
    "fit_cost_model",
    "planner_for",
]
