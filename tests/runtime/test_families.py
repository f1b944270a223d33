"""The model-family registry (``wavepp.runtime.families``): one table every config.json reader
asks, so a family plugged into it is read by hf_config, the layer plan and the cost formulas."""

from __future__ import annotations

import pydantic
import pytest

from wavepp.runtime.families import (
    FAMILIES,
    TENSOR_PARALLEL,
    ModelFamily,
    family_of,
    model_shape_from_hf,
)
from wavepp.runtime.families.gqa import Llama
from wavepp.runtime.hf_config import layer_plan_from_hf, model_config_from_hf
from wavepp.runtime.model_config import ModelConfig

LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
}


def test_every_entry_is_a_family_under_its_model_type() -> None:
    assert set(FAMILIES) == {"llama", "deepseek_v3", "minimax_m2", "glm_moe_dsa", "kimi_linear"}
    for model_type, family in FAMILIES.items():
        assert isinstance(family, ModelFamily) and family.model_type == model_type
        assert family.summary
    # KDA layers are not sharded over a tensor-parallel group
    assert TENSOR_PARALLEL == set(FAMILIES) - {"kimi_linear"}


def test_an_unknown_model_type_is_refused_by_every_reader() -> None:
    with pytest.raises(ValueError, match=r"x.json: model_type='qwen3_next' is not supported"):
        family_of("qwen3_next", "x.json")
    for read in (
        lambda c: model_config_from_hf(c, name="m"),
        layer_plan_from_hf,
        lambda c: model_shape_from_hf(c, name="m"),
    ):
        with pytest.raises(ValueError, match="model_type='qwen3_next'"):
            read({**LLAMA, "model_type": "qwen3_next"})
    with pytest.raises(pydantic.ValidationError, match="architecture='qwen3_next'"):
        ModelConfig(architecture="qwen3_next")


def test_a_family_plugged_into_the_table_is_read_everywhere(monkeypatch) -> None:
    class Clone(Llama):
        model_type = "llama_clone"
        summary = "Llama under another name"
        aliases = {"n_layer": "num_hidden_layers"}

    monkeypatch.setitem(FAMILIES, Clone.model_type, Clone())
    cfg = {k: v for k, v in LLAMA.items() if k != "num_hidden_layers"}
    cfg |= {"model_type": "llama_clone", "n_layer": 3}
    model = model_config_from_hf(cfg, name="clone")
    assert (model.architecture, model.num_layers, model.num_kv_heads) == ("llama_clone", 3, 2)
    plan = layer_plan_from_hf(cfg)
    assert plan.model_type == "llama_clone" and plan.gqa is not None and plan.num_layers == 3
    shape = model_shape_from_hf({**LLAMA, "model_type": "llama_clone"}, name="c")
    assert shape.layers == model_shape_from_hf(LLAMA, name="c").layers


def test_minimax_routing_other_than_sigmoid_is_refused_by_name() -> None:
    cfg = {
        **LLAMA,
        "model_type": "minimax_m2",
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    }
    assert layer_plan_from_hf(cfg).moe is not None
    assert layer_plan_from_hf({**cfg, "scoring_func": "sigmoid"}).moe is not None
    with pytest.raises(ValueError, match="scoring_func='softmax': MiniMax-M2 experts are routed"):
        layer_plan_from_hf({**cfg, "scoring_func": "softmax"})
