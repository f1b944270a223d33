"""Small random Hugging Face checkpoints of every registered model family (tests, demos).

``save_random_checkpoint(family, DIR)`` builds a transformers model from a tiny config, gives
every weight a random value that makes routing and norms matter (the library's init leaves
norms at 1 and score-correction biases at 0), and ``save_pretrained``s it, sharded, into DIR.
Needs ``transformers`` (a test dependency: ``pip install -e '.[test]'``); the engine itself
never imports it. Without it the command says so in one line and exits 2.

    python -m wavepp.bench.checkpoints deepseek_v3 /tmp/tiny-dsv3 --layers 6
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from wavepp.runtime.families import FAMILIES

MISSING_TRANSFORMERS = (
    "needs the transformers package (a test dependency): pip install -e '.[test]' in the "
    "repository (or pip install transformers)"
)

# The tiny shapes: GQA attention (Llama, MiniMax), MLA attention with experts (DeepSeek-V3 and
# GLM-5 add a low-rank q and routed experts; Kimi its own experts and KDA).
_GQA: dict[str, Any] = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}
_MLA: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "num_experts_per_tok": 2,
}
_MLA_MOE: dict[str, Any] = {**_MLA, "q_lora_rank": 32, "n_routed_experts": 8}

_BASE: dict[str, dict[str, Any]] = {
    "llama": {**_GQA, "intermediate_size": 128},
    "deepseek_v3": {
        **_MLA_MOE,
        "n_group": 4,
        "topk_group": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5,
    },
    "glm_moe_dsa": {
        **_MLA_MOE,
        "n_group": 2,
        "topk_group": 1,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "index_topk": 8,
        "index_n_heads": 8,
        "index_head_dim": 16,
    },
    "kimi_linear": {
        **_MLA,
        "num_local_experts": 8,
        "n_group": 2,
        "topk_group": 1,
        "n_shared_experts": 1,
        "linear_num_heads": 4,
        "linear_head_dim": 8,
        "linear_conv_kernel_dim": 4,
    },
    "minimax_m2": {
        **_GQA,
        "intermediate_size": 32,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
        },
    },
}


HEAD_DIM_FAMILIES = ("llama", "minimax_m2")
"""The families whose attention head size ``--head-dim`` sets (GQA: K/V heads in the cache)."""


def hf_config_kwargs(
    family: str, *, num_layers: int, vocab_size: int = 256, head_dim: int | None = None
) -> dict[str, Any]:
    """Keyword arguments of the tiny transformers config of ``family``. ``head_dim`` (a
    ``HEAD_DIM_FAMILIES`` family only; None: 16) sets the attention heads' size and the hidden
    size to ``num_attention_heads * head_dim`` (vLLM's CPU attention takes heads of 32 or more).

    Raises:
        ValueError: an unknown family; ``head_dim`` < 1 or for another family.
    """
    if family not in _BASE:
        raise ValueError(f"family={family!r}: choose one of {list(FAMILIES)}")
    extra: dict[str, Any] = {}
    if head_dim is not None:
        if family not in HEAD_DIM_FAMILIES:
            raise ValueError(
                f"head_dim: only for {', '.join(HEAD_DIM_FAMILIES)} (family={family!r})"
            )
        if head_dim < 1:
            raise ValueError(f"head_dim={head_dim}: must be >= 1")
        heads = _BASE[family]["num_attention_heads"]
    if family == "glm_moe_dsa":
        # IndexShare: every third layer (2, 5, ...) reuses the top-k of the layer before it.
        extra["indexer_types"] = ["shared" if i % 3 == 2 else "full" for i in range(num_layers)]
    if family == "kimi_linear":
        # Hybrid: MLA every third layer (2, 5, ...), KDA elsewhere; layer 0 dense.
        extra["layer_types"] = [
            "full_attention" if i % 3 == 2 else "linear_attention" for i in range(num_layers)
        ]
        extra["mlp_layer_types"] = ["dense" if i == 0 else "sparse" for i in range(num_layers)]
    base = dict(_BASE[family])
    if head_dim is not None:
        base |= {"head_dim": head_dim, "hidden_size": heads * head_dim}
    return {
        **extra,
        **base,
        "vocab_size": vocab_size,
        "num_hidden_layers": num_layers,
        "max_position_embeddings": 16384,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": None,
    }


def save_random_checkpoint(
    family: str,
    out_dir: str | Path,
    *,
    num_layers: int = 4,
    vocab_size: int = 256,
    seed: int = 0,
    max_shard_size: str = "200KB",
    head_dim: int | None = None,
) -> Any:
    """Build, randomise and save a tiny ``family`` model; returns the model (eval, fp32).

    Weights: matrices N(0, 0.08^2) (embeddings N(0, 1)), norms 1 + N(0, 0.1^2),
    score-correction biases N(0, 0.05^2), so that every tensor changes the output.
    """
    import torch
    import transformers

    kwargs = hf_config_kwargs(
        family, num_layers=num_layers, vocab_size=vocab_size, head_dim=head_dim
    )
    config = transformers.AutoConfig.for_model(family, **kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif "embed_tokens" in name:
                param.normal_(0.0, 1.0)
            else:
                param.normal_(0.0, 0.08)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.05 * torch.randn_like(buf))
    model.save_pretrained(str(out_dir), max_shard_size=max_shard_size)
    return model


def main(argv: list[str] | None = None) -> int:
    """The command line: save a tiny random checkpoint and print its directory.

    Returns:
        0; 2 when transformers is not installed (one line on stderr naming what to install).
    """
    parser = argparse.ArgumentParser(
        prog="python -m wavepp.bench.checkpoints",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "family", choices=sorted(FAMILIES), help="model family (config.json model_type)"
    )
    parser.add_argument("out_dir", help="directory to write config.json and the safetensors into")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (num_hidden_layers)")
    parser.add_argument("--vocab", type=int, default=256, help="vocabulary size (token ids)")
    parser.add_argument("--seed", type=int, default=0, help="torch seed of the random weights")
    parser.add_argument(
        "--head-dim",
        type=int,
        default=None,
        help=f"attention head size ({', '.join(HEAD_DIM_FAMILIES)}; default 16); 32 or more "
        "for vLLM's CPU attention (wavepp up --decode vllm)",
    )
    args = parser.parse_args(argv)
    if args.head_dim is not None:
        try:
            hf_config_kwargs(args.family, num_layers=1, head_dim=args.head_dim)
        except ValueError as exc:
            parser.error(f"--head-dim: {exc}")
    try:
        import transformers  # noqa: F401
    except ImportError:
        print(f"{parser.prog}: {MISSING_TRANSFORMERS}", file=sys.stderr)
        return 2
    save_random_checkpoint(
        args.family,
        args.out_dir,
        num_layers=args.layers,
        vocab_size=args.vocab,
        seed=args.seed,
        head_dim=args.head_dim,
    )
    print(args.out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
