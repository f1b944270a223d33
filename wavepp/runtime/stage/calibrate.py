"""Measure one stage's execution time on a grid of chunk shapes, for the cost-model fit.

For each (L, x) of the grid, a torch stage engine holding ``num_layers`` decoder layers first
prefills L context tokens into its KV cache, then runs the x-token chunk at context offset L
``repeats`` times (after one untimed warm-up); the sample is the median wall time of
``execute()`` (prepare() is local preparation, off the critical path, and not timed).

The stage measured is a middle stage (no embedding, no ``lm_head``): the last stage's extra
cost is one norm and one [hidden x vocab] product per finished request, negligible at these
shapes. The fit t(L, x) = c + g*L + b*x + a*(2*L*x + x^2) (docs/design.md "Cost model") lives in
``wavepp.runtime.planning.fit_cost_model``; this module only measures.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

from wavepp.runtime.families import family_of
from wavepp.runtime.model_config import ModelConfig
from wavepp.runtime.stage.engine.base import ChunkSpec
from wavepp.runtime.stage.engine.checkpoint_engine import CheckpointStageEngine
from wavepp.runtime.stage.engine.torch_engine import TorchStageEngine

# NOTE: context is prefilled in pieces of at most this many tokens, which bounds the
# [x, L + x] attention mask and score memory of the prefill.
_MAX_PREFILL_TOKENS = 1024


def default_grid() -> list[tuple[int, int]]:
    """A (context_offset L, num_tokens x) grid that spans every term of the cost model.

    Sized to take under about 20 s on 2 CPU cores with the tiny-llama preset and <= 4 layers
    (20 points; L up to 8192, x up to 1024).
    """
    return [
        (context_offset, num_tokens)
        for context_offset in (0, 1024, 2048, 4096, 8192)
        for num_tokens in (32, 128, 512, 1024)
    ]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_stage_costs(
    model: ModelConfig,
    *,
    num_layers: int,
    grid: Sequence[tuple[int, int]],
    repeats: int = 3,
    device: torch.device | str = "cpu",
    block_size: int = 16,
    seed: int = 0,
    model_dir: str | None = None,
) -> list[tuple[int, int, float]]:
    """Time a stage of ``num_layers`` layers of ``model`` on each chunk shape of ``grid``.

    Args:
        model: the model whose layer shapes are timed (its num_layers is ignored).
        num_layers: layers the measured stage holds (>= 1).
        grid: (L, x) pairs: L >= 0 cached context tokens, x >= 1 new tokens.
        repeats: timed runs per point (>= 1); the median is kept.
        device: "cpu" or a CUDA device.
        block_size: KV block size of the measured stage.
        seed: seed of the random activations fed to the stage.
        model_dir: a checkpoint directory (``model`` derived from it): time its layers
            ``[1, 1 + num_layers)`` with the checkpoint engine instead of random Llama layers.
            Hybrid (``kimi_linear``) checkpoints are refused: the grid revisits positions,
            which a recurrent state cannot.

    Returns:
        ``[(L, x, seconds), ...]`` in grid order; seconds is the median ``execute()`` wall time.

    Raises:
        ValueError: empty grid, a bad (L, x), num_layers / repeats / block_size < 1, or a
            checkpoint with too few layers or of a hybrid family.
    """
    if num_layers < 1:
        raise ValueError(f"num_layers={num_layers} must be >= 1")
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")
    if len(grid) == 0:
        raise ValueError("grid is empty; give at least one (L, x) pair")
    for context_offset, num_tokens in grid:
        if context_offset < 0 or num_tokens < 1:
            raise ValueError(
                f"grid point (L={context_offset}, x={num_tokens}) needs L >= 0 and x >= 1"
            )
    engine: TorchStageEngine | CheckpointStageEngine
    if model_dir is not None:
        if family_of(model.architecture).recurrent_state:
            raise ValueError(
                f"model_dir: {model.architecture} (hybrid) cannot be calibrated: its "
                "linear-attention state cannot revisit a position"
            )
        if num_layers + 1 > model.num_layers:
            raise ValueError(
                f"num_layers={num_layers}: the checkpoint has {model.num_layers} layers; "
                f"a middle stage [1, 1 + num_layers) needs num_layers <= {model.num_layers - 1}"
            )
        engine = CheckpointStageEngine(
            model=model,
            first_layer=1,
            last_layer=1 + num_layers,
            num_layers_total=model.num_layers,
            model_dir=model_dir,
            device=device,
        )
    else:
        # A middle stage: layers [1, 1 + num_layers) of a model with one more on each side.
        stage_model = model.model_copy(update={"num_layers": num_layers + 2})
        engine = TorchStageEngine(
            model=stage_model,
            first_layer=1,
            last_layer=1 + num_layers,
            num_layers_total=num_layers + 2,
            device=device,
        )
    max_tokens = max(l_ + x for l_, x in grid)
    num_blocks = -(-max_tokens // block_size)
    engine.allocate_kv(num_blocks, block_size)
    block_ids = tuple(range(num_blocks))
    dev = engine.device
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def activations(num_tokens: int) -> torch.Tensor:
        h = torch.randn((num_tokens, model.hidden_size), generator=gen)
        return h.to(device=dev, dtype=engine.activation_dtype)

    # Visit the grid by increasing L so that the cached context only ever grows: the chunk at
    # (L, x) needs KV for [0, L) only; what it writes at [L, L + x) is overwritten later.
    order = sorted(range(len(grid)), key=lambda i: grid[i])
    num_cached_tokens = 0
    results: dict[int, float] = {}
    for index in order:
        context_offset, num_tokens = grid[index]
        while num_cached_tokens < context_offset:
            num_prefill = min(_MAX_PREFILL_TOKENS, context_offset - num_cached_tokens)
            prefill = engine.prepare(
                [ChunkSpec("calibrate", num_cached_tokens, num_prefill, block_ids)]
            )
            engine.execute(prefill, activations(num_prefill))
            num_cached_tokens += num_prefill
        prepared = engine.prepare([ChunkSpec("calibrate", context_offset, num_tokens, block_ids)])
        hidden_in = activations(num_tokens)
        engine.execute(prepared, hidden_in)  # warm-up
        times_s = []
        for _ in range(repeats):
            _sync(dev)
            start_s = time.perf_counter()
            engine.execute(prepared, hidden_in)
            _sync(dev)
            times_s.append(time.perf_counter() - start_s)
        results[index] = statistics.median(times_s)
    samples = [(l_, x, results[i]) for i, (l_, x) in enumerate(grid)]
    return samples
