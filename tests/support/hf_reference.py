"""A small seeded Llama and the same weights in Hugging Face's ``LlamaForCausalLM``: the
reference (eager attention, fp32) the torch stage engines are compared against."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from wavepp.runtime.model_config import ModelConfig
from wavepp.runtime.planning import CostModel
from wavepp.runtime.stage.engine.torch_engine import build_full_state_dict

# What the planner of a reference pipeline (LocalPipeline of a small_llama) budgets chunks with.
PIPELINE_COST = CostModel(c=1e-4, g=1e-7, b=1e-5, a=1e-8, label="measured", source="test")


def small_llama(name: str, *, seed: int, num_layers: int = 4) -> ModelConfig:
    """Vocabulary 256, hidden 64, FFN 160, 4 heads over 2 KV heads of 16 dims; seeded weights."""
    return ModelConfig(
        name=name,
        vocab_size=256,
        hidden_size=64,
        intermediate_size=160,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        seed=seed,
    )


def hf_llama(config: ModelConfig) -> Any:  # noqa: ANN401 - transformers.LlamaForCausalLM
    """transformers' Llama with eager attention, in eval mode, holding ``config``'s seeded
    weights (``build_full_state_dict``; every key matched)."""
    import transformers

    hf_config = transformers.LlamaConfig(**config.to_hf_llama_kwargs())
    hf_config._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(hf_config).eval()
    result = model.load_state_dict(build_full_state_dict(config), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    return model


def last_logits(model: Any, tokens: Sequence[int]) -> Any:  # noqa: ANN401 - torch.Tensor
    """``model``'s (a transformers causal LM, e.g. :func:`hf_llama`) fp32 logits [vocab] of the
    last of ``tokens``, one forward without a cache."""
    import torch

    with torch.inference_mode():
        return model(torch.tensor([list(tokens)])).logits[0, -1].float()
