"""Pipelined, chunked, prefix-reusing torch stages vs a monolithic Hugging Face forward.

The stage engines of one model, split into 2..4 stages with block pools of different sizes
(so a request's block ids differ per stage), must give the last-token logits of
``transformers.LlamaForCausalLM`` (eager attention, fp32) loaded with the same weights.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
import torch
from hf_reference import hf_llama, last_logits, small_llama

from wavepp.api.layer_split import split_layers
from wavepp.runtime.stage.engine import ChunkSpec, make_engine
from wavepp.runtime.stage.engine.torch_engine import TorchStageEngine

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(120)

CONFIG = small_llama("ref-llama", seed=7)
ATOL = 1e-4


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    return hf_llama(CONFIG)


def random_tokens(num_tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(CONFIG.vocab_size) for _ in range(num_tokens)]


@dataclass
class Request:
    request_id: str
    tokens: list[int]
    block_tables: list[list[int]] = field(default_factory=list)  # per stage


class Pipeline:
    """Stage engines in sequence, each with its own block pool (shuffled free ids)."""

    def __init__(
        self,
        num_stages: int,
        num_blocks: Sequence[int],
        block_size: int,
        *,
        compile: bool = False,
    ) -> None:
        self.block_size = block_size
        self.engines = []
        self.free: list[list[int]] = []
        for rank, (first, last) in enumerate(split_layers(CONFIG.num_layers, num_stages)):
            engine = make_engine(
                "torch",
                model=CONFIG,
                first_layer=first,
                last_layer=last,
                num_layers_total=CONFIG.num_layers,
                compile=compile,
            )
            engine.allocate_kv(num_blocks[rank], block_size)
            self.engines.append(engine)
            ids = list(range(num_blocks[rank]))
            random.Random(100 + rank).shuffle(ids)
            self.free.append(ids)

    def add_request(
        self, request: Request, shared_from: Request | None = None, num_shared_blocks: int = 0
    ) -> None:
        """Give the request a block table on every stage covering all its tokens."""
        num_needed = -(-len(request.tokens) // self.block_size)
        request.block_tables = []
        for rank in range(len(self.engines)):
            shared = shared_from.block_tables[rank][:num_shared_blocks] if shared_from else []
            fresh = [self.free[rank].pop() for _ in range(num_needed - len(shared))]
            request.block_tables.append(shared + fresh)

    def run_microbatch(
        self, chunks: Sequence[tuple[Request, int, int, bool]]
    ) -> dict[str, torch.Tensor]:
        """chunks: (request, context_offset, num_tokens, is_last). Returns last-stage logits."""
        prepared = []
        # Every stage prepares first (plans arrive early), then activations flow.
        for rank, engine in enumerate(self.engines):
            specs = [
                ChunkSpec(
                    request_id=req.request_id,
                    context_offset=offset,
                    num_tokens=num_tokens,
                    block_ids=tuple(req.block_tables[rank]),
                    token_ids=tuple(req.tokens[offset : offset + num_tokens])
                    if rank == 0
                    else None,
                    is_last=is_last,
                )
                for req, offset, num_tokens, is_last in chunks
            ]
            prepared.append(engine.prepare(specs))
        hidden = None
        for engine, batch in zip(self.engines, prepared, strict=True):
            out = engine.execute(batch, hidden)
            if engine.is_last:
                assert out.hidden is None
                return out.last_token_logits
            assert out.hidden is not None
            assert out.hidden.shape == (batch.num_tokens, CONFIG.hidden_size)
            hidden = out.hidden
        raise AssertionError("no last stage")

    def run_chunked(self, request: Request, start: int, sizes: Sequence[int]) -> torch.Tensor:
        """Run request tokens [start, end) as consecutive single-chunk micro-batches."""
        assert start + sum(sizes) == len(request.tokens)
        offset = start
        logits: dict[str, torch.Tensor] = {}
        for i, num_tokens in enumerate(sizes):
            is_last = i == len(sizes) - 1
            logits = self.run_microbatch([(request, offset, num_tokens, is_last)])
            assert (request.request_id in logits) == is_last
            offset += num_tokens
        return logits[request.request_id]


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == (CONFIG.vocab_size,)
    assert actual.dtype == torch.float32
    assert expected.std() > 0.3, "reference logits are too flat to make the check meaningful"
    diff = (actual - expected).abs().max().item()
    assert diff < ATOL, f"max |logit difference| = {diff:.2e} >= {ATOL}"


@pytest.mark.parametrize(
    ("num_stages", "block_size", "chunk_sizes"),
    [(2, 4, [5, 13, 1, 18]), (3, 8, [9, 7, 21]), (4, 4, [37])],
)
def test_chunked_pipeline_matches_hf(
    hf_model: torch.nn.Module, num_stages: int, block_size: int, chunk_sizes: list[int]
) -> None:
    pipeline = Pipeline(num_stages, [40 + 7 * r for r in range(num_stages)], block_size)
    request = Request("a", random_tokens(sum(chunk_sizes), seed=1))
    pipeline.add_request(request)
    assert len({tuple(t) for t in request.block_tables}) > 1, "block ids should differ per stage"
    logits = pipeline.run_chunked(request, 0, chunk_sizes)
    assert_close(logits, last_logits(hf_model, request.tokens))


@pytest.mark.parametrize(
    ("num_stages", "compile"),
    [
        (2, False),
        (3, False),
        pytest.param(2, True, marks=pytest.mark.timeout(600), id="2-compiled"),
    ],
)
def test_prefix_reuse_matches_hf(hf_model: torch.nn.Module, num_stages: int, compile: bool) -> None:
    """Chunks with and without cached context; ``compile``: the torch.compile switch on."""
    block_size = 8
    pipeline = Pipeline(num_stages, [30, 45, 37][:num_stages], block_size, compile=compile)
    first = Request("first", random_tokens(29, seed=2))
    pipeline.add_request(first)
    assert_close(pipeline.run_chunked(first, 0, [11, 18]), last_logits(hf_model, first.tokens))

    # The second prompt shares 21 tokens: 2 full blocks (16 tokens) are reusable.
    num_common = 21
    second = Request("second", first.tokens[:num_common] + random_tokens(14, seed=3))
    num_shared_blocks = num_common // block_size
    cached_tokens = num_shared_blocks * block_size
    pipeline.add_request(second, shared_from=first, num_shared_blocks=num_shared_blocks)
    for rank in range(num_stages):
        assert second.block_tables[rank][:2] == first.block_tables[rank][:2]
    sizes = [6, len(second.tokens) - cached_tokens - 6]
    logits = pipeline.run_chunked(second, cached_tokens, sizes)
    assert_close(logits, last_logits(hf_model, second.tokens))


def test_prefix_reuse_reads_the_shared_blocks(hf_model: torch.nn.Module) -> None:
    """Control: corrupting a shared block on one stage changes the reusing request's logits."""
    block_size = 8
    pipeline = Pipeline(2, [20, 24], block_size)
    first = Request("first", random_tokens(24, seed=4))
    pipeline.add_request(first)
    pipeline.run_chunked(first, 0, [24])
    second = Request("second", first.tokens[:16] + random_tokens(5, seed=5))
    pipeline.add_request(second, shared_from=first, num_shared_blocks=2)
    engine = pipeline.engines[1]
    assert isinstance(engine, TorchStageEngine) and engine.kv_cache is not None
    engine.kv_cache[:, :, first.block_tables[1][1]] += 0.5
    logits = pipeline.run_chunked(second, 16, [5])
    diff = (logits - last_logits(hf_model, second.tokens)).abs().max().item()
    assert diff > 1e-3


def test_packed_microbatches_match_hf(hf_model: torch.nn.Module) -> None:
    """Chunks of several requests in one micro-batch, including a prefix-reusing one."""
    block_size = 4
    pipeline = Pipeline(3, [50, 64, 57], block_size)
    a = Request("a", random_tokens(19, seed=10))
    b = Request("b", random_tokens(26, seed=11))
    c = Request("c", random_tokens(7, seed=12))
    for req in (a, b, c):
        pipeline.add_request(req)

    out1 = pipeline.run_microbatch([(a, 0, 7, False), (b, 0, 12, False), (c, 0, 7, True)])
    assert set(out1) == {"c"}
    assert_close(out1["c"], last_logits(hf_model, c.tokens))

    # b's second chunk first, then a's last chunk; d reuses a's first block (4 tokens) and
    # starts in the same micro-batch that finishes a.
    d = Request("d", a.tokens[:6] + random_tokens(9, seed=13))
    pipeline.add_request(d, shared_from=a, num_shared_blocks=1)
    out2 = pipeline.run_microbatch([(b, 12, 5, False), (a, 7, 12, True), (d, 4, 3, False)])
    assert set(out2) == {"a"}
    assert_close(out2["a"], last_logits(hf_model, a.tokens))

    out3 = pipeline.run_microbatch([(d, 7, 8, True), (b, 17, 9, True)])
    assert set(out3) == {"b", "d"}
    assert_close(out3["b"], last_logits(hf_model, b.tokens))
    assert_close(out3["d"], last_logits(hf_model, d.tokens))
