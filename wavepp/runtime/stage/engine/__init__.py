"""Stage engines: one pipeline stage's decoder layers over its paged KV cache.

``torch`` runs real layers (CPU, or CUDA where present); ``emulated`` takes a cost model's time.
Import the torch engine's weight helpers from ``wavepp.runtime.stage.engine.torch_engine``.
"""

from wavepp.runtime.model_config import (
    PRESETS,
    ModelConfig,
    get_preset,
)
from wavepp.runtime.stage.engine.base import (
    ChunkSpec,
    PagedStageEngineBase,
    PreparedBatch,
    StageEngine,
    StageOutput,
    build_prepared_batch,
)
from wavepp.runtime.stage.engine.factory import make_engine

__all__ = [
    "PRESETS",
    "ChunkSpec",
    "ModelConfig",
    "PagedStageEngineBase",
    "PreparedBatch",
    "StageEngine",
    "StageOutput",
    "build_prepared_batch",
    "get_preset",
    "make_engine",
]
