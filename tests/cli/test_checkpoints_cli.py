"""``python -m wavepp.bench.checkpoints`` (the README's demo checkpoint)
after only ``pip install -e .``, its ``--help``, and ``--head-dim``: a GQA checkpoint whose
heads vLLM's CPU attention takes (``wavepp up --decode vllm``), refused by name for the other
families."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from wavepp.bench import checkpoints
from wavepp.runtime.hf_config import layer_plan_from_hf


def test_without_transformers_one_line_names_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """One line naming what to install, not a ModuleNotFoundError traceback. transformers is
    installed here (the test
    extra); a None entry in sys.modules makes ``import transformers`` fail as it does without
    it."""
    monkeypatch.setitem(sys.modules, "transformers", None)
    out = tmp_path / "dsv3"
    assert checkpoints.main(["deepseek_v3", str(out), "--layers", "2"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "transformers" in err[0] and "pip install -e '.[test]'" in err[0]
    assert captured.out == "" and not out.exists()


def test_help_describes_every_argument(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        checkpoints.main(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for expected in ("model family", "directory to write", "decoder layers", "vocabulary size"):
        assert expected in text, text
    assert "seed of the random weights (default: 0)" in text


def test_readme_says_what_the_demo_checkpoint_needs() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    at = readme.index("python -m wavepp.bench.checkpoints")
    assert "pip install -e '.[test]'" in readme[at - 300 : at + 300]


@pytest.mark.parametrize("family", checkpoints.HEAD_DIM_FAMILIES)
def test_head_dim_sets_the_heads_and_the_hidden_size(family: str) -> None:
    kwargs = checkpoints.hf_config_kwargs(family, num_layers=2, head_dim=32)
    assert kwargs["head_dim"] == 32
    assert kwargs["hidden_size"] == kwargs["num_attention_heads"] * 32
    plan = layer_plan_from_hf({"model_type": family, **kwargs})
    assert plan.gqa is not None and plan.gqa.head_dim == 32
    assert (
        checkpoints.hf_config_kwargs(family, num_layers=2)["head_dim"] == 16
    )  # the default is unchanged


def test_head_dim_is_refused_for_other_families_and_below_one() -> None:
    with pytest.raises(ValueError, match="head_dim: only for llama, minimax_m2"):
        checkpoints.hf_config_kwargs("deepseek_v3", num_layers=2, head_dim=32)
    with pytest.raises(ValueError, match="head_dim=0: must be >= 1"):
        checkpoints.hf_config_kwargs("llama", num_layers=2, head_dim=0)


def test_the_command_refuses_a_head_dim_it_cannot_honour(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:  # noqa: ANN001
    with pytest.raises(SystemExit) as exc:
        checkpoints.main(["deepseek_v3", str(tmp_path / "x"), "--head-dim", "32"])
    assert exc.value.code == 2
    assert "--head-dim: head_dim: only for llama, minimax_m2" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
