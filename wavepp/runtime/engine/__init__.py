"""Stage engines: one pipeline stage's decoder layers over its paged KV cache.

``torch`` runs real layers (CPU, or CUDA where present); ``emulated`` takes a cost model's time.
Import the torch engine's weight helpers from ``wavepp.runtime.engine.torch_engine``.
"""

from wavepp.runtime.engine.base import (
    ChunkSpec,
    PagedStageEngineBase,
    PreparedBatch,
    StageEngine,
    StageOutput,
    build_prepared_batch,
    make_engine,
)
from wavepp.runtime.engine.model_config import (
    PRESETS,
    ModelConfig,
    get_preset,
    partition_layers,
)

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
    "partition_layers",
]
