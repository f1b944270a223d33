"""``python -m wavepp.bench.checkpoints --head-dim``: a GQA checkpoint whose heads vLLM's CPU
attention takes (``wavepp up --decode vllm``), refused by name for the other families."""

from __future__ import annotations

import pytest

from wavepp.bench.checkpoints import HEAD_DIM_FAMILIES, hf_config_kwargs, main
from wavepp.runtime.hf_config import layer_plan_from_hf


@pytest.mark.parametrize("family", HEAD_DIM_FAMILIES)
def test_head_dim_sets_the_heads_and_the_hidden_size(family: str) -> None:
    kwargs = hf_config_kwargs(family, num_layers=2, head_dim=32)
    assert kwargs["head_dim"] == 32
    assert kwargs["hidden_size"] == kwargs["num_attention_heads"] * 32
    plan = layer_plan_from_hf({"model_type": family, **kwargs})
    assert plan.gqa is not None and plan.gqa.head_dim == 32
    assert hf_config_kwargs(family, num_layers=2)["head_dim"] == 16  # the default is unchanged


def test_head_dim_is_refused_for_other_families_and_below_one() -> None:
    with pytest.raises(ValueError, match="head_dim: only for llama, minimax_m2"):
        hf_config_kwargs("deepseek_v3", num_layers=2, head_dim=32)
    with pytest.raises(ValueError, match="head_dim=0: must be >= 1"):
        hf_config_kwargs("llama", num_layers=2, head_dim=0)


def test_the_command_refuses_a_head_dim_it_cannot_honour(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:  # noqa: ANN001
    with pytest.raises(SystemExit) as exc:
        main(["deepseek_v3", str(tmp_path / "x"), "--head-dim", "32"])
    assert exc.value.code == 2
    assert "--head-dim: head_dim: only for llama, minimax_m2" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
